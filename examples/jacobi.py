"""A distributed Jacobi solve that keeps running when ranks are killed.

The rows of A x = b are cut into one shard per initial logical rank. Each step,
every active rank updates the shards it owns and an Allgather shares them, so
the iterate x is held by every rank: a replacement gets it from a survivor,
and after a shrink the lost shards are re-dealt to the survivors. Each shard's
update has the same shape whoever computes it, so the result is bitwise equal
to a failure-free run in every rebuild mode.

    python -m elastic.launch -n 4 --spares 1 --inject 1@10 -- python examples/jacobi.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import elastic
from elastic import Role


def make_system(n_shards: int, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    m = n_shards * rows
    a = rng.random((m, m)) + m * np.eye(m)  # strictly diagonally dominant: Jacobi converges
    return a, rng.random(m)


def owners(world: elastic.World) -> dict[int, int]:
    """shard -> current rank: a shard stays with its logical rank, orphans are dealt round-robin."""
    active = list(world.logical_ranks)
    orphans = [s for s in range(world.job.initial_size) if s not in active]
    table = {int(logical): current for current, logical in enumerate(active)}
    for i, shard in enumerate(orphans):
        table[shard] = i % len(active)
    return table


def step_once(world: elastic.World, a: np.ndarray, b: np.ndarray, x: np.ndarray, rows: int, step: int) -> np.ndarray:
    owner = owners(world)
    mine = np.zeros((world.job.initial_size, rows))
    for shard, current in owner.items():
        if current == world.rank:
            r = slice(shard * rows, (shard + 1) * rows)
            diag = np.diag(a)[r]
            mine[shard] = (b[r] - a[r] @ x + diag * x[r]) / diag
    gathered = np.empty((world.size, world.job.initial_size, rows))
    world.mpi.Allgather(mine, gathered, step=step)
    return np.concatenate([gathered[owner[s], s] for s in range(world.job.initial_size)])


def resync(world: elastic.World, step: int, x: np.ndarray, x_prev: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Agree on the last step every survivor completed and hand its iterate to newcomers (collective)."""
    steps = world.allgather(None if world.role is Role.RECOVERED else step)
    agreed = min(s for s in steps if s is not None)
    if world.role is not Role.RECOVERED and step > agreed:  # one step ahead: roll back
        step, x = agreed, x_prev
    x = world.bcast(x, root=world.job.first_survivor)
    return agreed, x, x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=64, help="rows per shard")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    world = elastic.init()
    a, b = make_system(world.job.initial_size, args.rows, args.seed)
    x = x_prev = np.zeros(len(b))
    step = 0
    needs_sync = world.role is Role.RECOVERED
    clock = elastic.StepClock(world)  # step events: the report's ETTR, down time and steps redone
    clock.restart()
    while True:
        try:
            if needs_sync:
                step, x, x_prev = resync(world, step, x, x_prev)
                needs_sync = False
                clock.restart()  # the recovery is not a step's time
            if step == args.steps:
                world.finish()
                break
            world.fault_point(step)
            x_prev, x = x, step_once(world, a, b, x, args.rows, step)
            step += 1
            clock.step_done(step, total=args.steps)
        except elastic.ProcessFailure:
            rebuild = world.recover()
            needs_sync = True
            if world.rank == world.job.first_survivor:
                ms = {k: round(v * 1e3, 1) for k, v in rebuild.durations.items()}
                lost = sorted(map(int, rebuild.failed))
                print(f"[jacobi] generation {rebuild.generation}: lost logical ranks {lost}, "
                      f"rebuilt by {rebuild.mode} in {ms['total']} ms {ms}; now {world.size} active ranks, "
                      f"{world.job.spares} spares", flush=True)

    if world.rank == 0:
        residual = float(np.linalg.norm(a @ x - b))
        digest = hashlib.sha256(x.tobytes()).hexdigest()
        print(f"[jacobi] {step} steps on {world.size} ranks (generation {world.generation}): "
              f"residual {residual:.3e}, x sha256 {digest[:16]}", flush=True)
        world.events.emit("result", steps=step, size=world.size, generation=world.generation,
                          logical_ranks=[int(r) for r in world.logical_ranks], x_sha256=digest, residual=residual)
    return 0


if __name__ == "__main__":
    sys.exit(main())
