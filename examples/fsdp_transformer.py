"""The official FSDP2 example's program (pytorch/examples ``distributed/FSDP2``) under elastic.

A transformer whose root unit owns parameters (token and position embeddings, the final norm and
the output head, tied to the token embedding with ``--tie``), each block its own ``fully_shard``
unit, Adam, gradient clipping, optional bf16 mixed precision, and torch.distributed.checkpoint
(DCP) for its state: the official example's model and loop. What the port changes:
``elastic.init()`` comes before ``init_process_group()``, which then makes the World's ``ulfm``
group (a death ends its collectives on every rank, within ULFM's detection time); the loop
runs inside ``@elastic.run``, counted by ``state.step``; DCP's storage is ``PeerMemory(state)``
(each rank's shards replicated in its peers' memory) instead of a directory, saved every
``--commit-every`` steps; the data are global batches (``elastic.GlobalBatches``), so a
replacement trains on what the lost rank would have. Nothing FSDP2-specific after a failure: the
library ends the iteration a failure cut short (FSDP2's per-iteration state and every gradient,
the root's unsharded ones included).

    python -m elastic.launch -n 4 --spares 1 --inject 1@g10 -- python examples/fsdp_transformer.py  # forward
    python -m elastic.launch -n 4 --spares 1 --inject 1@c10 -- python examples/fsdp_transformer.py  # backward
    python -m elastic.launch -n 4 --spares 1 --inject 1@u10 -- python examples/fsdp_transformer.py  # optimizer
    python -m elastic.launch -n 4 --rebuild shrink --inject 3@c10 -- python examples/fsdp_transformer.py

With a spare or a spawned process the final model and optimizer are bitwise those of a
failure-free run; after a shrink DCP re-shards the checkpoint over the survivors and the global
batches stay the same. Every process builds the model before ``elastic.init()``, and a spare
rehearses its setup and first step before it parks (``elastic.init(rehearse=...)``): promoted,
it only shards the model it built. ``--ddp``: the same model and loop under torch DDP, the
benchmark's baseline (the same bits as FSDP2 here).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import elastic
import elastic.distributed


@dataclasses.dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    dropout_p: float = 0.1
    tie: bool = False  # the output head shares the token embedding's weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.dropout_p = args.n_heads, args.dropout_p
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        q, k, v = (w(x).view(bsz, seq_len, self.n_heads, dim // self.n_heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(bsz, seq_len, dim)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                                          nn.Linear(4 * args.dim, args.dim), nn.Dropout(args.dropout_p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The root unit owns the embeddings, the final norm and the head; each block is a unit."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


class Checkpoint:
    """The model and optimizer as DCP saves and loads them (torch's ``get_state_dict`` pattern)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def build(args: argparse.Namespace) -> Transformer:
    """The unsharded model, the same initial values on every rank (seeded)."""
    with torch.random.fork_rng():  # keep this rank's own stream (dropout)
        torch.manual_seed(args.seed)
        return Transformer(model_args(args))


def shard(model: Transformer, args: argparse.Namespace) -> FSDPModule:
    """``fully_shard`` each block, then the root (its embeddings, norm and head), over the default
    group: the ``ulfm`` group of this generation."""
    options: dict[str, Any] = {}
    if args.mixed_precision:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def model_args(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(n_layers=args.layers, vocab_size=args.vocab, max_seq_len=args.seq_len, dim=args.dim,
                     dropout_p=args.dropout, tie=args.tie)


def digest(state_dict: dict) -> str:
    """sha256 over every tensor of a full state dict, in key order."""
    h = hashlib.sha256()
    for key in sorted(state_dict, key=str):
        value = state_dict[key]
        h.update(str(key).encode())
        if isinstance(value, dict):
            h.update(digest(value).encode())
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def full_digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """``model_sha256`` and ``optimizer_sha256`` of the whole sharded model and optimizer (collective:
    every rank gathers them)."""
    full = StateDictOptions(full_state_dict=True)
    return {"model_sha256": digest(get_model_state_dict(model, options=full)),
            "optimizer_sha256": digest(get_optimizer_state_dict(model, optimizer, options=full))}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, world_size: int,
               args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The official example's step on this rank's sequences: the global mean loss and the
    gradients' global norm (collective)."""
    logits = model(tokens[:, :-1])
    share = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1), reduction="sum")
    # FSDP2 averages the gradients over the ranks: times the world size over the global batch's
    # tokens gives the global mean whatever share each rank has (4 ranks or 3).
    (share * world_size / (args.batch * args.seq_len)).backward()
    loss = share.detach() / (args.batch * args.seq_len)
    dist.all_reduce(loss)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def run_steps(world: elastic.World, state: elastic.State, model: Any, optimizer: torch.optim.Optimizer,
              batches: elastic.GlobalBatches, corpus: torch.Tensor, args: argparse.Namespace,
              save: Callable[[], None] = lambda: None) -> None:
    """The loop from ``state.step`` to ``--steps``: each step recorded, a commit every
    ``--commit-every`` with ``save()`` before it (DCP's, for FSDP2)."""
    while state.step < args.steps:
        world.fault_point(state.step)
        mine = torch.from_numpy(batches.shard(state.step, world))
        loss, norm = train_step(model, optimizer, corpus[mine], world.size, args)
        state.step += 1
        state.loss = float(loss)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2's is a DTensor
        state.record_step(state.step, state.loss, total=args.steps, grad_norm=float(norm))
        if state.step % args.commit_every == 0:
            save()
            state.commit()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's, the data's and the loop's arguments (``examples/fsdp_port.py`` takes them too)."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="global batch of sequences, kept after a shrink")
    parser.add_argument("--samples", type=int, default=1024, help="sequences in the synthetic corpus")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--commit-every", type=int, default=5, help="DCP save into peer memory every N steps")
    parser.add_argument("--seed", type=int, default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--tie", action="store_true", help="tie the output head to the token embedding")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 parameters, fp32 reductions")
    parser.add_argument("--replication", type=int, default=None,
                        help="copies of each rank's checkpoint in peers' memory (default: the job's "
                             "--redundancy, else 2)")
    parser.add_argument("--ddp", action="store_true",
                        help="the same model and loop under torch DDP instead (the benchmark's baseline)")
    args = parser.parse_args()
    corpus = torch.randint(0, args.vocab, (args.samples, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    model = build(args)  # before init: a spare builds it while it waits
    if args.ddp:
        return ddp(args, model, corpus)

    def rehearse() -> None:
        """A spare's, before it parks, on a group of the job's size that moves nothing: the first
        sharding, step and state-dict load of this model, so torch's first-use work is done by
        the time the spare is promoted (and shards ``model`` for real)."""
        rehearsal = shard(build(args), args)
        optimizer = torch.optim.Adam(rehearsal.parameters(), lr=args.lr)
        train_step(rehearsal, optimizer, corpus[:args.batch // dist.get_world_size()], dist.get_world_size(), args)
        Checkpoint(rehearsal, optimizer).load_state_dict(Checkpoint(rehearsal, optimizer).state_dict())

    world = elastic.init(rehearse=rehearse)
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    dist.init_process_group(backend="gloo")  # as the official example; under elastic the World's ulfm group
    state = elastic.TorchState(world, local=("dcp",), replication=args.replication, step=0, loss=float("nan"))
    checkpoint = elastic.distributed.PeerMemory(state)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    job: dict[str, Any] = {"model": shard(model, args), "size": world.size, "fresh": True}
    job["optimizer"] = torch.optim.Adam(job["model"].parameters(), lr=args.lr)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        if job["size"] != world.size or (state.step == 0 and not job["fresh"]):
            # a shrink (the model sharded again, over the survivors) or a roll-back to the start
            if job["size"] != world.size:  # torch's group of the new size: init_process_group makes the World's
                dist.destroy_process_group()
                dist.init_process_group()
            job.update(model=shard(build(args), args), size=world.size)
            job["optimizer"] = torch.optim.Adam(job["model"].parameters(), lr=args.lr)
        model, optimizer = job["model"], job["optimizer"]
        if state.step > 0:  # a roll-back to the last save, re-sharded by DCP if the world changed size
            dcp.load({"app": Checkpoint(model, optimizer)}, storage_reader=checkpoint)
        job["fresh"] = False
        run_steps(world, state, model, optimizer, batches, corpus, args,
                  save=lambda: dcp.save({"app": Checkpoint(model, optimizer)}, storage_writer=checkpoint))
        job.update(full_digests(model, optimizer))
        return state.loss

    loss = train(world, state)
    report(world, state, loss, model_sha256=job["model_sha256"], optimizer_sha256=job["optimizer_sha256"])
    return 0


def ddp(args: argparse.Namespace, model: Transformer, corpus: torch.Tensor) -> int:
    """``--ddp``: the same model, data and step under torch DDP on the ``ulfm`` group; the State
    holds the model and the optimizer (every rank alike), committed every ``--commit-every``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    world = elastic.init()
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    state = elastic.TorchState(world, model=model, optimizer=optimizer, replication=args.replication, step=0,
                               loss=float("nan"))
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    wrapped = elastic.distributed.DistributedDataParallel(world, model)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        run_steps(world, state, wrapped, optimizer, batches, corpus, args)
        return state.loss

    loss = train(world, state)
    report(world, state, loss, model_sha256=digest(model.state_dict()),
           optimizer_sha256=digest(optimizer.state_dict()["state"]))
    return 0


def report(world: elastic.World, state: elastic.State, loss: float, **hashes: str) -> None:
    """Rank 0 prints the outcome and records it in the events (local)."""
    if world.rank == 0:
        print(f"[fsdp_transformer] done: {state.step} steps on {world.size} ranks, loss {loss:.6f}, "
              f"model sha256 {hashes['model_sha256']}", flush=True)
        world.events.emit("result", steps=state.step, size=world.size, generation=world.generation, final_loss=loss,
                          **hashes)


if __name__ == "__main__":
    sys.exit(main())
