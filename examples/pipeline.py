"""Pipeline-parallel training of a small decoder-only transformer that survives the loss of a stage.

One stage per logical rank (blocks of one shape; the embedding on the first, the head on the last),
GPipe order through mpi4py, synthetic text. A stage lives on its rank only. Ways back (``--recovery``;
the library's part is ``elastic.pipeline``): ``replica`` (committed to the replicated store: exact, on
a spare, a spawned process, or after a shrink on the neighbour, which then hosts two stages);
``checkfree`` (no copy: ``roll_forward`` applies a step only once every stage finished it, and
``StageRebuild`` rebuilds a lost stage from its neighbours; ``--checkfree-plus`` for the end stages);
``random`` (re-initialise it) and ``disk`` (torch.save, everyone rolls back) as baselines.

    python -m elastic.launch -n 4 --spares 1 --inject 1@30 -- python examples/pipeline.py --recovery checkfree
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import elastic
from elastic.mesh import without_shrink
from elastic.pipeline import StageRebuild, body_grad_norm, host_stages, roll_forward, stage_state

TAG = 900


# ------------------------------------------------------------------ model and data
class Block(nn.Module):
    """A pre-norm causal transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.ln1(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class Embed(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos[: tokens.shape[1]]


class Stage(nn.Module):
    """Stage ``s`` of ``S``: the blocks, and the embedding (first) or the head (last)."""

    def __init__(self, s: int, stages: int, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(args.seed * 1000 + s)  # each stage's own initialisation, the same in every process
        self.body = nn.Sequential(*(Block(args.dim, args.heads) for _ in range(args.blocks)))
        self.embed = Embed(args.vocab, args.seq, args.dim) if s == 0 else None
        self.head = nn.Sequential(nn.LayerNorm(args.dim), nn.Linear(args.dim, args.vocab)) if s == stages - 1 else None


def make_text(args: argparse.Namespace) -> torch.Tensor:
    """Synthetic text in which a token mostly follows from the one two places back (a fixed random map):
    a previous-token model cannot predict it, so the stages' attention blocks carry the skill."""
    rng = np.random.default_rng(args.seed)
    follow = rng.permutation(args.vocab)
    tokens = rng.integers(args.vocab, size=(args.samples, args.seq + 1))
    keep = rng.random((args.samples, args.seq + 1)) < 0.9
    for t in range(2, args.seq + 1):
        tokens[:, t] = np.where(keep[:, t], follow[tokens[:, t - 2]], tokens[:, t])
    return torch.from_numpy(tokens)


# ------------------------------------------------------------------ the pipeline step
def route(micro: int, stages: int, plus: bool) -> list[tuple[str, int]]:
    """The (part, stage) order one micro-batch goes through; CheckFree+ swaps the end pairs for odd ones."""
    bodies = list(range(stages))
    if plus and micro % 2 and stages > 2:
        bodies[0], bodies[1] = 1, 0
        bodies[-1], bodies[-2] = stages - 2, stages - 1
    return [("embed", 0)] + [("body", s) for s in bodies] + [("head", stages - 1)]


def stage_hosts(world: elastic.World, hosted: dict[int, "Stage"]) -> dict[int, int]:
    """stage -> the current rank hosting it (collective): after a shrink a rank hosts two."""
    return {s: r for r, stages in enumerate(world.allgather(sorted(hosted))) for s in stages}


def train_step(world: elastic.World, hosted: dict[int, Stage], host: dict[int, int], stages: int,
               batch: torch.Tensor, args: argparse.Namespace) -> float:
    """Forward and backward of one global batch through the pipeline (collective over the stages); returns
    the batch loss on every rank, leaves the gradients in the hosted stages. Hops on one rank stay local."""
    comm = world.mpi.comm
    mine = int(world.rank)
    micro = batch.chunk(args.micro)
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    loss_sum = 0.0
    shape = (micro[0].shape[0], args.seq, args.dim)
    with world.mpi.guard():
        for m, tokens in enumerate(micro):
            path = route(m, stages, args.checkfree_plus)
            for j, (part, s) in enumerate(path):
                if s not in hosted:
                    continue
                if j == 0:
                    inp = tokens[:, :-1]
                elif host[path[j - 1][1]] == mine:
                    inp = saved[(m, j - 1)][1].detach().requires_grad_()
                else:
                    buf = np.empty(shape, np.float32)
                    comm.Recv(buf, source=host[path[j - 1][1]], tag=TAG + j)
                    inp = torch.from_numpy(buf).requires_grad_()
                out = getattr(hosted[s], part)(inp)
                if part == "head":
                    out = nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()) / args.micro
                    loss_sum += float(out.detach())
                saved[(m, j)] = (inp, out)
                if j + 1 < len(path) and host[path[j + 1][1]] != mine:
                    comm.Send(out.detach().numpy(), dest=host[path[j + 1][1]], tag=TAG + j + 1)
        for m in reversed(range(len(micro))):
            path = route(m, stages, args.checkfree_plus)
            for j in reversed(range(len(path))):
                if path[j][1] not in hosted:
                    continue
                inp, out = saved[(m, j)]
                if j == len(path) - 1:
                    out.backward()
                elif host[path[j + 1][1]] == mine:
                    out.backward(saved[(m, j + 1)][0].grad)
                else:
                    grad = np.empty(shape, np.float32)
                    comm.Recv(grad, source=host[path[j + 1][1]], tag=TAG + 100 + j)
                    out.backward(torch.from_numpy(grad))
                if j > 0 and host[path[j - 1][1]] != mine:
                    comm.Send(inp.grad.numpy(), dest=host[path[j - 1][1]], tag=TAG + 100 + j - 1)
        loss = np.array([loss_sum], np.float64)  # nonzero only where a last stage is: the sum is its loss
        comm.Allreduce(loss.copy(), loss)         # (and, in a mesh, the sum of every replica's)
        return float(loss[0])


# ------------------------------------------------------------------ the loops
def run_without_copies(world: elastic.World, stage: Stage, optimizer: torch.optim.Optimizer, me: int, stages: int,
                       text: torch.Tensor, batches: elastic.GlobalBatches, args: argparse.Namespace) -> int:
    """checkfree / random / disk, on ``elastic.pipeline.roll_forward``: a step lands on every stage or on none."""
    rebuilder = StageRebuild(world, stages, plus=args.checkfree_plus, average_moments=args.average_moments)
    ckpt = Path(args.checkpoint_dir) / f"stage{me}.pt" if args.recovery == "disk" else None
    hosted = {me: stage}
    # A replacement learns the hosts with the survivors, after the rebuild (the same collective order).
    run = {"optimizer": optimizer, "gnorm": 1.0,
           "host": {} if world.role is elastic.Role.RECOVERED else stage_hosts(world, hosted)}

    def compute(step: int) -> float:
        run["optimizer"].zero_grad()
        return train_step(world, hosted, run["host"], stages, text[torch.from_numpy(batches.batch(step))], args)

    def apply(step: int) -> None:
        run["gnorm"] = body_grad_norm(stage)
        run["optimizer"].step()

    def after(step: int) -> None:
        rebuilder.keep_end_copies(stage, me)
        if ckpt is not None and step % args.commit_every == 0:
            torch.save({"stage": stage.state_dict(), "optimizer": run["optimizer"].state_dict(), "step": step}, ckpt)
            world.vote(True)  # a checkpoint is whole once every stage wrote its part

    def rebuild(lost: set[int]) -> int | None:
        resume = None
        if ckpt is not None:
            saved = torch.load(ckpt, weights_only=False)
            stage.load_state_dict(saved["stage"]), run["optimizer"].load_state_dict(saved["optimizer"])
            resume = saved["step"]
            world.events.emit("checkpoint_loaded", step=resume)
        elif args.recovery == "random":
            if me in lost:
                world.events.emit("stage_rebuilt", stage=me, method="random", sources=[], moments=False)
                run["optimizer"] = torch.optim.Adam(stage.parameters(), lr=args.lr)
        else:
            run["optimizer"], run["gnorm"] = rebuilder.rebuild(
                lost, me, stage, run["optimizer"], run["gnorm"],
                lambda boost: torch.optim.Adam(stage.parameters(), lr=args.lr * boost))
        run["host"] = stage_hosts(world, hosted)
        return resume

    return roll_forward(world, args.steps, compute, apply, rebuild, after)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recovery", choices=("replica", "checkfree", "random", "disk"), default="replica")
    parser.add_argument("--checkfree-plus", action="store_true", help="swapped-order micro-batches, end-layer copies")
    parser.add_argument("--average-moments", action="store_true", help="rebuild Adam's moments by CheckFree too")
    for name, default in (("steps", 60), ("batch", 16), ("micro", 4), ("samples", 1024), ("seq", 32), ("vocab", 64),
                          ("dim", 64), ("heads", 4), ("blocks", 1), ("lr", 3e-3), ("commit-every", 5), ("seed", 0)):
        parser.add_argument(f"--{name}", type=type(default), default=default)  # blocks: per stage
    parser.add_argument("--checkpoint-dir", default=None, help="for --recovery disk (default: the run directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = make_text(args)
    # Without copies a lost stage needs a new process (spare or spawn) to be rebuilt on.
    policy = elastic.Policy.from_env()
    world = elastic.init(policy=policy if args.recovery == "replica" else without_shrink(policy))
    stages, me = world.job.initial_size, int(world.logical_rank)
    args.checkpoint_dir = args.checkpoint_dir or os.environ.get("ELASTIC_RUN_DIR", ".")
    stage = Stage(me, stages, args)
    optimizer = torch.optim.Adam(stage.parameters(), lr=args.lr)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    hosted = {me: stage}
    if args.recovery == "replica":
        optimizers = {me: optimizer}
        state = stage_state(world, stage, optimizer, step=0)

        def make(s: int) -> tuple[Stage, torch.optim.Optimizer]:
            made = Stage(s, stages, args)
            return made, torch.optim.Adam(made.parameters(), lr=args.lr)

        @elastic.run
        def train(world: elastic.World, state: elastic.TorchState) -> None:
            host_stages(state, hosted, optimizers, make)  # a replacement, or a removed neighbour's stage
            host = stage_hosts(world, hosted)
            while state.step < args.steps:
                world.fault_point(state.step)
                for opt in optimizers.values():
                    opt.zero_grad()
                loss = train_step(world, hosted, host, stages, text[torch.from_numpy(batches.batch(state.step))], args)
                for opt in optimizers.values():
                    opt.step()
                state.step += 1
                state.record_step(state.step, loss, total=args.steps)
                if state.step % args.commit_every == 0:
                    state.commit()

        train(world, state)
        steps = state.step
    else:
        steps = run_without_copies(world, stage, optimizer, me, stages, text, batches, args)

    fresh = {s: Stage(s, stages, args).state_dict() for s in hosted}
    mine = [{"stage": s, "sha256": hashlib.sha256(b"".join(v.numpy().tobytes() for v in st.state_dict().values()))
             .hexdigest(), "finite": all(bool(torch.isfinite(p).all()) for p in st.parameters()),
             "shapes_ok": all(a.shape == b.shape for a, b in zip(st.state_dict().values(), fresh[s].values()))}
            for s, st in sorted(hosted.items())]
    report = sorted((r for part in world.allgather(mine) for r in part), key=lambda r: r["stage"])
    if world.rank == 0:
        print(f"[pipeline] {steps} steps, {stages} stages, recovery {args.recovery}, generation {world.generation}")
        world.events.emit("result", steps=steps, stages=report, generation=world.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
