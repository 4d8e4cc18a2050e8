"""elastic.comm: a ULFM communicator that survives the loss of processes.

Errors are translated in one place (``ProcessFailure`` means: call
``World.recover()``; ``Unrecoverable`` means: stop). ``World.recover()``
revokes, agrees on the failed set, and rebuilds as the job's ``RebuildPolicy``
decides (spare, spawn, shrink); logical ranks keep their meaning throughout.
``Config`` holds comm's ``ELASTIC_*`` settings; the layers above compute through a ``Group``
and recover through a ``Recoverable`` (``World`` is both).

Importing this package does not initialize MPI: ``World``, ``init`` and the
ULFM helpers load ``mpi4py.MPI`` on first use.
"""
from typing import TYPE_CHECKING

from ._config import Config
from ._errors import ConfigError, ElasticError, ProcessFailure, UlfmUnavailable, Unrecoverable, agreed
from ._group import Group, Recoverable, Settings
from ._lazy import lazy_exports
from ._lifecycle import Lifecycle as _Lifecycle  # noqa: F401  (registers the exit path early: see there)
from ._policy import Decision, FixedOrder as FixedOrder, Outlook, RebuildContext, RebuildPolicy
from ._ranks import CurrentRank, LogicalRank, Role

if TYPE_CHECKING:
    from ._join import init
    from ._rebuild import Rebuild
    from ._world import World

__getattr__, __dir__ = lazy_exports(globals(), {
    "init": "._join", "World": "._world", "Rebuild": "._rebuild",
})

# What the job wrote down is read through ``elastic.comm.events`` (read_events, read_outcomes, ...), fault
# schedules through ``elastic.comm.faults`` (parse_schedule, Injection).
__all__ = [
    "init", "World", "Rebuild", "Config", "Role", "LogicalRank", "CurrentRank",
    "RebuildPolicy", "RebuildContext", "Decision", "Outlook",
    "ElasticError", "ProcessFailure", "Unrecoverable", "UlfmUnavailable", "ConfigError", "agreed", "Group", "Settings",
    "Recoverable",
]
# Importable, not starred: FixedOrder (the low-level init's default policy; elastic.init uses elastic.recovery.Policy).
