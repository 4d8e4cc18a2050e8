"""ZeRO-1-style data parallelism: each rank keeps only its shard of the optimizer state.

The flattened parameters are cut into one shard per initial logical rank.
Gradients are all-reduced as in train.py; then each rank takes the Adam step
for the shards it owns (their moments live only there, in the State as
``adam.<shard>.m`` / ``adam.<shard>.v``, per-rank values) and the updated
shards are all-gathered so that every rank holds the whole model again.

A lost rank's moments exist nowhere else but in the store's replicas: a spare
or spawned replacement gets them back; after a shrink a survivor adopts the
removed rank's state and from then on owns its shards as well.

    python -m elastic.launch -n 4 --rebuild shrink --inject 2@20 -- python examples/zero1.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
import torch

import elastic
from train import add_arguments, digest, local_loss, report, setup

BETAS, EPS = (0.9, 0.999), 1e-8


def owned_shards(state: elastic.State) -> list[int]:
    """The shards whose moments this rank holds (its own, plus those adopted after a shrink)."""
    return sorted({int(name.split(".")[1]) for name in state.names() if name.startswith("adam.")})


def adam_step(flat: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr: float) -> None:
    """One Adam update of a shard, in place (the same arithmetic as torch.optim.Adam's defaults)."""
    m *= BETAS[0]
    m += (1 - BETAS[0]) * grad
    v *= BETAS[1]
    v += (1 - BETAS[1]) * grad * grad
    m_hat = m / np.float32(1 - BETAS[0] ** t)
    v_hat = v / np.float32(1 - BETAS[1] ** t)
    flat -= np.float32(lr) * m_hat / (np.sqrt(v_hat) + np.float32(EPS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    x, y, model = setup(args)
    world = elastic.init()
    torch.manual_seed(1000 + int(world.logical_rank or 0))
    n_params = sum(p.numel() for p in model.parameters())
    bounds = np.linspace(0, n_params, world.job.initial_size + 1).astype(int)  # shard s: [bounds[s], bounds[s+1])
    me = int(world.logical_rank)
    size = int(bounds[me + 1] - bounds[me])
    state = elastic.TorchState(world, model=model, replication=args.replication, local=("adam",), step=0,
                               loss=float("nan"), **{f"adam.{me}.{k}": np.zeros(size, np.float32) for k in "mv"})
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        while state.step < args.steps:
            world.fault_point(state.step)
            model.zero_grad()
            loss, samples = local_loss(world, model, x, y, batches, state.step, args)
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
            updated = {}
            for s in owned_shards(state):
                lo, hi = bounds[s], bounds[s + 1]
                adam_step(flat[lo:hi], grad[lo:hi], state[f"adam.{s}.m"], state[f"adam.{s}.v"], state.step + 1, args.lr)
                updated[s] = flat[lo:hi]
            for part in world.allgather(updated):
                for s, values in part.items():
                    flat[bounds[s]:bounds[s + 1]] = values
            torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())
            state.step += 1
            state.loss = loss  # committed with the rest: a job resumed after its last step still knows it
            state.record_step(state.step, loss, total=args.steps, samples=samples)
            if state.step % args.commit_every == 0:
                state.commit()
        return state.loss

    loss = train(world, state)
    owners = world.allgather(owned_shards(state))
    moments = {s: np.concatenate([state[f"adam.{s}.m"], state[f"adam.{s}.v"]]) for s in owned_shards(state)}
    all_moments = world.allgather(moments)
    if world.rank == 0:
        merged = {s: b for part in all_moments for s, b in part.items()}
        report(world, state, loss, model_sha256=digest(model.state_dict()), shard_owners=owners,
               moments_sha256=hashlib.sha256(b"".join(merged[s].tobytes() for s in sorted(merged))).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
