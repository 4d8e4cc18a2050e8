"""ZeRO-1-style data parallelism: the optimizer state sharded, each shard kept by a twin.

Every rank computes the gradient of its share of the global batch and the
gradients are summed over all ranks (``elastic.allreduce_gradients``: every rank
gets the same bits). The Adam state is cut into shards; each rank updates only
its shard (the moments and the float32 master weights, ``adam.<shard>.*``).

``--replicas R`` (default 2): the ranks form R instances of n / R ranks
(``elastic.Mesh(world, R, n / R)``, instance = replica, shard = stage); each
shard is held by one rank of every instance, its twins, which receive the same
summed gradient and apply the same update. Every step is a recovery point at no
copy (``State(per_step=True, twins=mesh)``): a lost rank's shard comes back from
its twin, bitwise, and only the random streams are replicated per step (with
``--commit-every K`` a commit every K steps too, every value replicated: the way
back, bitwise, when every twin of a shard dies at once; without, that is
``DataLost`` naming the shard). Each step
begins by gathering the model from the shards of the rank's instance (point to
point), so a failure anywhere in a step finds every survivor's shard whole. A
shrink takes the lost rank's instance out: the instances left carry the whole
global batch, and the ranks of the one taken out compute nothing but keep their
shards in step (they still get the summed gradient), twins to the end.

``--replicas 1``: one shard per rank, kept only by the store's replicas of the
last ``commit()`` (every ``--commit-every`` steps, 5 by default); after a shrink a survivor
adopts the removed rank's shard.

    python -m elastic.launch -n 4 --spares 1 --inject 2@20 -- python examples/zero1.py
    python -m elastic.launch -n 4 --rebuild shrink --inject 2@20 -- python examples/zero1.py --replicas 1
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
import torch

import elastic
from elastic.mesh import Mesh, mesh_policy
from train import add_arguments, digest, local_loss, report, setup

BETAS, EPS = (0.9, 0.999), 1e-8


def owned_shards(state: elastic.State) -> list[int]:
    """The shards whose moments this rank holds (its own, plus those adopted after a shrink)."""
    return sorted({int(name.split(".")[1]) for name in state.names() if name.startswith("adam.")})


def adam_step(flat: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr: float) -> None:
    """One Adam update of a shard, in place (the same arithmetic as torch.optim.Adam's defaults)."""
    m *= BETAS[0]
    m += (1 - BETAS[0]) * grad
    v *= BETAS[1]
    v += (1 - BETAS[1]) * grad * grad
    m_hat = m / np.float32(1 - BETAS[0] ** t)
    v_hat = v / np.float32(1 - BETAS[1] ** t)
    flat -= np.float32(lr) * m_hat / (np.sqrt(v_hat) + np.float32(EPS))


def flat_grad(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()


def train_twins(world: elastic.World, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                args: argparse.Namespace) -> tuple[elastic.TorchState, float]:
    """R instances, each shard on one rank of each; every step a recovery point."""
    mesh = Mesh(world, args.replicas, world.job.initial_size // args.replicas)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    bounds = np.linspace(0, flat.size, mesh.pp + 1).astype(int)  # shard s: [bounds[s], bounds[s+1])
    k = mesh.stage
    lo, hi = bounds[k], bounds[k + 1]
    state = elastic.TorchState(world, per_step=True, twins=mesh, twinned=("adam",), replication=args.replication,
                               step=0, loss=float("nan"), **{f"adam.{k}.m": np.zeros(hi - lo, np.float32),
                                                             f"adam.{k}.v": np.zeros(hi - lo, np.float32),
                                                             f"adam.{k}.p": flat[lo:hi].copy()})
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        m, v, p = (state[f"adam.{k}.{n}"] for n in "mvp")
        while state.step < args.steps:
            world.fault_point(state.step)
            model.zero_grad()
            mine = np.array([], np.int64)
            if mesh.working:  # the model, from the shards of this rank's instance
                hosts = mesh.stage_hosts()
                world.neighbors([(hosts[s], 0, p) for s in hosts if s != k],
                                [(hosts[s], 0, flat[bounds[s]:bounds[s + 1]]) for s in hosts if s != k],
                                step=state.step)
                flat[lo:hi] = p
                torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
                working = [mesh.rank_of(d, s) for d in mesh.in_use for s in range(mesh.pp)]
                mine = np.array_split(batches.batch(state.step), len(working))[working.index(world.rank)]
            loss, samples = local_loss(world, model, x, y, batches, state.step, args, mine=mine)
            state.step_point()  # from here the step is local: its twins hold what it makes
            adam_step(p, flat_grad(model)[lo:hi], m, v, state.step + 1, args.lr)
            state.step += 1
            state.loss = loss
            state.record_step(state.step, loss, total=args.steps, samples=samples)
            if args.commit_every and state.step % args.commit_every == 0:
                state.commit()
        return state.loss

    loss = train(world, state)
    for part in world.allgather({k: state[f"adam.{k}.p"]}):  # the model, whole, for the report
        for s, values in part.items():
            flat[bounds[s]:bounds[s + 1]] = values
    torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
    return state, loss


def train_sharded(world: elastic.World, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                  args: argparse.Namespace) -> tuple[elastic.TorchState, float]:
    """One shard per rank, committed every few steps."""
    n_params = sum(p.numel() for p in model.parameters())
    bounds = np.linspace(0, n_params, world.job.initial_size + 1).astype(int)  # shard s: [bounds[s], bounds[s+1])
    me = int(world.logical_rank)
    size = int(bounds[me + 1] - bounds[me])
    state = elastic.TorchState(world, model=model, replication=args.replication, local=("adam",), step=0,
                               loss=float("nan"), **{f"adam.{me}.{k}": np.zeros(size, np.float32) for k in "mv"})
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        while state.step < args.steps:
            world.fault_point(state.step)
            model.zero_grad()
            loss, samples = local_loss(world, model, x, y, batches, state.step, args)
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
            grad = flat_grad(model)
            updated = {}
            for s in owned_shards(state):
                lo, hi = bounds[s], bounds[s + 1]
                adam_step(flat[lo:hi], grad[lo:hi], state[f"adam.{s}.m"], state[f"adam.{s}.v"], state.step + 1, args.lr)
                updated[s] = flat[lo:hi]
            for part in world.allgather(updated):
                for s, values in part.items():
                    flat[bounds[s]:bounds[s + 1]] = values
            torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
            state.step += 1
            state.loss = loss  # committed with the rest: a job resumed after its last step still knows it
            state.record_step(state.step, loss, total=args.steps, samples=samples)
            if state.step % (args.commit_every or 5) == 0:
                state.commit()
        return state.loss

    return state, train(world, state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--replicas", type=int, default=2,
                        help="instances, each shard held by one rank of each (1: a shard per rank, committed)")
    parser.set_defaults(commit_every=0)  # twins need no commit; --replicas 1 commits every 5 steps unless told
    args = parser.parse_args()
    x, y, model = setup(args)
    world = elastic.init(policy=mesh_policy(args.replicas, copies=True) if args.replicas > 1 else None)
    torch.manual_seed(1000 + int(world.logical_rank or 0))
    state, loss = (train_twins if args.replicas > 1 else train_sharded)(world, model, x, y, args)
    owners = world.allgather(owned_shards(state))
    moments = {s: np.concatenate([state[f"adam.{s}.m"], state[f"adam.{s}.v"]]) for s in owned_shards(state)}
    all_moments = world.allgather(moments)
    if world.rank == 0:
        copies: dict[int, set[bytes]] = {}  # shard -> its holders' moments (twins: one value)
        for part in all_moments:
            for s, b in part.items():
                copies.setdefault(s, set()).add(b.tobytes())
        moments = b"".join(min(copies[s]) for s in sorted(copies))
        report(world, state, loss, model_sha256=digest(model.state_dict()), shard_owners=owners,
               twins_agree=all(len(c) == 1 for c in copies.values()),
               moments_sha256=hashlib.sha256(moments).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
