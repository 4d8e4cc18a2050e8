"""Data-parallel torch training that survives the loss of ranks.

A small MLP with dropout learns a fixed random "teacher" network on synthetic
data. Every rank holds the whole model; each step, the global batch (the same
sequence whatever the world size, see ``elastic.GlobalBatches``) is split over
the active ranks, gradients are summed with a bucketed all-reduce and every
rank takes the same Adam step. The state (model, optimizer, RNGs, step) is
committed to peers' memory every ``--commit-every`` steps.

    python -m elastic.launch -n 4 --spares 1 --inject 1@20 -- python examples/train.py

With a spare or a spawned replacement the final model and optimizer are
bitwise those of a failure-free run. After a shrink the same global batches
are used, but not bitwise the same arithmetic: the all-reduce sums over fewer
ranks in another order (float addition is not associative), and dropout
masks come from per-rank random streams that now cover other samples. With
``--dropout 0`` only the rounding differs.
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
import torch
from mpi4py import MPI

import elastic


def make_data(samples: int, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    teacher = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        y = teacher(x) + 0.05 * torch.randn(samples, 1, generator=gen)
    return x, y


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # the same initial model everywhere (sync checks it anyway)
    return torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                               torch.nn.Dropout(args.dropout), torch.nn.Linear(args.hidden, args.hidden),
                               torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1))


def setup(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """Data and model, built before elastic.init() so that a parked spare is ready to take over."""
    torch.set_num_threads(1)  # ranks share the cores; one thread each also keeps kernels deterministic
    x, y = make_data(args.samples, args.features, args.seed)
    model = make_model(args)
    model(x[:2]).sum().backward()  # warm up torch's kernels before any timing matters
    model.zero_grad(set_to_none=True)
    return x, y, model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options train.py and zero1.py share."""
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="global batch, kept after a shrink")
    parser.add_argument("--micro-batch", type=int, default=None, help="gradient accumulation piece per rank")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--lr-step", type=int, default=0,
                        help="decay the learning rate by 0.7 every N steps (a StepLR, stored in the State)")
    parser.add_argument("--replication", type=int, default=None,
                        help="copies of each rank's own state (default: the job's --redundancy, else 2)")
    parser.add_argument("--seed", type=int, default=0)


def local_loss(world: elastic.World, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               batches: elastic.GlobalBatches, step: int, args: argparse.Namespace,
               mine: np.ndarray | None = None) -> tuple[float, list[float]]:
    """Backward over this rank's share of global batch ``step`` (``mine``: other indices, none
    for a rank that computes nothing) and all-reduce the gradients (collective). Returns the
    global loss and the fingerprint of the samples used."""
    mine = batches.shard(step, world) if mine is None else mine
    local = torch.zeros(())
    for part in elastic.micro_batches(mine, args.micro_batch):
        idx = torch.from_numpy(part)
        # Scaled by the global batch: the all-reduced sum is the global mean at any world size.
        part_loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum") / args.batch
        part_loss.backward()
        local += part_loss.detach()
    elastic.allreduce_gradients(world, model, step=step)
    # Loss, and a fingerprint of which samples the ranks used (count, sum, sum of squares).
    tally = np.array([float(local), len(mine), mine.sum(), (mine.astype(np.float64) ** 2).sum()])
    with world.mpi.guard():
        world.mpi.comm.Allreduce(MPI.IN_PLACE, tally)
    return float(tally[0]), tally[1:].tolist()


def step_tally(world: elastic.World, share: float, mine: np.ndarray, args: argparse.Namespace) -> np.ndarray:
    """Before a step's optimizer update (collective): the global loss from this rank's ``share``
    (its samples' summed loss) and which samples the ranks used (count, sum, sum of squares),
    summed over the ranks."""
    tally = np.array([share / args.batch, len(mine), mine.sum(), (mine.astype(np.float64) ** 2).sum()])
    world.allreduce([tally])
    return tally


def step_done(state: elastic.State, tally: np.ndarray, args: argparse.Namespace) -> None:
    """After the update (local): the step's tally recorded; the loop moves to the next step."""
    state.step += 1
    state.loss = float(tally[0])
    state.record_step(state.step, state.loss, total=args.steps, samples=tally[1:].tolist())


def digest(state_dict: dict) -> str:
    """sha256 over every tensor of a (possibly nested) state dict, in key order."""
    h = hashlib.sha256()

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            h.update(obj.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                walk(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        else:
            h.update(repr(obj).encode())
    walk(state_dict)
    return h.hexdigest()


def report(world: elastic.World, state: elastic.State, loss: float, **fields: object) -> None:
    """Rank 0 prints the outcome and records it in the events (local)."""
    if world.rank != 0:
        return
    print(f"[train] done: {state.step} steps on {world.size} ranks, generation {world.generation}, "
          f"loss {loss:.6f}, model sha256 {fields.get('model_sha256')}", flush=True)
    world.events.emit("result", steps=state.step, size=world.size, generation=world.generation, final_loss=loss,
                      logical_ranks=[int(r) for r in world.logical_ranks], **fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--per-step", action="store_true",
                        help="every optimizer step a recovery point (TorchState(per_step=True)): a failure loses "
                             "only the step in flight; --commit-every then only checks the replicas agree")
    args = parser.parse_args()
    x, y, model = setup(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Stored like the model: after a roll-back it is where it was at the commit, not steps ahead.
    extra = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, args.lr_step, 0.7)} if args.lr_step else {}
    world = elastic.init()
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    state = elastic.TorchState(world, model=model, optimizer=optimizer, replication=args.replication,
                               per_step=args.per_step, step=0, loss=float("nan"), **extra)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    def on_reset(world: elastic.World, rebuild: elastic.Rebuild) -> None:
        """After a rebuild and the roll-back, before training goes on: what lives outside the State is
        redone here (a DataLoader, a logger, a learning-rate scale). This program has nothing to redo."""
        world.events.emit("reset_hook", mode=rebuild.mode, failed=sorted(map(int, rebuild.failed)), size=world.size)

    @elastic.run(on_reset=on_reset)
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        while state.step < args.steps:
            if state.dropped(state.step + 1):  # a NaN / Inf there, dropped (ELASTIC_ON_NONFINITE=skip)
                state.step += 1
                continue
            world.fault_point(state.step)
            optimizer.zero_grad()
            loss, samples = local_loss(world, model, x, y, batches, state.step, args)
            # The gradients' global norm for the integrity gate (clip_grad_norm_ returns the same).
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            if args.lr_step:
                state.scheduler.step()
            state.step += 1
            state.loss = loss  # committed with the rest: a job resumed after its last step still knows it
            state.record_step(state.step, loss, total=args.steps, grad_norm=grad_norm, samples=samples, lr=lr)
            if state.step % args.commit_every == 0:
                state.commit()
        return state.loss

    loss = train(world, state)
    report(world, state, loss, model_sha256=digest(model.state_dict()),
           optimizer_sha256=digest(optimizer.state_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
