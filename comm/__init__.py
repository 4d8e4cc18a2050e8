"""elastic.comm: a ULFM communicator that survives the loss of processes.

Errors are translated in one place (``ProcessFailure`` means: call
``World.recover()``; ``Unrecoverable`` means: stop). ``World.recover()``
revokes, agrees on the failed set, and rebuilds by shrink, spare substitution
or spawn substitution; logical ranks keep their meaning throughout.

Importing this package does not initialize MPI: ``World``, ``init`` and the
ULFM helpers load ``mpi4py.MPI`` on first use.
"""
from typing import TYPE_CHECKING

from ._errors import ConfigError, ElasticError, ProcessFailure, UlfmUnavailable, Unrecoverable, agreed
from ._events import EventLog, read_events, read_fates, read_outcomes
from ._faults import InjectedFault, Injection, parse_schedule
from ._lazy import lazy_exports
from ._ranks import CurrentRank, LogicalRank, Role

if TYPE_CHECKING:
    from ._errors import mpi_errors
    from ._ulfm import agree_on_failed, check_ulfm
    from ._world import Rebuild, World, init

__getattr__, __dir__ = lazy_exports(globals(), {
    "init": "._world", "World": "._world", "Rebuild": "._world",
    "check_ulfm": "._ulfm", "agree_on_failed": "._ulfm", "mpi_errors": "._errors",
})

__all__ = [
    "init", "World", "Rebuild", "Role", "LogicalRank", "CurrentRank",
    "ElasticError", "ProcessFailure", "Unrecoverable", "UlfmUnavailable", "ConfigError", "agreed",
    "InjectedFault", "Injection", "parse_schedule", "check_ulfm", "agree_on_failed",
    "EventLog", "read_events", "read_outcomes", "read_fates", "mpi_errors",
]
