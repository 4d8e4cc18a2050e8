"""examples/hf_gpt2.py written with Hugging Face accelerate: its ``backward``, ``accumulate`` and ``clip_grad_norm_``.

``Accelerator()`` made after ``elastic.init()`` and ``init_process_group()`` finds the World's
``ulfm`` group and runs as ``MULTI_CPU``. What ``prepare`` returns cannot survive a failure, so
nothing is given to it (docs/using.md, "Hugging Face transformers and accelerate", says why and
measures it): the model goes to ``elastic.distributed.DistributedDataParallel`` (wrapped again in each generation,
where accelerate's torch DDP is made once: a promoted spare's constructor would wait for
survivors that never enter theirs), and the data to ``GlobalBatchSampler`` (accelerate's sharded
loader starts each epoch from its first batch and keeps the size it was made with). The optimizer
and schedule stay plain (accelerate's scheduler steps once per process per optimizer step).

    python -m elastic.launch -n 4 --spares 1 --inject 2@13.1 -- python examples/hf_gpt2_accelerate.py

With a spare the final model and optimizer are bitwise those of the failure-free run.
"""
from __future__ import annotations

import sys

try:
    from accelerate import Accelerator
except ModuleNotFoundError:
    sys.exit("examples/hf_gpt2_accelerate.py needs Hugging Face accelerate: pip install -c constraints.txt -e '.[hf]'")
import torch
import torch.distributed as dist

import elastic
import elastic.data
import elastic.distributed
from hf_gpt2 import arguments, build, result, step_done


def main() -> int:
    args = arguments(__doc__.splitlines()[0])
    model, dataset, optimizer, scheduler = build(args)
    world = elastic.init()
    dist.init_process_group()  # the World's ulfm group, which accelerate finds
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(1000 + int(world.logical_rank))
    state = elastic.TorchState(world, model=model, optimizer=optimizer, scheduler=scheduler,
                               step=0, loss=float("nan"))
    sampler = elastic.data.GlobalBatchSampler(world, len(dataset), args.batch, step=lambda: state.step,
                                              seed=args.seed, accumulation=args.accumulation)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    ddp = elastic.distributed.DistributedDataParallel(world, model)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> None:
        model.train()
        accelerator.step = 0  # accelerate counts micro-batches itself: from the step's first, as the sampler
        summed, seen = 0.0, 0
        while state.step < args.steps:
            for (ids,) in loader:
                with accelerator.accumulate(ddp):  # no_sync on all micro-batches but the step's last
                    mean = ddp(input_ids=ids, labels=ids).loss
                    # accelerate divides by the micro-batches; DDP by the ranks: this gives the
                    # micro-batch's part of the global batch's mean, on 4 ranks or 3.
                    accelerator.backward(mean * len(ids) * world.size * args.accumulation / args.batch)
                summed, seen = summed + mean.item() * len(ids), seen + len(ids)
                if not accelerator.sync_gradients:
                    continue
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
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
