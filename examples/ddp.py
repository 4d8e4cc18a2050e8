"""examples/train.py written with torch's DistributedDataParallel over the World's process group.

The model, data and optimizer of train.py; gradients are all-reduced by DDP
during the backward pass instead of by ``allreduce_gradients`` after it, on the
``ulfm`` process group (the World's communicator: a death ends the all-reduce
at once) or, ``--backend gloo``, over Gloo (no abort in torch 2.13: the library shuts the group's
connections down after a failure, which ends every survivor's wait in an all-reduce at once).
``elastic.distributed.DistributedDataParallel`` wraps the model again in each
new generation; the State holds the model itself, so the roll-back and the
optimizer keep the same parameters.

    python -m elastic.launch -n 4 --spares 1 --inject 1@20 -- python examples/ddp.py --steps 40
    python -m elastic.launch -n 2 --spares 1 --inject 1@20 -- python examples/ddp.py --device cuda  # GPUs: NCCL

On GPUs (``--device cuda``: each rank on ``elastic.device(world)``) the group is NCCL's
(``--backend gloo`` also moves CUDA tensors), cuBLAS runs deterministically, and the State
holds the CUDA RNG states too; NCCL wants one GPU per rank.

With a spare or a spawned replacement the final model and optimizer are bitwise
those of a failure-free run; after a shrink the global batches stay the same.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import elastic
import elastic.distributed
from train import add_arguments, digest, report, setup, step_done, step_tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--group-timeout", type=float, default=30.0,
                        help="Gloo: seconds a rank may wait in one of DDP's all-reduces (for a peer alive but stuck)")
    parser.add_argument("--find-unused-parameters", action="store_true", help="torch DDP's option of that name")
    parser.add_argument("--per-step", action="store_true", help="every optimizer step a recovery point")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model trains (cuda: this rank's GPU, elastic.device)")
    parser.add_argument("--backend", choices=("ulfm", "gloo", "nccl"),
                        help="default: nccl on cuda, ulfm on cpu (the World's communicator)")
    args = parser.parse_args()
    if args.device == "cuda":  # bitwise runs need deterministic cuBLAS kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    x, y, model = setup(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    world = elastic.init()
    device = elastic.device(world) if args.device == "cuda" else torch.device("cpu")
    model.to(device)  # the optimizer keeps the same parameters (its state is made at the first step)
    x, y = x.to(device), y.to(device)
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    state = elastic.TorchState(world, model=model, optimizer=optimizer, replication=args.replication,
                               per_step=args.per_step, step=0, loss=float("nan"))
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    ddp = elastic.distributed.DistributedDataParallel(
        world, model, elastic.distributed.ProcessGroup(
            world, backend=args.backend or ("nccl" if device.type == "cuda" else "ulfm"), timeout=args.group_timeout),
        find_unused_parameters=args.find_unused_parameters)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        while state.step < args.steps:
            world.fault_point(state.step)
            optimizer.zero_grad()
            mine = batches.shard(state.step, world)
            idx = torch.from_numpy(mine).to(device)
            # DDP averages over the ranks: times the world size over the global batch gives the
            # global mean whatever share each rank has (4 ranks or 3).
            share = torch.nn.functional.mse_loss(ddp(x[idx]), y[idx], reduction="sum")
            (share * world.size / args.batch).backward()  # DDP all-reduces the gradients in here
            tally = step_tally(world, float(share.detach()), mine, args)  # before the update: see per_step
            optimizer.step()
            step_done(state, tally, args)
            if state.step % args.commit_every == 0:
                state.commit()
        return state.loss

    loss = train(world, state)
    report(world, state, loss, model_sha256=digest(model.state_dict()),
           optimizer_sha256=digest(optimizer.state_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
