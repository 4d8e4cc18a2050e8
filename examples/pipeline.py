"""Pipeline-parallel training of a small decoder-only transformer that survives losing stages.

One stage per logical rank (blocks of one shape; the embedding on the first, the head on the last),
GPipe order through mpi4py, synthetic text; with ``--dp D``, D data-parallel replicas of the
pipeline (``examples/hybrid.py``: logical rank r holds stage r % pp of replica r // pp, the twins
of a stage average their gradients). ``elastic.pipeline.roll_forward`` applies a step on every
rank or on none, and the library brings a lost stage back (``StageRebuild``): from a live twin
(exact); else from the copies every rank commits to the store every ``--commit-every`` steps
(every rank rolls back to that commit: exact); else by CheckFree from its neighbours
(``--checkfree-plus`` for the end stages); else every rank stops with ``Unrecoverable`` naming
the stages. A lost stage needs a new process (a spare or a spawned one); a shrink is taken only
where a whole replica is left, which then carries the global batch.

    python -m elastic.launch -n 4 --spares 1 --inject 1@30 -- python examples/pipeline.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
import torch
from torch import nn

import elastic
from elastic.mesh import Mesh, mesh_policy
from elastic.pipeline import StageRebuild, body_grad_norm, roll_forward

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


def train_step(world: elastic.World, hosted: dict[int, Stage], host: dict[int, int], stages: int,
               batch: torch.Tensor, args: argparse.Namespace) -> float:
    """Forward and backward of one global batch through the pipeline (collective over the stages); returns
    the batch loss on every rank, leaves the gradients in the hosted stages. Hops on one rank stay local."""
    comm = world.mpi.comm
    micro = batch.chunk(args.micro)
    shape = (micro[0].shape[0], args.seq, args.dim)
    hop = Hop(comm, int(world.rank), host, shape)
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    with world.mpi.guard():
        loss_sum = sum(forward(hop, hosted, m, tokens, route(m, stages, args.checkfree_plus), saved, args.micro)
                       for m, tokens in enumerate(micro))
        for m in reversed(range(len(micro))):
            backward(hop, hosted, m, route(m, stages, args.checkfree_plus), saved)
        loss = np.array([loss_sum], np.float64)  # nonzero only where a last stage is: the sum is its loss
        comm.Allreduce(loss.copy(), loss)         # (and, in a mesh, the sum of every replica's)
        return float(loss[0])


class Hop:
    """An activation or its gradient to or from the rank hosting a stage (local on this rank)."""

    def __init__(self, comm, mine: int, host: dict[int, int], shape: tuple[int, ...]) -> None:
        self.comm, self.mine, self.host, self.shape = comm, mine, host, shape

    def local(self, stage: int) -> bool:
        return self.host[stage] == self.mine

    def recv(self, stage: int, tag: int) -> torch.Tensor:
        buf = np.empty(self.shape, np.float32)
        self.comm.Recv(buf, source=self.host[stage], tag=tag)
        return torch.from_numpy(buf)

    def send(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        self.comm.Send(tensor.numpy(), dest=self.host[stage], tag=tag)


def forward(hop: Hop, hosted: dict[int, Stage], m: int, tokens: torch.Tensor, path: list[tuple[str, int]],
            saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], micro: int) -> float:
    """Micro-batch ``m`` through this rank's stages of ``path``; returns its loss where the head is here."""
    loss = 0.0
    for j, (part, s) in enumerate(path):
        if s not in hosted:
            continue
        if j == 0:
            inp = tokens[:, :-1]
        elif hop.local(path[j - 1][1]):
            inp = saved[(m, j - 1)][1].detach().requires_grad_()
        else:
            inp = hop.recv(path[j - 1][1], TAG + j).requires_grad_()
        out = getattr(hosted[s], part)(inp)
        if part == "head":
            out = nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten()) / micro
            loss += float(out.detach())
        saved[(m, j)] = (inp, out)
        if j + 1 < len(path) and not hop.local(path[j + 1][1]):
            hop.send(out.detach(), path[j + 1][1], TAG + j + 1)
    return loss


def backward(hop: Hop, hosted: dict[int, Stage], m: int, path: list[tuple[str, int]],
             saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Micro-batch ``m``'s gradients back through this rank's stages of ``path``."""
    for j in reversed(range(len(path))):
        if path[j][1] not in hosted:
            continue
        inp, out = saved[(m, j)]
        if j == len(path) - 1:
            out.backward()
        elif hop.local(path[j + 1][1]):
            out.backward(saved[(m, j + 1)][0].grad)
        else:
            out.backward(hop.recv(path[j + 1][1], TAG + 100 + j))
        if j > 0 and not hop.local(path[j - 1][1]):
            hop.send(inp.grad, path[j - 1][1], TAG + 100 + j - 1)


# ------------------------------------------------------------------ the loop
def main(dp: int = 1, pp: int = 4) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkfree-plus", action="store_true", help="swapped-order micro-batches, end-layer copies")
    parser.add_argument("--average-moments", action="store_true", help="rebuild Adam's moments by CheckFree too")
    # -n dp*pp; batch: global, micro: per replica; commit-every: steps between copies in the store (0: none)
    for name, default in (("dp", dp), ("pp", pp), ("commit-every", 5), ("steps", 60), ("batch", 16), ("micro", 4),
                          ("samples", 1024), ("seq", 32), ("vocab", 64), ("dim", 64), ("heads", 4), ("blocks", 1),
                          ("lr", 3e-3), ("seed", 0)):
        parser.add_argument(f"--{name}", type=type(default), default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = elastic.init(policy=mesh_policy(args.dp, args.pp, checkfree_plus=args.checkfree_plus,
                                            copies=args.commit_every > 0))
    mesh = Mesh(world, args.dp, args.pp)
    me, s = int(world.logical_rank), mesh.stage
    text = make_text(args)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    stage = Stage(s, args.pp, args)  # the same initialisation on every replica
    rebuilder = StageRebuild(world, args.pp, plus=args.checkfree_plus, average_moments=args.average_moments,
                             replicas=args.dp, commit_every=args.commit_every)
    run = {"optimizer": torch.optim.Adam(stage.parameters(), lr=args.lr), "gnorm": 1.0, "loss": float("nan")}

    def compute(step: int) -> float:
        replicas = len(mesh.in_use)
        if not mesh.working:  # a shrink took part of this replica: the others carry the batch
            run["loss"] = train_step(world, {}, {}, args.pp, text[:0], args) / replicas  # the loss sum only
            return run["loss"]
        run["optimizer"].zero_grad()
        mine = mesh.shard(batches.batch(step))
        loss = train_step(world, {s: stage}, mesh.stage_hosts(), args.pp, text[torch.from_numpy(mine)], args)
        grads = [p.grad for p in stage.parameters()]
        mesh.allreduce_stage([g.numpy() for g in grads], step)
        for g in grads:
            g.div_(replicas)
        run["loss"] = loss / replicas
        return run["loss"]

    def apply(step: int) -> None:
        if mesh.working:
            run["gnorm"] = body_grad_norm(stage)
            run["optimizer"].step()

    def rebuild(lost: set[int]) -> int | None:
        run["optimizer"], run["gnorm"], resume = rebuilder.rebuild(
            lost, me, stage, run["optimizer"], run["gnorm"],
            lambda boost: torch.optim.Adam(stage.parameters(), lr=args.lr * boost))
        return resume  # the step to go on from after a roll-back to the store's copies

    steps = roll_forward(world, args.steps, compute, apply, rebuild,
                         after=lambda step: rebuilder.after_step(step, stage, run["optimizer"], run["gnorm"]))

    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in stage.state_dict().values())).hexdigest()
    finite = all(bool(torch.isfinite(p).all()) for p in stage.parameters())
    stages = sorted(world.allgather({"replica": mesh.replica, "stage": s, "sha256": digest, "finite": finite}),
                    key=lambda r: (r["replica"], r["stage"]))
    if world.rank == 0:
        in_use = [r for r in stages if r["replica"] in mesh.in_use]
        replicas_equal = all(r["sha256"] == in_use[r["stage"]]["sha256"] for r in in_use)
        model = hashlib.sha256("".join(r["sha256"] for r in in_use[:args.pp]).encode()).hexdigest()
        print(f"[pipeline] {steps} steps, {args.dp} x {args.pp} mesh, replicas in use {mesh.in_use}, "
              f"generation {world.generation}, replicas equal: {replicas_equal}, loss {run['loss']:.6f}")
        print(f"model sha256 {model}")
        world.events.emit("result", steps=steps, stages=in_use, replicas_equal=replicas_equal, sha256=model,
                          in_use=mesh.in_use, final_loss=run["loss"], generation=world.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
