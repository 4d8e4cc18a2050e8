"""A 1-D heat equation whose halos go through ``world.mpi.comm.Sendrecv``, as HPC codes write them.

One slab per rank (spares fill a loss, so the slabs never move); each step a ``Sendrecv`` to the
right and one to the left (``MPI.PROC_NULL`` at the rod's ends) inside ``world.mpi.guard()``, then
the stencil. A neighbour killed at any moment must end every survivor's exchange with a
``ProcessFailure`` (the communicator the World hands out posts the pair non-blocking), never a
crash inside Open MPI, never a hang; the rod is then bitwise the failure-free run's.

    python -m elastic.launch -n 4 --spares 1 --inject 2@17 -- python tests/programs/sendrecv_halo.py
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import sys

import numpy as np
from mpi4py import MPI

import elastic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cells", type=int, default=2048)
    parser.add_argument("--blocking", action="store_true",
                        help="call Open MPI's blocking Sendrecv (mpi4py's own), as without HaloComm: the control")
    args = parser.parse_args()
    sendrecv = MPI.Intracomm.Sendrecv if args.blocking else None
    world = elastic.init()
    me, n = int(world.logical_rank), world.job.initial_size
    x = (np.arange(args.cells) + me * args.cells) / (n * args.cells)
    state = elastic.State(world, local=("slab",), step=0, slab=np.sin(np.pi * x) + (x > 0.5))

    @elastic.run
    def solve(world: elastic.World, state: elastic.State) -> str:
        while state.step < args.steps:
            comm, r = world.mpi.comm, int(world.rank)
            left = r - 1 if r > 0 else MPI.PROC_NULL
            right = r + 1 if r < world.size - 1 else MPI.PROC_NULL
            u = state.slab
            halo = np.zeros(2)
            exchange = comm.Sendrecv if sendrecv is None else functools.partial(sendrecv, comm)
            with world.mpi.guard():
                exchange(np.ascontiguousarray(u[-1:]), dest=right, sendtag=1, recvbuf=halo[0:1], source=left,
                         recvtag=1)
                exchange(np.ascontiguousarray(u[:1]), dest=left, sendtag=2, recvbuf=halo[1:2], source=right,
                         recvtag=2)
            padded = np.concatenate(([halo[0]], u, [halo[1]]))
            state.slab = u + 0.25 * (padded[:-2] - 2 * u + padded[2:])
            state.step += 1
            state.record_step(state.step)
            if state.step % 5 == 0:
                state.commit()
        rod = world.allgather(state.slab)
        return hashlib.sha256(np.concatenate(rod).tobytes()).hexdigest()

    digest = solve(world, state)
    if world.rank == 0:
        world.events.emit("result", steps=state.step, size=world.size, rod_sha256=digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
