"""A training loop written the way torch tutorials write it, ported with nothing but the README.

No ``world.fault_point`` (the launcher's ``--inject`` must fire anyway, at the library's own
calls), a DataLoader over ``GlobalBatchSampler`` with no generator of its own (its iterator draws
from torch's global generator), dropout, and gradients zeroed *after* ``optimizer.step()``. After
a kill with a spare the model and optimizer must be bitwise the failure-free run's.

    python -m elastic.launch -n 4 --spares 1 --inject 1@c12 -- python tests/programs/standard_loop.py

``--accumulation K``: each step's share in K micro-batches from the sampler, the gradients summed
over them before the one all-reduce of the step; steps and injections count optimizer steps.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train import digest  # noqa: E402

import elastic  # noqa: E402
import elastic.data  # noqa: E402

STEPS, BATCH = 40, 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulation", type=int, default=1)
    accumulation = parser.parse_args().accumulation
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=gen)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    dataset = TensorDataset(x, y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    world = elastic.init()
    torch.manual_seed(100 + int(world.logical_rank))  # dropout differs per rank (restored per rank)
    state = elastic.TorchState(world, model=model, optimizer=optimizer, step=0)
    sampler = elastic.data.GlobalBatchSampler(world, len(dataset), BATCH, step=lambda: state.step,
                                              accumulation=accumulation)
    loader = DataLoader(dataset, batch_sampler=sampler)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        loss = float("nan")
        while state.step < STEPS:
            summed = 0.0
            for i, (xb, yb) in enumerate(loader):  # a new iterator starts at a step's first micro-batch
                share = torch.nn.functional.mse_loss(model(xb), yb, reduction="sum") / BATCH
                share.backward()
                summed += float(share)
                if (i + 1) % accumulation:
                    continue
                elastic.allreduce_gradients(world, model)
                optimizer.step()
                optimizer.zero_grad()  # after the step, as many loops do
                state.step += 1
                tally, summed = np.array([summed]), 0.0
                world.allreduce([tally])
                loss = float(tally[0])
                state.record_step(state.step, loss, total=STEPS)
                if state.step % 5 == 0:
                    state.commit()
                if state.step == STEPS:
                    break
        return loss

    loss = train(world, state)
    if world.rank == 0:
        world.events.emit("result", steps=state.step, final_loss=loss, model_sha256=digest(model.state_dict()),
                          optimizer_sha256=digest(optimizer.state_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
