"""A decoder-only transformer trained the way torchtitan composes one: a (pp, dp, tp) ``DeviceMesh``,
torch's own pipeline schedules on pp, tensor parallel on tp, FSDP2 on dp; any one rank lost, the
job goes on in place.

torchtitan's llama layout at tiny sizes: the root owns the token embedding, the final norm and the
head; the blocks are split into ``--pp`` stages by module name (two per rank with ``--schedule
interleaved``), each block tensor-parallel (attention q / k / v colwise, output rowwise; MLP w1 / w3
colwise, w2 rowwise; the embedding rowwise, the head colwise with its logits replicated), then
``fully_shard`` per block and on each stage's root as HSDP: replicated over dp, sharded over
``--fsdp`` (1 by default). A step: ``schedule.step`` over
``--microbatches`` micro-batches, the gradients' norm over the whole mesh, ``clip_grad_norm_``'s
clip, AdamW, a warm-up + cosine schedule; dropout; the tokens from a ``DataLoader`` over
``GlobalBatchSampler`` (each dp replica's share of the global batch).

On the ``ulfm`` process group every transfer and collective of the step (the schedule's
activations and gradients, the TP all-reduces, FSDP2's all-gathers and reduce-scatters) runs on the
World's communicator, so a death ends every rank's wait at once. The way back: the same (pp, fsdp,
tp) coordinate in another dp replica holds the same parameter and optimizer slices (HSDP's all-reduce
over dp gives the twins the same gradient bits), so every optimizer step is a recovery point at no
copy (``TorchState(per_step=True, twins=...)``) and a spare takes the lost rank's slices from its
twin: the run ends bitwise where a failure-free run ends. With every twin of a slice lost at once:
back to the last ``--commit-every`` commit, exact; without one, ``DataLost`` naming the slices on
every rank. The pipeline stages and the schedule are made again on every entry of the run function
(cheap: they wrap the same modules), so after a recovery each rank's schedule is the new
generation's, its shapes given up front (no metadata exchange). A shrink (``--rebuild shrink``)
takes the lost rank's replica out of use (``Resilient``).

    python -m elastic.launch -n 8 --spares 1 --inject 3@p12 -- python examples/llama3d.py --pp 2 --dp 2 --tp 2
    torchrun --nproc-per-node 8 examples/llama3d.py --pp 2 --dp 2 --tp 2 --plain   # the baseline, Gloo

At the end every rank prints ``digest <logical rank> <sha256>`` of its local parameter and optimizer
shards (what the tests compare with a failure-free run's).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (FSDP2 imports it on first use: a parked spare pays before a failure)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


# ------------------------------------------------------------------------------------ the model
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, rope), rotate(k, rope)  # -1 heads: the local ones under tensor parallel
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 2 * dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.dropout(self.attention(self.attention_norm(x), rope))
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    """torchtitan's llama layout; a pipeline stage is this model with the other stages' modules
    taken out (``None`` / deleted), so its forward runs whatever it still has."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim, args.heads, args.dropout) for i in range(args.layers)})
        self.norm: nn.Module | None = nn.RMSNorm(args.dim)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab, bias=False)
        half = args.dim // args.heads // 2
        angles = torch.outer(torch.arange(args.seq, dtype=torch.float32), 10000.0 ** (-torch.arange(half) / half))
        self.register_buffer("rope", torch.stack((angles.cos(), angles.sin())), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), in real arithmetic."""
    cos, sin = rope[0], rope[1]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


# ------------------------------------------------------------------------------- the 3-D layout
class Layout:
    """Where logical rank ``k`` sits: replica ``d = k // slots``, and in it the slot ``k % slots =
    (p * fsdp + f) * tp + t`` (stage ``p``, FSDP2 shard ``f``, tp rank ``t``). A slot is the twins'
    "stage" of an ``elastic.mesh.Mesh(world, dp, slots)``: its dp replicas hold the same slices."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.pp, self.dp, self.fsdp, self.tp = args.pp, args.dp, args.fsdp, args.tp
        self.slots = self.pp * self.fsdp * self.tp

    def coords(self, k: int) -> tuple[int, int, int, int]:
        """(stage, replica, shard, tp rank) of logical rank ``k``."""
        d, slot = divmod(k, self.slots)
        return slot // (self.fsdp * self.tp), d, slot // self.tp % self.fsdp, slot % self.tp

    def share(self, batch: np.ndarray, replicas: list[int], d: int, f: int) -> np.ndarray:
        """Replica ``d``'s shard ``f``'s part of a global batch (alike along pp and tp)."""
        return np.array_split(batch, len(replicas) * self.fsdp)[replicas.index(d) * self.fsdp + f]

    def device_mesh(self, rank_of: Callable[[int, int], int], replicas: list[int]) -> DeviceMesh:
        """The (pp, dp, fsdp, tp) mesh over the replicas in use (collective: every rank makes it)."""
        ranks = [[[[rank_of(d, (p * self.fsdp + f) * self.tp + t) for t in range(self.tp)]
                   for f in range(self.fsdp)] for d in replicas] for p in range(self.pp)]
        return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("pp", "dp", "fsdp", "tp"))


def check(args: argparse.Namespace, size: int) -> None:
    """Bad input, found on every rank before the first step (the same facts everywhere)."""
    stages = args.pp * (2 if args.schedule == "interleaved" else 1)
    problems = []
    ranks = args.pp * args.dp * args.fsdp * args.tp
    if ranks != size:
        problems.append(f"--pp {args.pp} x --dp {args.dp} x --fsdp {args.fsdp} x --tp {args.tp} = {ranks} ranks, "
                        f"and the job has {size}: launch with -n {ranks} or change the degrees")
    if args.layers % stages:
        problems.append(f"{args.layers} layers do not split into {stages} pipeline stages: give --layers a "
                        f"multiple of {stages}")
    if args.heads % args.tp or args.dim % args.heads or (args.dim // args.heads) % 2:
        problems.append(f"--tp {args.tp} must divide --heads {args.heads}, and --heads must divide --dim "
                        f"{args.dim} into an even head size")
    need = math.lcm(*(k * args.fsdp * args.microbatches for k in range(1, args.dp + 1)))  # after a shrink too
    if args.batch % need:
        problems.append(f"--batch {args.batch} does not split into the shares of up to --dp {args.dp} replicas x "
                        f"--fsdp {args.fsdp} x --microbatches {args.microbatches}: give a multiple of {need}")
    if args.schedule != "gpipe" and args.microbatches < args.pp:
        problems.append(f"--schedule {args.schedule} needs --microbatches >= --pp ({args.pp})")
    if problems:
        raise SystemExit("llama3d: " + "; ".join(problems))


def build(args: argparse.Namespace, mesh: DeviceMesh, p: int) -> list[nn.Module]:
    """This rank's stage modules (stage ``p``, and ``p + pp`` when interleaved): the whole model
    made alike everywhere, the other stages' modules taken out, tensor-parallel on tp, FSDP2 on dp."""
    per_rank = 2 if args.schedule == "interleaved" else 1
    stages, per_stage = args.pp * per_rank, args.layers // (args.pp * per_rank)
    modules = []
    for index in range(p, stages, args.pp):
        with torch.random.fork_rng():  # the same initial model everywhere; this rank's dropout stream kept
            torch.manual_seed(args.seed)
            model = Transformer(args)
        for name in list(model.layers):
            if not index * per_stage <= int(name) < (index + 1) * per_stage:
                del model.layers[name]
        if index != 0:
            model.tok_embeddings = None
        if index != stages - 1:
            model.norm = model.output = None
        tp, dp = mesh["tp"], mesh["dp", "fsdp"]  # HSDP: replicated over dp (twins), sharded over fsdp
        # src_data_rank=None: each rank cuts its slices from the model it made (the same everywhere),
        # no scatter from tp rank 0: a replacement builds its model while the others recover.
        if args.tp > 1:
            for block in model.layers.values():
                parallelize_module(block, tp, src_data_rank=None, parallelize_plan={
                    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel()})
            root = {}
            if model.tok_embeddings is not None:
                root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
            if model.output is not None:
                root["output"] = ColwiseParallel(output_layouts=Replicate())
            if root:
                parallelize_module(model, tp, root, src_data_rank=None)
        for block in model.layers.values():
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)  # the root unit: embedding, final norm, head
        modules.append(model)
    return modules


def schedule_for(args: argparse.Namespace, mesh: DeviceMesh, modules: list[nn.Module], p: int, shares: int) -> Any:
    """torch's pipeline stages over ``modules`` and the schedule, on the mesh's pp group; the
    activations' shapes given up front (no shape exchange at the first step); ``shares``: the
    parts the global batch is cut into."""
    per_rank = len(modules)
    stages = args.pp * per_rank
    mb = args.batch // shares // args.microbatches
    tokens = torch.zeros(mb, args.seq, dtype=torch.long)
    hidden = torch.zeros(mb, args.seq, args.dim, requires_grad=True)  # a gradient comes back for it
    logits = torch.zeros(mb, args.seq, args.vocab)
    group = mesh["pp"].get_group()
    made = [PipelineStage(m, index, stages, torch.device("cpu"), input_args=tokens if index == 0 else hidden,
                          output_args=logits if index == stages - 1 else hidden, group=group)
            for m, index in zip(modules, range(p, stages, args.pp))]
    kind = SCHEDULES[args.schedule]
    return kind(made if per_rank > 1 else made[0], args.microbatches, loss_fn=loss_fn)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def clip(modules: list[nn.Module], pp_group: Any, max_norm: float) -> float:
    """torchtitan's ``clip_grad_norm_``: the gradients' 2-norm over the whole mesh (per group of
    DTensors alike, mesh and placements, torch's total norm made whole over its mesh; the squares
    summed over pp), then torch's clip with it, group by group (one foreach call takes one mesh)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for m in modules:
        for p in m.parameters():
            if p.grad is not None:
                key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
                groups.setdefault(key, []).append(p.grad)
    square = torch.zeros(())
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        square = square + (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    dist.all_reduce(square, group=pp_group)
    total = square.sqrt()
    for grads in groups.values():
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return float(total)


def seed_dropout(args: argparse.Namespace, p: int, d: int) -> None:
    """This rank's dropout stream: alike along tp (its activations are replicated there), apart otherwise."""
    torch.manual_seed(1000 + d * args.pp + p)


def optimize(args: argparse.Namespace, modules: list[nn.Module]) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over this rank's stages, and its warm-up + cosine schedule."""
    optimizer = torch.optim.AdamW([q for m in modules for q in m.parameters()], lr=args.lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args))


def warmup_cosine(args: argparse.Namespace) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))))
    return factor


def make_data(args: argparse.Namespace) -> torch.utils.data.TensorDataset:
    """Learnable sequences: each an arithmetic progression modulo the vocabulary (the same everywhere)."""
    rng = np.random.default_rng(args.seed)
    start = rng.integers(0, args.vocab, (args.samples, 1))
    stride = rng.integers(1, 5, (args.samples, 1))
    tokens = (start + stride * np.arange(args.seq + 1)) % args.vocab
    return torch.utils.data.TensorDataset(torch.from_numpy(tokens))


def one_step(args: argparse.Namespace, schedule: Any, tokens: torch.Tensor, first: bool, last: bool) -> float:
    """The schedule over one replica's batch: the summed micro-batch losses on a last stage, else 0."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
    if first:
        schedule.step(x, **kwargs)
    else:
        schedule.step(**kwargs)
    return float(sum(loss.detach() for loss in losses)) if last else 0.0


def digest(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> str:
    """sha256 of this rank's local parameter shards and their optimizer state, in name order."""
    h = hashlib.sha256()
    for i, m in enumerate(modules):
        for name, p in sorted(m.named_parameters()):
            h.update(f"{i}.{name}".encode())
            for value in [p, *(v for _, v in sorted(optimizer.state.get(p, {}).items()))]:
                local = value.to_local() if isinstance(value, DTensor) else value
                h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Rate:
    """Steps per second from the end of step 2 to the last, and when the first step ended (what
    ``scripts/bench_3d.py`` reads)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.start, self.first = steps, 0.0, 0.0

    def tick(self, done: int) -> None:
        if done == 1:
            self.first = time.time()
        if done == 2:
            self.start = time.perf_counter()

    def say(self, rank: int) -> None:
        if rank == 0 and self.start and self.steps > 2:
            print(f"rate {(self.steps - 2) / (time.perf_counter() - self.start):.4f} steps/s", flush=True)
            print(f"first_step_at {self.first:.3f}", flush=True)


# ------------------------------------------------------------------------------------ the runs
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP2 shards within a replica (HSDP's shard degree)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences), kept after a shrink")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit-every", type=int, default=0,
                        help="commit every N steps (the way back when every twin of a slice dies; 0: never)")
    parser.add_argument("--replication", type=int, default=None,
                        help="copies of each rank's own values (RNG states, step) in peers' memory, its own included "
                             "(default: the job's --redundancy, else 2)")
    parser.add_argument("--plain", action="store_true", help="torchrun + Gloo, no fault tolerance (the baseline)")


def plain(args: argparse.Namespace, data: torch.utils.data.TensorDataset) -> int:
    """The same program under torchrun on Gloo: what users run without fault tolerance."""
    dist.init_process_group("gloo")
    rank, layout = dist.get_rank(), Layout(args)
    check(args, dist.get_world_size())
    p, d, f, t = layout.coords(rank)
    seed_dropout(args, p, d)
    mesh = layout.device_mesh(lambda replica, slot: replica * layout.slots + slot, list(range(args.dp)))
    modules = build(args, mesh, p)
    optimizer, scheduler = optimize(args, modules)
    schedule = schedule_for(args, mesh, modules, p, args.dp * args.fsdp)
    first, last = p == 0, p == args.pp - 1  # this rank's stages include the first, the last
    order = np.random.default_rng([args.seed, 0]).permutation(len(data))  # GlobalBatchSampler's first epoch
    clock = Rate(args.steps)
    for step in range(args.steps):
        batch = order[step * args.batch:(step + 1) * args.batch]
        mine = torch.from_numpy(layout.share(batch, list(range(args.dp)), d, f))
        for m in modules:
            m.zero_grad()
        loss = one_step(args, schedule, data.tensors[0][mine], first, last)
        clip(modules, mesh["pp"].get_group(), args.max_norm)
        total = torch.tensor([loss if last and t == 0 else 0.0])  # one rank of each share
        dist.all_reduce(total)
        optimizer.step()
        scheduler.step()
        clock.tick(step + 1)
        if rank == 0 and (step + 1) % 8 == 0:
            print(f"step {step + 1} loss {float(total) / args.microbatches / args.dp / args.fsdp:.4f}", flush=True)
    print(f"digest {rank} {digest(modules, optimizer)}", flush=True)
    clock.say(rank)
    dist.destroy_process_group()
    return 0


class Resilient:
    """The program on the World: the twins' mesh, this rank's stages on the (pp, dp, fsdp, tp) mesh of
    the replicas in use, made again after a shrink.

    A shrink takes the lost rank's replica out of use (``mesh_policy``): the replicas left carry the
    global batch on a mesh of their own, each rank's slices and optimizer state moved onto it
    (the same local shards: only the replicate dimension shrank). A surviving rank of the replica
    taken out computes nothing but keeps its slices in step, a twin to the end: the twin of its
    slot in the first replica in use sends it the step's clipped gradient slices and it takes the
    same optimizer step."""

    def __init__(self, args: argparse.Namespace, world: Any, data: torch.utils.data.TensorDataset) -> None:
        import elastic
        import elastic.distributed
        from elastic.data import GlobalBatchSampler
        from elastic.mesh import Mesh

        check(args, world.job.initial_size)
        self.args, self.world, self.layout = args, world, Layout(args)
        self.p, self.d, self.f, self.t = self.layout.coords(int(world.logical_rank))
        seed_dropout(args, self.p, self.d)
        self.group = elastic.distributed.ProcessGroup(world)
        self.twins = Mesh(world, args.dp, self.layout.slots)  # a slot's replicas: its twins
        self.modules: list[nn.Module] = []
        self.size = 0  # the World's size the mesh is made for
        self.build()
        self.optimizer, scheduler = optimize(args, self.modules)
        self.state = elastic.TorchState(world, model=self.model, optimizer=self.optimizer, scheduler=scheduler,
                                        per_step=True, shard_optimizer=True, twins=self.twins, twinned=("model",),
                                        replication=args.replication, step=0, loss=float("nan"))
        sampler = GlobalBatchSampler(world, len(data), args.batch, step=lambda: self.state.step, seed=args.seed,
                                     share=lambda batch: self.layout.share(batch, self.twins.in_use, self.d, self.f))
        self.loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
        self.first, self.last = self.p == 0, self.p == args.pp - 1  # this rank's stages include the first, the last
        self.clock = Rate(args.steps)

    @property
    def model(self) -> nn.Module:
        return self.modules[0] if len(self.modules) == 1 else nn.ModuleList(self.modules)

    def build(self) -> None:
        """The mesh of the replicas in use (every rank makes it) and, on a rank that trains, its
        stage modules on it, their slices and optimizer state those it held, if any."""
        self.group.group  # noqa: B018  (the default group of this shape, which the mesh's groups divide)
        self.mesh = self.layout.device_mesh(self.twins.rank_of, self.twins.in_use)
        self.size = self.world.size
        if not self.twins.working:
            return  # out of use: it keeps its slices on the old mesh (its updates are local)
        olds = [q for m in self.modules for q in m.parameters()]
        self.modules = build(self.args, self.mesh, self.p)
        if olds:  # after a shrink: the same local slices, on the new mesh
            moved: dict[Any, dict[str, Any]] = {}
            news = [q for m in self.modules for q in m.parameters()]
            at = {id(q): i for i, q in enumerate(olds)}
            with torch.no_grad():
                for new, old in zip(news, olds):
                    new.to_local().copy_(old.to_local())
                    moved[new] = {key: like(new, value) for key, value in self.optimizer.state[old].items()}
            for group in self.optimizer.param_groups:  # the same optimizer (the scheduler's, the State's)
                group["params"] = [news[at[id(q)]] for q in group["params"]]
            self.optimizer.state.clear()
            self.optimizer.state.update(moved)
            self.state.bind("", self.model, self.optimizer)

    def pass_gradients(self) -> None:
        """Each slot's clipped gradient slices, from its twin in the first replica in use to the
        surviving ranks of the replicas out of use (point to point; none before a shrink)."""
        twins, world = self.twins, self.world
        idle = [(rank, int(k)) for rank, k in enumerate(world.logical_ranks) if int(k) // twins.pp not in twins.in_use]
        if not idle:
            return
        params = [q for m in self.modules for q in m.parameters()]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        grads = [(q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).detach().numpy() for q in params]
        if twins.working and twins.replica == twins.in_use[0]:
            world.neighbors([(rank, i, g) for rank, k in idle if k % twins.pp == twins.stage
                             for i, g in enumerate(grads)], [])
        elif not twins.working:
            sender = twins.rank_of(twins.in_use[0], twins.stage)
            world.neighbors([], [(sender, i, g) for i, g in enumerate(grads)])

    def train(self) -> float:
        import elastic

        args, twins = self.args, self.twins

        @elastic.run
        def train(world: elastic.World, state: elastic.TorchState) -> float:
            if self.size != world.size:  # a shrink: the replicas left, on a mesh of their own
                self.build()
            # this generation's stages and schedule: their groups looked up anew (cheap: the same modules)
            schedule = schedule_for(args, self.mesh, self.modules, self.p, len(twins.in_use) * args.fsdp) \
                if twins.working else None
            batches = iter(self.loader) if twins.working else None
            while state.step < args.steps:
                loss = 0.0
                if batches is not None:
                    tokens = next(batches, None)
                    if tokens is None:  # the epoch's end: the sampler goes on with the next
                        batches = iter(self.loader)
                        tokens = next(batches)
                    for m in self.modules:
                        m.zero_grad()
                    loss = one_step(args, schedule, tokens[0], self.first, self.last)
                    clip(self.modules, self.mesh["pp"].get_group(), args.max_norm)
                self.pass_gradients()
                tally = np.array([loss if self.last and self.t == 0 and twins.working else 0.0])
                world.allreduce([tally])  # the global loss, before the update (nothing collective after it)
                self.optimizer.step()
                state.scheduler.step()
                state.step += 1
                state.loss = float(tally[0]) / args.microbatches / len(twins.in_use) / args.fsdp
                state.record_step(state.step, state.loss, total=args.steps)
                self.clock.tick(state.step)
                if args.commit_every and state.step % args.commit_every == 0:
                    state.commit()
            return state.loss

        return train(self.world, self.state)


def like(param: torch.Tensor, value: Any) -> Any:
    """An optimizer state value of another parameter laid out as ``param`` (the same local slice)."""
    if isinstance(value, DTensor) and isinstance(param, DTensor):
        return DTensor.from_local(value.to_local(), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def resilient(args: argparse.Namespace, data: torch.utils.data.TensorDataset) -> int:
    import elastic
    from elastic.mesh import mesh_policy

    world = elastic.init(policy=mesh_policy(args.dp, copies=True))
    job = Resilient(args, world, data)
    loss = job.train()
    mine = digest(job.modules, job.optimizer)
    print(f"digest {int(world.logical_rank)} {mine}", flush=True)
    job.clock.say(world.rank)
    told = dict(world.allgather((int(world.logical_rank), mine)))
    if world.rank == 0:
        world.events.emit("result", steps=job.state.step, size=world.size, generation=world.generation,
                          final_loss=loss, logical_ranks=[int(r) for r in world.logical_ranks],
                          in_use=job.twins.in_use, digests=[told.get(k) for k in range(world.job.initial_size)])
        print(f"[llama3d] done: {job.state.step} steps, loss {loss:.6f}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)  # ranks share the cores; one thread each also keeps kernels deterministic
    data = make_data(args)
    return plain(args, data) if args.plain else resilient(args, data)


if __name__ == "__main__":
    sys.exit(main())
