"""A 1-D heat equation with halo exchanges that keeps running when ranks die, also by shrinking.

The rod is cut into one slab per initial logical rank. Each step every slab
takes one cell from each neighbouring slab (its halos) and updates its cells
with the explicit stencil ``u + a * (left - 2u + right)``. The slabs are State
values named by the slab (``slab.3``), per rank (``local``), committed every
``--commit-every`` steps. After a shrink a survivor adopts a removed rank's
slabs (``State`` does that) and computes them too: the owners are found again
after every reset, and a halo between two slabs on one rank is a copy. Each
cell's update has the same arithmetic whoever computes it, so the final rod is
bitwise the failure-free run's in every rebuild mode.

The halos go through ``world.neighbors`` (``Isend``/``Irecv``/``Waitall``): a dead
neighbour, or one that began a recovery (it revokes the communicator), is a
``ProcessFailure`` on every rank waiting for it, never a crash inside MPI.

    python -m elastic.launch -n 4 --rebuild shrink --inject 1@20 -- python examples/stencil.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import elastic


def owners(world: elastic.World, state: elastic.State) -> dict[int, int]:
    """slab -> current rank, from every rank's slabs (collective: after every reset)."""
    mine = [int(name.split(".")[1]) for name in state.names() if name.startswith("slab.")]
    return {slab: rank for rank, slabs in enumerate(world.allgather(mine)) for slab in slabs}


def step_once(world: elastic.World, state: elastic.State, owner: dict[int, int], alpha: float) -> None:
    """Halos from the neighbouring slabs, then the stencil on this rank's slabs (collective among
    neighbours). The rod's two ends are held at 0."""
    slabs = sorted(s for s, r in owner.items() if r == world.rank)
    halo = {s: np.zeros(2) for s in slabs}  # left, right
    sends, receives = [], []
    for s in slabs:
        u = state[f"slab.{s}"]
        for side, neighbour, edge in ((0, s - 1, u[:1]), (1, s + 1, u[-1:])):
            if neighbour not in owner:
                continue  # the rod's end
            if owner[neighbour] == world.rank:
                halo[s][side] = state[f"slab.{neighbour}"][-1 if side == 0 else 0]
            else:
                receives.append((owner[neighbour], 2 * s + side, halo[s][side:side + 1]))
                sends.append((owner[neighbour], 2 * neighbour + 1 - side, np.ascontiguousarray(edge)))
    world.neighbors(sends, receives)
    for s in slabs:
        u = state[f"slab.{s}"]
        padded = np.concatenate(([halo[s][0]], u, [halo[s][1]]))
        state[f"slab.{s}"] = u + alpha * (padded[:-2] - 2 * u + padded[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cells", type=int, default=4096, help="cells per slab")
    parser.add_argument("--commit-every", type=int, default=5)
    args = parser.parse_args()

    world = elastic.init()
    me = int(world.logical_rank)
    x = (np.arange(args.cells) + me * args.cells) / (world.job.initial_size * args.cells)
    state = elastic.State(world, local=("slab",), step=0, **{f"slab.{me}": np.sin(np.pi * x) + (x > 0.5)})
    owner: dict[int, int] = {}

    def on_reset(world: elastic.World, rebuild: elastic.Rebuild) -> None:
        owner.clear()  # a shrink moved slabs: ask again

    @elastic.run(on_reset=on_reset)
    def solve(world: elastic.World, state: elastic.State) -> str:
        while state.step < args.steps:
            if not owner:
                owner.update(owners(world, state))
            step_once(world, state, owner, alpha=0.25)
            state.step += 1
            state.record_step(state.step)
            if state.step % args.commit_every == 0:
                state.commit()
        # The whole rod, in slab order, on every rank (collective: a failure here is recovered too).
        parts = world.allgather({n: state[n] for n in state.names() if n.startswith("slab.")})
        slabs = {int(n.split(".")[1]): u for part in parts for n, u in part.items()}
        return hashlib.sha256(np.concatenate([slabs[s] for s in sorted(slabs)]).tobytes()).hexdigest()

    digest = solve(world, state)
    if world.rank == 0:
        print(f"[stencil] {state.step} steps on {world.size} ranks: rod sha256 {digest[:16]}", flush=True)
        world.events.emit("result", steps=state.step, size=world.size, rod_sha256=digest,
                          logical_ranks=[int(r) for r in world.logical_ranks])
    return 0


if __name__ == "__main__":
    sys.exit(main())
