"""elastic.comm: a ULFM communicator that survives the loss of processes.

Errors are translated in one place (``ProcessFailure`` means: call
``World.recover()``; ``Unrecoverable`` means: stop). ``World.recover()``
revokes, agrees on the failed set, and rebuilds by shrink, spare substitution
or spawn substitution; logical ranks keep their meaning throughout.
"""
from ._errors import ConfigError, ElasticError, ProcessFailure, UlfmUnavailable, Unrecoverable, mpi_errors
from ._events import EventLog, read_events, read_outcomes
from ._faults import InjectedFault, Injection, parse_schedule
from ._ranks import CurrentRank, LogicalRank, Role
from ._ulfm import agree_on_failed, check_ulfm
from ._world import Rebuild, World, init

__all__ = [
    "init", "World", "Rebuild", "Role", "LogicalRank", "CurrentRank",
    "ElasticError", "ProcessFailure", "Unrecoverable", "UlfmUnavailable", "ConfigError",
    "InjectedFault", "Injection", "parse_schedule", "check_ulfm", "agree_on_failed",
    "EventLog", "read_events", "read_outcomes", "mpi_errors",
]
