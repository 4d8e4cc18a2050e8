"""ulfm-elastic: MPI training that loses processes and keeps going.

    world = elastic.init()                              # a spare waits here until needed
    state = elastic.TorchState(world, model=model, optimizer=opt, step=0)

    @elastic.run                                        # save / restore / sync / reset
    def train(world, state):
        while state.step < steps:
            ... loss on this rank's share of batches.shard(state.step, world) ...
            elastic.allreduce_gradients(world, model)
            opt.step(); state.step += 1
            if state.step % 10 == 0:
                state.commit()                          # replicated in peers' memory

    train(world, state)
"""
from elastic.comm import (
    ConfigError, CurrentRank, ElasticError, LogicalRank, ProcessFailure, Rebuild, Role, UlfmUnavailable,
    Unrecoverable, World,
)
from elastic.recovery import DataLost, Policy

from ._loop import GlobalBatches, allreduce_gradients, init, micro_batches, run
from ._state import State, StepClock, TorchState

__version__ = "0.1.0"

__all__ = [
    "init", "run", "State", "TorchState", "allreduce_gradients", "GlobalBatches", "micro_batches", "Policy", "StepClock",
    "World", "Rebuild", "Role", "LogicalRank", "CurrentRank",
    "ElasticError", "ProcessFailure", "Unrecoverable", "UlfmUnavailable", "ConfigError", "DataLost",
]
