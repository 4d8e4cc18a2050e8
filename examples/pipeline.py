"""Pipeline-parallel training of a small decoder-only transformer that survives the loss of a stage.

Each logical rank holds one stage: transformer blocks of the same shape, plus
the embedding on stage 0 and the final norm and LM head on the last stage.
Every step, the global batch (synthetic text from a fixed random bigram
model) is cut into micro-batches; activations go forward and gradients back
through mpi4py in GPipe order (all forwards, then all backwards). A stage's
weights live on its rank only, so losing the rank loses them. Ways back
(``--recovery``):

* ``replica``: the stage's weights and optimizer state are committed to the
  replicated store every ``--commit-every`` steps; a spare or spawned
  process gets them back bit for bit, or after a shrink the neighbouring
  stage's rank adopts them and hosts two stages; everyone rolls back to the
  commit (bitwise the failure-free run).
* ``checkfree``: no copy anywhere. A step's update is applied only after a
  ULFM Agree vote, so survivors never disagree on the step. An interior stage
  comes back as the average of its neighbours weighted by their last gradient
  norms; the first / last stage (``--checkfree-plus``: half the micro-batches
  run stage 2 before stage 1 and stage S-1 before S, and stages 1 and S-2 keep
  copies of the embedding and head) as a copy of its swapped neighbour. The
  rebuilt stage starts with a fresh optimizer at 1.1x the learning rate, or
  (``--average-moments``) with its neighbours' Adam moments averaged alike.
  Training goes on from the current step.
* ``random``: the lost stage starts again from a fresh random initialisation.
* ``disk``: every rank writes its stage with torch.save every ``--commit-every``
  steps; all roll back to that checkpoint.

    python -m elastic.launch -n 4 --spares 1 --inject 1@30 -- python examples/pipeline.py --recovery checkfree
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import elastic
from elastic.recovery import LR_BOOST, checkfree_average, plan_stage_recovery

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


class Head(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(h))


class Stage(nn.Module):
    """Stage ``s`` of ``S``: the blocks, and the embedding (first) or the head (last)."""

    def __init__(self, s: int, stages: int, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(args.seed * 1000 + s)  # each stage's own initialisation, the same in every process
        self.body = nn.Sequential(*(Block(args.dim, args.heads) for _ in range(args.blocks)))
        self.embed = Embed(args.vocab, args.seq, args.dim) if s == 0 else None
        self.head = Head(args.vocab, args.dim) if s == stages - 1 else None


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
    with world.guard():
        return {s: r for r, stages in enumerate(world.comm.allgather(sorted(hosted))) for s in stages}


def train_step(world: elastic.World, hosted: dict[int, Stage], host: dict[int, int], stages: int,
               batch: torch.Tensor, args: argparse.Namespace) -> float:
    """Forward and backward of one global batch through the pipeline (collective over the stages).

    Returns the batch loss (on every rank). Gradients are left in the hosted stages; no update.
    Hops between stages on the same rank stay local.
    """
    comm = world.comm
    mine = int(world.rank)
    micro = batch.chunk(args.micro)
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    loss_sum = 0.0
    shape = (micro[0].shape[0], args.seq, args.dim)
    with world.guard():
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
                    out = nn.functional.cross_entropy(out.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)) / args.micro
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
        return float(comm.bcast(loss_sum, root=host[stages - 1]))


def body_grad_norm(stage: Stage) -> float:
    """L2 norm of the blocks' gradients, before any clipping (CheckFree's weight)."""
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in stage.body.parameters() if p.grad is not None))


# ------------------------------------------------------------------ CheckFree recovery
def arrays(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def load(module: nn.Module, values: dict[str, np.ndarray]) -> None:
    module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in values.items()})


def moments(stage: Stage, optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Adam's moments of the blocks, by parameter name (empty before the first step)."""
    out = {}
    for name, p in stage.body.named_parameters():
        st = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                out[f"{name}:{key}"] = st[key].numpy().copy()
    return out


def rebuild_lost_stages(world: elastic.World, stage: Stage, optimizer: torch.optim.Optimizer, me: int,
                        stages: int, lost: set[int], gnorm: float, copies: dict, args: argparse.Namespace):
    """Collective over the stages: CheckFree(+) or random re-initialisation of the lost ones.

    Returns the optimizer to go on with (a fresh one on a rebuilt stage).
    """
    try:
        plan = [] if args.recovery == "random" else plan_stage_recovery(stages, lost, {}, args.checkfree_plus)
    except elastic.Unrecoverable as exc:  # every stage plans from the same agreed rebuild: stop together
        raise elastic.agreed(exc) from None
    comm = world.comm
    with world.guard():
        for rebuilt in plan:
            dest = int(world.current_rank_of(rebuilt.stage))
            for src in rebuilt.sources:
                if src == me:  # a neighbour: its blocks, its gradient norm, what the rebuilt stage needs of it
                    extra = {"embed": copies.get("embed"), "head": copies.get("head")}
                    comm.send((arrays(stage.body), gnorm, moments(stage, optimizer) if args.average_moments else {},
                               extra), dest=dest, tag=TAG + 300 + src)
            if rebuilt.stage == me:
                got = {src: comm.recv(source=int(world.current_rank_of(src)), tag=TAG + 300 + src)
                       for src in rebuilt.sources}
                if rebuilt.method == "checkfree":
                    (b0, n0, m0, _), (b1, n1, m1, _) = got[rebuilt.sources[0]], got[rebuilt.sources[1]]
                    load(stage.body, checkfree_average(b0, b1, n0, n1))
                    avg_moments = checkfree_average(m0, m1, n0, n1) if m0 and m1 else {}
                else:  # checkfree+: the swapped neighbour's blocks, and the end layer it kept a copy of
                    body, _, avg_moments, extra = got[rebuilt.sources[0]]
                    load(stage.body, body)
                    load(stage.embed if rebuilt.stage == 0 else stage.head,
                         extra["embed" if rebuilt.stage == 0 else "head"])
                world.events.emit("stage_rebuilt", stage=rebuilt.stage, method=rebuilt.method,
                                  sources=list(rebuilt.sources), moments=bool(avg_moments))
                optimizer = torch.optim.Adam(stage.parameters(), lr=args.lr * LR_BOOST)
                if avg_moments:  # go beyond the paper: the neighbours' moments, averaged the same way
                    _seed_moments(stage, optimizer, avg_moments)
        if args.recovery == "random" and me in lost:
            world.events.emit("stage_rebuilt", stage=me, method="random", sources=[], moments=False)
            optimizer = torch.optim.Adam(stage.parameters(), lr=args.lr)
    return optimizer


def _seed_moments(stage: Stage, optimizer: torch.optim.Optimizer, avg: dict[str, np.ndarray]) -> None:
    for name, p in stage.body.named_parameters():
        if f"{name}:exp_avg" in avg:
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.from_numpy(avg[f"{name}:exp_avg"]),
                                  "exp_avg_sq": torch.from_numpy(avg[f"{name}:exp_avg_sq"])}


def share_end_copies(world: elastic.World, stage: Stage, me: int, stages: int, copies: dict) -> None:
    """CheckFree+: stage 1 keeps a copy of the embedding, stage S-2 of the head (collective, after each update)."""
    if stages < 3:
        return
    comm = world.comm
    with world.guard():
        for part, owner, keeper in (("embed", 0, 1), ("head", stages - 1, stages - 2)):
            if me == owner:
                comm.send(arrays(getattr(stage, part)), dest=int(world.current_rank_of(keeper)), tag=TAG + 400)
            elif me == keeper:
                copies[part] = comm.recv(source=int(world.current_rank_of(owner)), tag=TAG + 400)


# ------------------------------------------------------------------ the loops
def next_to(removed: list[int], survivors: list[int]) -> dict[int, int]:
    """After a shrink, a removed stage goes to a surviving neighbour (the one before it, if alive)."""
    return {r: min(survivors, key=lambda s: (abs(s - r), s)) for r in removed}


def vote(world: elastic.World, ok: bool) -> None:
    """A uniform end of step (ULFM Agree): every survivor applies the update, or none does."""
    with world.guard():
        if not world.comm.Agree(int(ok)):
            raise elastic.ProcessFailure("a stage could not finish the step")


def run_without_copies(world, stage, optimizer, me, stages, text, batches, args) -> int:
    """checkfree / random / disk: a step's update lands on every stage or on none."""
    step, copies, gnorm = 0, {}, 1.0
    lost: set[int] = set(int(r) for r in world.last_rebuild.replaced) if world.last_rebuild else set()
    ckpt = Path(args.checkpoint_dir) / f"stage{me}.pt" if args.recovery == "disk" else None
    pending = world.role is elastic.Role.RECOVERED
    clock = elastic.StepClock(world)
    clock.restart()
    # A replacement computes the hosts with the survivors, after the rebuild (same collective order).
    host = {} if pending else stage_hosts(world, {me: stage})
    while True:
        try:
            if pending:
                with world.guard():
                    step = world.comm.bcast(step, root=world.first_survivor)
                if args.recovery == "disk":
                    saved = torch.load(ckpt, weights_only=False)
                    stage.load_state_dict(saved["stage"])
                    optimizer.load_state_dict(saved["optimizer"])
                    step = saved["step"]
                    world.events.emit("checkpoint_loaded", step=step)
                else:
                    optimizer = rebuild_lost_stages(world, stage, optimizer, me, stages, lost, gnorm, copies, args)
                pending = False
                host = stage_hosts(world, {me: stage})
                clock.restart()
            if step == args.steps:
                break
            world.fault_point(step)
            optimizer.zero_grad()
            try:
                loss = train_step(world, {me: stage}, host, stages, text[torch.from_numpy(batches.batch(step))], args)
                ok = True
            except elastic.ProcessFailure:
                ok = False
                with contextlib.suppress(Exception):  # already revoked by a peer
                    world.comm.Revoke()  # peers waiting on this rank's messages must not wait forever
            vote(world, ok)
            gnorm = body_grad_norm(stage)
            optimizer.step()
            step += 1
            if args.checkfree_plus:
                share_end_copies(world, stage, me, stages, copies)
            if ckpt is not None and step % args.commit_every == 0:
                torch.save({"stage": stage.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, ckpt)
                with world.guard():
                    world.comm.Barrier()  # a checkpoint is whole once every stage wrote its part
            clock.step_done(step, loss, total=args.steps)
        except elastic.ProcessFailure:
            rebuild = world.recover()
            lost = set(int(r) for r in rebuild.replaced)
            pending = True
    world.finish()
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recovery", choices=("replica", "checkfree", "random", "disk"), default="replica")
    parser.add_argument("--checkfree-plus", action="store_true", help="swapped-order micro-batches, end-layer copies")
    parser.add_argument("--average-moments", action="store_true", help="rebuild Adam's moments by CheckFree too")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=1, help="transformer blocks per stage")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--checkpoint-dir", default=None, help="for --recovery disk (default: the run directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = make_text(args)
    # Without copies a lost stage needs a new process to be rebuilt on (spare or spawn); with
    # replicas a shrink may also hand it to a neighbour, which then hosts two stages.
    policy = elastic.Policy.from_env()
    if args.recovery != "replica":
        policy = dataclasses.replace(policy, modes=tuple(m for m in policy.modes if m != "shrink") or ("spare", "spawn"))
    world = elastic.init(policy=policy)
    stages, me = world.initial_size, int(world.logical_rank)
    args.checkpoint_dir = args.checkpoint_dir or os.environ.get("ELASTIC_RUN_DIR", ".")
    stage = Stage(me, stages, args)
    optimizer = torch.optim.Adam(stage.parameters(), lr=args.lr)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    hosted = {me: stage}
    if args.recovery == "replica":
        optimizers, announced = {me: optimizer}, []
        state = elastic.TorchState(world, modules={f"s{me}": (stage, optimizer)}, step=0,
                                   local=tuple(f"s{s}" for s in range(stages)), adopt=next_to)

        @elastic.run
        def train(world: elastic.World, state: elastic.TorchState) -> None:
            if world.role is elastic.Role.RECOVERED and not announced:  # a spare or spawned process
                world.events.emit("stage_rebuilt", stage=me, method="replica", sources=[])
                announced.append(me)
            for name in state.unbound():  # a removed neighbour's stage, adopted after a shrink
                s = int(name[1:])
                hosted[s] = Stage(s, stages, args)
                optimizers[s] = torch.optim.Adam(hosted[s].parameters(), lr=args.lr)
                state.bind(name, hosted[s], optimizers[s])
                world.events.emit("stage_rebuilt", stage=s, method="replica", sources=[], adopted=True)
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

    mine = [{"stage": s, "sha256": hashlib.sha256(b"".join(v.detach().numpy().tobytes()
                                                          for v in st.state_dict().values())).hexdigest(),
             "finite": all(bool(torch.isfinite(p).all()) for p in st.parameters()),
             "shapes_ok": all(a.shape == b.shape for a, b in zip(st.state_dict().values(),
                                                                 Stage(s, stages, args).state_dict().values()))}
            for s, st in sorted(hosted.items())]
    with world.guard():
        report = sorted((r for part in world.comm.gather(mine, root=0) or [] for r in part), key=lambda r: r["stage"])
    if world.rank == 0:
        run_dir = os.environ.get("ELASTIC_RUN_DIR")
        print(f"[pipeline] {steps} steps, {stages} stages, recovery {args.recovery}, generation {world.generation}",
              flush=True)
        if run_dir:
            Path(run_dir, "result.json").write_text(json.dumps({"steps": steps, "stages": report,
                                                                "generation": world.generation}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
