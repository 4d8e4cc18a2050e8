"""A standard PyTorch training script, not elastic: the original that examples/mnist.py ports.

The shape of Horovod's elastic MNIST example: a small CNN on MNIST-shaped data
(synthetic here: no download), a DataLoader, SGD with momentum, a StepLR
scheduler, gradient clipping, an epoch/batch loop.

    python examples/mnist_plain.py --epochs 3
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 16, 3)
        self.fc = nn.Linear(16 * 5 * 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def synthetic_mnist(samples: int, seed: int) -> TensorDataset:
    """28x28 images whose class (of 4) is a function of their pixels: learnable, no download."""
    x = torch.randn(samples, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    y = (x[:, 0, 10:18, 10:18].mean((1, 2)) > 0).long() + 2 * (x[:, 0, :14].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scaler", action="store_true", help="loss scaling with a GradScaler, as mixed precision does")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.manual_seed(args.seed)
    dataset = synthetic_mnist(args.samples, args.seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", growth_interval=8, enabled=args.scaler)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True)
    for epoch in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        print(f"epoch {epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}")


if __name__ == "__main__":
    main()
