"""A program that reaches no injection point: no fault_point, no record_step, no sampler, no
gradient all-reduce. A fault schedule for it can never fire; the job must say so, not exit 0."""
from __future__ import annotations

import sys

import numpy as np

import elastic


def main() -> int:
    world = elastic.init()
    state = elastic.State(world, done=0)

    @elastic.run
    def work(world: elastic.World, state: elastic.State) -> None:
        while state.done < 5:
            total = np.ones(1)
            world.allreduce([total])
            state.done += 1
            state.commit()

    work(world, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
