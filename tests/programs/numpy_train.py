"""examples/train.py's loop without torch, for tests of how processes end: a job starts in ~2 s, not ~5.

A linear model learns a fixed random teacher by SGD with momentum. The global batch of step ``s``
(``elastic.GlobalBatches``) is cut over the ranks, the gradients and the loss are summed with
``World.allreduce`` (the injections' ``collective`` point), every rank takes the same update;
weights, momentum, step and loss are the State, committed every ``--commit-every`` steps, and
``state.record_step`` is the injections' step point (no ``fault_point`` here). Bitwise the
failure-free run after a spare or a spawned process; the loss within 1e-5 after a shrink (the
sums' order changes). The result carries ``model_sha256`` / ``optimizer_sha256`` as train.py's.

    python -m elastic.launch -n 4 --spares 1 --inject 1@12 -- python tests/programs/numpy_train.py
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

import elastic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--replication", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.samples, args.features))
    y = x @ rng.standard_normal(args.features) + 0.05 * rng.standard_normal(args.samples)

    world = elastic.init()
    state = elastic.State(world, replication=args.replication, step=0, loss=float("nan"),
                          weights=np.zeros(args.features), momentum=np.zeros(args.features))
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)

    @elastic.run
    def train(world: elastic.World, state: elastic.State) -> float:
        while state.step < args.steps:
            mine = batches.shard(state.step, world)
            error = x[mine] @ state.weights - y[mine]
            tally = np.concatenate([x[mine].T @ error * (2 / args.batch), [error @ error / args.batch]])
            world.allreduce([tally])
            state.momentum = 0.9 * state.momentum + tally[:-1]
            state.weights = state.weights - args.lr * state.momentum
            state.step += 1
            state.loss = float(tally[-1])
            state.record_step(state.step, state.loss, total=args.steps)
            if state.step % args.commit_every == 0:
                state.commit()
        return state.loss

    loss = train(world, state)
    # What torchrun's conventions put in the environment, as each rank sees it now (after any rebuild).
    env = world.allgather([os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")])
    if world.rank == 0:
        model, optimizer = (hashlib.sha256(state[k].tobytes()).hexdigest() for k in ("weights", "momentum"))
        print(f"[numpy_train] done: {state.step} steps on {world.size} ranks, loss {loss:.6f}, "
              f"model sha256 {model}", flush=True)
        world.events.emit("result", steps=state.step, size=world.size, generation=world.generation, final_loss=loss,
                          logical_ranks=[int(r) for r in world.logical_ranks], model_sha256=model,
                          optimizer_sha256=optimizer, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
