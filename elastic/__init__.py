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

Importing ``elastic`` does not start MPI: the names below load their modules on
first use, so tools (``python -m elastic.launch``, ``elastic.report``) never do.
"""
from typing import TYPE_CHECKING

from elastic.comm import ConfigError, ElasticError, ProcessFailure, Role, UlfmUnavailable, Unrecoverable, agreed
from elastic.comm.runtime import lazy_exports

if TYPE_CHECKING:
    from elastic.comm import Rebuild, World
    from elastic.recovery import DataLost, Policy

    from ._loop import GlobalBatches, allreduce_gradients, device, init, micro_batches, run
    from ._clock import StepClock
    from ._state import State
    from ._torchstate import TorchState

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(globals(), {
    "init": "._loop", "run": "._loop", "allreduce_gradients": "._loop", "GlobalBatches": "._loop",
    "micro_batches": "._loop", "device": "._loop", "State": "._state", "TorchState": "._torchstate",
    "StepClock": "._clock",
    "World": "elastic.comm", "Rebuild": "elastic.comm", "DataLost": "elastic.recovery", "Policy": "elastic.recovery",
})

__all__ = [
    "init", "run", "State", "TorchState", "allreduce_gradients", "GlobalBatches", "micro_batches", "Policy",
    "StepClock", "device",
    "World", "Rebuild", "Role",
    "ElasticError", "ProcessFailure", "Unrecoverable", "UlfmUnavailable", "ConfigError", "DataLost", "agreed",
]
