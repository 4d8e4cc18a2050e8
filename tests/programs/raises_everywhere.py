"""A program error on every rank at step 2 (a KeyError three frames down): what the launcher must
show once, with the program's frames, and say was the same everywhere."""
from __future__ import annotations

import elastic


def look_up(table: dict) -> int:
    return table["missing"]


def main() -> int:
    world = elastic.init()
    state = elastic.State(world, step=0)

    @elastic.run
    def train(world: elastic.World, state: elastic.State) -> int:
        while state.step < 5:
            if state.step == 2:
                look_up({})
            state.step += 1
            state.record_step(state.step)
        return 0

    return train(world, state)


if __name__ == "__main__":
    main()
