"""ulfm-elastic: MPI jobs that lose processes and keep going.

    world = elastic.init()                 # a spare waits here until needed
    while step < n:
        try:
            world.fault_point(step)        # injected faults, if a schedule is set
            ... compute on world.comm inside `with world.guard():` ...
        except elastic.ProcessFailure:
            world.recover()                # every survivor; then resync state
    world.finish()
"""
from elastic.comm import (
    ConfigError, CurrentRank, ElasticError, LogicalRank, ProcessFailure, Rebuild, Role, UlfmUnavailable,
    Unrecoverable, World, init,
)

__version__ = "0.1.0"

__all__ = [
    "init", "World", "Rebuild", "Role", "LogicalRank", "CurrentRank",
    "ElasticError", "ProcessFailure", "Unrecoverable", "UlfmUnavailable", "ConfigError",
]
