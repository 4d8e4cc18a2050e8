"""A Hugging Face transformers GPT-2 trained as its users write it, made elastic.

The program a transformers user runs under torchrun (a model built from a ``GPT2Config``, random
init, no download; ``DistributedDataParallel``; ``AdamW`` with transformers' linear warm-up
schedule; a ``DataLoader``; gradient accumulation with ``no_sync``; clipping; the model's own
dropout and its own ``.loss``), with the changes docs/using.md shows ("Hugging Face transformers and accelerate").

    python -m elastic.launch -n 4 --spares 1 --inject 1@c20 -- python examples/hf_gpt2.py
    python -m elastic.launch -n 4 --inject 1@20 -- python examples/hf_gpt2.py   # a shrink: 3 ranks go on

With a spare the final model and optimizer are bitwise those of the failure-free run (a kill
between steps or inside DDP's all-reduce); after a shrink every step keeps its global batch.
Needs the ``hf`` extra: ``pip install -c constraints.txt -e '.[hf]'``.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import numpy as np
import torch

try:
    import transformers
except ModuleNotFoundError:
    sys.exit("examples/hf_gpt2.py needs Hugging Face transformers: pip install -c constraints.txt -e '.[hf]'")

import elastic
import elastic.data
import elastic.distributed
from train import digest


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step, over all ranks")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--samples", type=int, default=512, help="sequences in the data set")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=5, help="steps of the linear warm-up")
    parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropouts (its config's default)")
    parser.add_argument("--commit-every", type=int, default=5, help="steps between recovery points")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.utils.data.Dataset, torch.optim.Optimizer, Any]:
    """The model, data set, optimizer and schedule, alike on every rank (as under torchrun)."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    # loss_type named: transformers 5 warns on every rank at the first forward of a config without one
    config = transformers.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                                     loss_type="ForCausalLM")
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(args.seed)  # sequences to learn: a start and a stride each
    start = torch.randint(0, config.vocab_size, (args.samples, 1), generator=gen)
    stride = torch.randint(1, 8, (args.samples, 1), generator=gen)
    dataset = torch.utils.data.TensorDataset((start + stride * torch.arange(args.seq)) % config.vocab_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup, args.steps)
    return model, dataset, optimizer, scheduler


def step_done(world: elastic.World, state: elastic.TorchState, args: argparse.Namespace, summed: float,
              seen: int, lr: float) -> None:
    """After an optimizer step (collective): the global loss and the sequences the ranks used, recorded."""
    tally = np.array([summed / args.batch, seen])
    world.allreduce([tally])
    state.step += 1
    state.loss = float(tally[0])
    state.record_step(state.step, state.loss, total=args.steps, sequences=int(tally[1]), lr=lr)
    if state.step % args.commit_every == 0:
        state.commit()


def result(world: elastic.World, state: elastic.TorchState, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    if world.rank == 0:
        print(f"[hf_gpt2] done: {state.step} steps on {world.size} ranks, loss {state.loss:.6f}", flush=True)
        world.events.emit("result", steps=state.step, size=world.size, final_loss=state.loss,
                          model_sha256=digest(model.state_dict()), optimizer_sha256=digest(optimizer.state_dict()),
                          scheduler_sha256=digest(scheduler.state_dict()))


def main() -> int:
    args = arguments(__doc__.splitlines()[0])
    model, dataset, optimizer, scheduler = build(args)
    world = elastic.init()  # a spare parks here, the model built (the same init on every rank)
    torch.manual_seed(1000 + int(world.logical_rank))  # dropout differs per rank (restored per rank)
    state = elastic.TorchState(world, model=model, optimizer=optimizer, scheduler=scheduler,
                               step=0, loss=float("nan"))
    sampler = elastic.data.GlobalBatchSampler(world, len(dataset), args.batch, step=lambda: state.step,
                                              seed=args.seed, accumulation=args.accumulation)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    ddp = elastic.distributed.DistributedDataParallel(world, model)  # wrapped again in each generation

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> None:
        model.train()
        summed, seen = 0.0, 0
        while state.step < args.steps:
            # The sampler starts at state.step's first micro-batch on each entry (and each epoch),
            # so a counter that starts here counts micro-batches within the step, after a roll-back too.
            for i, (ids,) in enumerate(loader):
                last = (i + 1) % args.accumulation == 0
                with contextlib.nullcontext() if last else ddp.no_sync():
                    mean = ddp(input_ids=ids, labels=ids).loss  # the mean over this micro-batch's tokens
                    # DDP divides by world.size: this micro-batch's part of the global batch's mean,
                    # whatever share of it this rank has (4 ranks or 3 after a shrink).
                    (mean * len(ids) * world.size / args.batch).backward()
                summed, seen = summed + mean.item() * len(ids), seen + len(ids)
                if not last:
                    continue
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step_done(world, state, args, summed, seen, scheduler.get_last_lr()[0])
                summed, seen = 0.0, 0
                if state.step == args.steps:
                    break

    train(world, state)
    result(world, state, model, optimizer, scheduler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
