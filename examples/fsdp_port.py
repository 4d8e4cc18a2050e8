"""The official FSDP2 example (pytorch/examples ``distributed/FSDP2``) ported as a user ports it.

The official program's order, kept: ``init_process_group``, the model made on the meta device,
``fully_shard`` on each block and then on the root (which owns the embeddings, final norm and
head), ``to_empty`` and ``reset_parameters``, Adam, then the loop with gradient clipping. What the
port adds: ``elastic.init()`` first (``init_process_group`` then makes the World's ``ulfm``
group), the loop inside ``@elastic.run`` counted by ``state.step``, DCP's storage
``PeerMemory(state)`` instead of a directory, saved every ``--commit-every`` steps and loaded when
the loop re-enters, and global batches (``elastic.GlobalBatches``). No ``rehearse=``: a spare is
promoted into this program before it has built anything, as most ports are written
(``examples/fsdp_transformer.py`` is the same model written for the fastest recovery);
``--rehearse`` adds the one argument ``elastic.init(rehearse=True)``: the spare runs this file
once more before it parks, up to its first step, so torch's first use is done by then.

    python -m elastic.launch -n 4 --spares 1 --inject 1@c15 -- python examples/fsdp_port.py
    python -m elastic.launch -n 4 --rebuild shrink --inject 3@15 -- python examples/fsdp_port.py

With a spare the final model and optimizer are bitwise those of a failure-free run; after a
shrink every rank shards the model again over the survivors and DCP re-shards the checkpoint.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

import elastic
import elastic.distributed
from fsdp_transformer import Checkpoint, ModelArgs, Transformer, add_arguments, full_digests, report, run_steps


def sharded_model(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The official example's set-up: on meta, sharded, materialised, initialised (the same values
    on every rank for a given world size), and its optimizer."""
    with torch.device("meta"):
        model = Transformer(ModelArgs(n_layers=args.layers, vocab_size=args.vocab, max_seq_len=args.seq_len,
                                      dim=args.dim, dropout_p=args.dropout))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.random.fork_rng():  # the initial values from a fixed seed, this rank's stream kept (dropout)
        torch.manual_seed(args.seed)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)  # the same model, data and loop as fsdp_transformer.py
    parser.add_argument("--rehearse", action="store_true",
                        help="elastic.init(rehearse=True): a spare runs this program to its first step before parking")
    args = parser.parse_args()

    world = elastic.init(rehearse=True if args.rehearse else None)
    dist.init_process_group(backend="gloo")  # as the official example; under elastic the World's ulfm group
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    state = elastic.TorchState(world, local=("dcp",), step=0, loss=float("nan"))
    checkpoint = elastic.distributed.PeerMemory(state)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    corpus = torch.randint(0, args.vocab, (args.samples, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    model, optimizer = sharded_model(args)
    job: dict[str, Any] = {"size": world.size}

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        nonlocal model, optimizer
        if job["size"] != world.size:  # a shrink: torch's group of the new size, the model sharded over it
            dist.destroy_process_group()
            dist.init_process_group()
            model, optimizer = sharded_model(args)
            job["size"] = world.size
        if state.step > 0:  # a roll-back to the last save, re-sharded by DCP if the world changed size
            dcp.load({"app": Checkpoint(model, optimizer)}, storage_reader=checkpoint)
        run_steps(world, state, model, optimizer, batches, corpus, args,  # the official loop, a step a time
                  save=lambda: dcp.save({"app": Checkpoint(model, optimizer)}, storage_writer=checkpoint))
        job.update(full_digests(model, optimizer))
        return state.loss

    loss = train(world, state)
    report(world, state, loss, model_sha256=job["model_sha256"], optimizer_sha256=job["optimizer_sha256"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
