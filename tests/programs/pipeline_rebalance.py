"""examples/pipeline.py's model and step on ``elastic.run``, for a pipeline that shrinks: the stages
are committed to the store (``elastic.pipeline.stage_state``), every rank rolls back to the commit
after a failure, and after a shrink the lost stage's neighbour adopts it and hosts two stages
(``host_stages``), the hop between them staying local. A result event like the example's.

    python -m elastic.launch -n 4 --rebuild shrink --inject 2@17 -- python tests/programs/pipeline_rebalance.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torch  # noqa: E402

import elastic  # noqa: E402
from elastic.pipeline import host_stages, stage_state  # noqa: E402
from pipeline import Stage, make_text, train_step  # noqa: E402  (examples/pipeline.py)


def main() -> int:
    args = argparse.Namespace(steps=30, batch=16, micro=4, samples=1024, seq=32, vocab=64, dim=64, heads=4, blocks=1,
                              lr=3e-3, seed=0, checkfree_plus=False)
    torch.set_num_threads(1)
    world = elastic.init()
    stages, me = world.job.initial_size, int(world.logical_rank)
    text, batches = make_text(args), elastic.GlobalBatches(args.samples, args.batch, args.seed)
    hosted = {me: Stage(me, stages, args)}
    optimizers = {me: torch.optim.Adam(hosted[me].parameters(), lr=args.lr)}
    state = stage_state(world, hosted[me], optimizers[me], step=0)

    def make(s: int) -> tuple[Stage, torch.optim.Optimizer]:
        made = Stage(s, stages, args)
        return made, torch.optim.Adam(made.parameters(), lr=args.lr)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> None:
        host_stages(state, hosted, optimizers, make)  # a replacement, or a removed neighbour's stage
        host = {s: r for r, mine in enumerate(world.allgather(sorted(hosted))) for s in mine}
        while state.step < args.steps:
            world.fault_point(state.step)
            for opt in optimizers.values():
                opt.zero_grad()
            loss = train_step(world, hosted, host, stages, text[torch.from_numpy(batches.batch(state.step))], args)
            for opt in optimizers.values():
                opt.step()
            state.step += 1
            state.record_step(state.step, loss, total=args.steps)
            if state.step % 5 == 0:
                state.commit()

    train(world, state)
    mine = [{"stage": s, "sha256": hashlib.sha256(b"".join(v.numpy().tobytes() for v in st.state_dict().values()))
             .hexdigest()} for s, st in hosted.items()]
    report = sorted((r for part in world.allgather(mine) for r in part), key=lambda r: r["stage"])
    if world.rank == 0:
        world.events.emit("result", steps=state.step, stages=report, generation=world.generation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
