"""A 2-D Poisson solve by conjugate gradients that keeps running when ranks die, by spare or by shrink.

The grid's N x N unknowns (``-Laplace(u) = 1`` on the unit square, zero on its
edge, the 5-point stencil) are cut into one strip of rows per initial logical
rank. Each iteration applies the stencil to the search direction after a halo
exchange with the neighbouring strips (``world.neighbors``: a dead neighbour is
a ``ProcessFailure``, never a crash inside MPI), and takes two dot products.
A dot product is summed strip by strip, in strip order, whoever holds the
strips: each rank puts its strips' partial sums in their slots of a vector of
zeros, one all-reduce adds the vectors (a slot's one value plus zeros is
exact), and every rank adds the slots in order. So the iterates are bitwise the
failure-free run's after a spare, a spawned process or a shrink, and the solve
takes as many iterations.

Every iteration is a recovery point (``State(per_step=True)``): the strips
(``x``, ``r``, ``p``: rank-unique, ``local``) are replicated to peers at the
iteration's step point, after its last collective, so a failure redoes at
most the iteration in flight (``--commit-every K``: a commit every K
iterations instead, fewer bytes, up to K iterations redone). After a shrink a survivor adopts the removed
rank's strips and computes them too. ``state.record_step`` marks each
iteration: ``python -m elastic.report`` gives the ETTR and the down time.

    python -m elastic.launch -n 4 --spares 1 --inject 1@40 -- python examples/cg.py
    python -m elastic.launch -n 4 --rebuild shrink --inject 2@40 -- python examples/cg.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import elastic


def owners(world: elastic.World, state: elastic.State) -> dict[int, int]:
    """strip -> current rank, from every rank's strips (collective: after every reset)."""
    mine = sorted({int(name.split(".")[1]) for name in state.names() if name.startswith("x.")})
    return {strip: rank for rank, strips in enumerate(world.allgather(mine)) for strip in strips}


def mine(world: elastic.World, owner: dict[int, int]) -> list[int]:
    return sorted(s for s, r in owner.items() if r == world.rank)


def dot(world: elastic.World, owner: dict[int, int], a: dict[int, np.ndarray], b: dict[int, np.ndarray],
        step: int) -> float:
    """sum over the strips of a . b, in strip order whoever holds them (collective)."""
    slots = np.zeros(len(owner))
    for s in mine(world, owner):
        slots[s] = (a[s] * b[s]).sum()
    world.allreduce([slots], step=step)  # each slot: one rank's value plus zeros, exactly
    return float(np.add.reduce(slots))  # in slot order, the same on every rank


def apply_laplacian(world: elastic.World, owner: dict[int, int], p: dict[int, np.ndarray], step: int) -> dict:
    """q = A p for this rank's strips: the rows above and below each strip from its neighbours
    (collective among neighbours), zero beyond the grid's edge."""
    strips = mine(world, owner)
    width = next(iter(p.values())).shape[1]
    halo = {s: np.zeros((2, width)) for s in strips}  # the row above, the row below
    sends, receives = [], []
    for s in strips:
        for side, neighbour in ((0, s - 1), (1, s + 1)):
            if neighbour not in owner:
                continue  # the grid's edge
            if owner[neighbour] == world.rank:
                halo[s][side] = p[neighbour][-1 if side == 0 else 0]
            else:
                receives.append((owner[neighbour], 2 * s + side, halo[s][side]))
                sends.append((owner[neighbour], 2 * neighbour + 1 - side, p[s][0 if side == 0 else -1].copy()))
    world.neighbors(sends, receives, step)
    q = {}
    for s in strips:
        padded = np.zeros((p[s].shape[0] + 2, width + 2))
        padded[1:-1, 1:-1] = p[s]
        padded[0, 1:-1], padded[-1, 1:-1] = halo[s]
        q[s] = 4 * p[s] - padded[:-2, 1:-1] - padded[2:, 1:-1] - padded[1:-1, :-2] - padded[1:-1, 2:]
    return q


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="grid points per side (a multiple of the ranks)")
    parser.add_argument("--tol", type=float, default=1e-8, help="stop when |r| / |b| is below this")
    parser.add_argument("--max-iterations", type=int, default=2000)
    parser.add_argument("--replication", type=int, default=None,
                        help="copies of each strip (default: the job's --redundancy, else 2)")
    parser.add_argument("--commit-every", type=int, default=0,
                        help="commit every K iterations instead (0: every iteration a recovery point)")
    args = parser.parse_args()

    world = elastic.init()
    strips = world.job.initial_size
    if args.n % strips:
        raise SystemExit(f"--n {args.n} is not a multiple of the {strips} ranks' strips")
    me, rows = int(world.logical_rank), args.n // strips
    h2 = 1.0 / (args.n + 1) ** 2
    b = np.full((rows, args.n), h2)  # the right-hand side, scaled by the grid spacing
    # x starts at 0, so r = p = b; rho = r . r is the first thing the solve computes (a collective:
    # here, before elastic.run, a promoted spare would call it while the survivors recover)
    per_iteration = args.commit_every == 0
    state = elastic.State(world, per_step=per_iteration, replication=args.replication, local=("x", "r", "p"),
                          step=0, rho=float("nan"), rho0=float("nan"),
                          **{f"x.{me}": np.zeros_like(b), f"r.{me}": b.copy(), f"p.{me}": b.copy()})
    owner: dict[int, int] = {}

    def on_reset(world: elastic.World, rebuild: elastic.Rebuild) -> None:
        owner.clear()  # a shrink moved strips: ask again

    @elastic.run(on_reset=on_reset)
    def solve(world: elastic.World, state: elastic.State) -> str:
        owner.update(owner or owners(world, state))
        if state.step == 0:
            r = {s: state[f"r.{s}"] for s in mine(world, owner)}
            state.rho = state.rho0 = dot(world, owner, r, r, step=0)
        while state.step < args.max_iterations and state.rho > args.tol ** 2 * state.rho0:
            held = mine(world, owner)
            x, r, p = ({s: state[f"{v}.{s}"] for s in held} for v in "xrp")
            q = apply_laplacian(world, owner, p, state.step)
            alpha = state.rho / dot(world, owner, p, q, state.step)
            for s in held:
                x[s] = x[s] + alpha * p[s]
                r[s] = r[s] - alpha * q[s]
            rho = dot(world, owner, r, r, state.step)  # the iteration's last collective
            for s in held:
                state[f"x.{s}"], state[f"r.{s}"] = x[s], r[s]
                state[f"p.{s}"] = r[s] + (rho / state.rho) * p[s]
            if per_iteration:
                state.step_point()  # the strips as this iteration leaves them: replicated, or nobody goes on
            state.rho = rho
            state.step += 1
            state.record_step(state.step, float(np.sqrt(rho / state.rho0)))  # the relative residual
            if not per_iteration and state.step % args.commit_every == 0:
                state.commit()
        # The whole solution, strip by strip (collective: a failure here is recovered too).
        parts = world.allgather({s: state[f"x.{s}"] for s in mine(world, owner)})
        x_all = {s: v for part in parts for s, v in part.items()}
        return hashlib.sha256(np.concatenate([x_all[s] for s in sorted(x_all)]).tobytes()).hexdigest()

    digest = solve(world, state)
    if world.rank == 0:
        residual = float(np.sqrt(state.rho / state.rho0))
        print(f"[cg] {state.step} iterations on {world.size} ranks (generation {world.generation}): relative "
              f"residual {residual:.3e}, x sha256 {digest[:16]}", flush=True)
        world.events.emit("result", steps=state.step, size=world.size, generation=world.generation,
                          x_sha256=digest, residual=residual, logical_ranks=[int(r) for r in world.logical_ranks])
    return 0


if __name__ == "__main__":
    sys.exit(main())
