"""examples/mnist_plain.py ported to ulfm-elastic: the same script, surviving the loss of ranks.

What changed, and why (the README shows it line by line): the model, the
optimizer *and the scheduler* go into a TorchState (a roll-back must put the
learning rate back too); the DataLoader takes its batches from a
GlobalBatchSampler (this rank's share of a global batch fixed by the step, so a
shrink keeps the batches); the loss is a sum over the global batch and the
gradients are all-reduced; the loop counts steps, not epochs, and commits.

    python -m elastic.launch -n 4 --spares 1 --inject 1@20 -- python examples/mnist.py
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from mnist_plain import Net, arguments, synthetic_mnist
from torch import nn
from torch.utils.data import DataLoader
from train import digest

import elastic
import elastic.data


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)  # ranks share the cores
    torch.manual_seed(args.seed)
    dataset = synthetic_mnist(args.samples, args.seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", growth_interval=8, enabled=args.scaler)
    world = elastic.init()
    state = elastic.TorchState(world, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, step=0)
    sampler = elastic.data.GlobalBatchSampler(world, len(dataset), args.batch, step=lambda: state.step,
                                              seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=sampler)
    total = args.epochs * sampler.steps_per_epoch

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        loss = float("nan")
        while state.step < total:
            for x, y in loader:
                world.fault_point(state.step)  # the launcher's --inject, for tests; a no-op otherwise
                optimizer.zero_grad()
                share = F.cross_entropy(model(x), y, reduction="sum") / args.batch  # summed: the global mean
                scaler.scale(share).backward()
                elastic.allreduce_gradients(world, model)
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                lr = optimizer.param_groups[0]["lr"]
                scaler.step(optimizer)
                scaler.update()
                state.step += 1
                # The global loss, and which samples the ranks used (a count and an exact sum).
                tally = np.array([float(share), len(y), float((x.flatten(1).sum(1) * 1000).round().long().sum())])
                world.allreduce([tally])
                loss = float(tally[0])
                state.record_step(state.step, loss, total=total, lr=lr, samples=tally[1:].tolist())
                if state.step % sampler.steps_per_epoch == 0:
                    scheduler.step()
                    epoch = state.step // sampler.steps_per_epoch - 1
                    if world.rank == 0:
                        print(f"epoch {epoch} loss {loss:.4f} lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
                if state.step % 10 == 0:
                    state.commit()
        return loss

    loss = train(world, state)
    if world.rank == 0:
        print(f"[mnist] done: {state.step} steps on {world.size} ranks, loss {loss:.6f}, "
              f"model sha256 {digest(model.state_dict())}", flush=True)
        world.events.emit("result", steps=state.step, size=world.size, final_loss=loss,
                          model_sha256=digest(model.state_dict()), optimizer_sha256=digest(optimizer.state_dict()),
                          scheduler_lr=scheduler.get_last_lr()[0], scaler_scale=scaler.get_scale())


if __name__ == "__main__":
    main()
