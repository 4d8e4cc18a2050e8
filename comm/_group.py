"""The contract between comm and the layers above: what they may know and call of the job.

The store, the step clock, the stage rebuild and the data sampler take a
``Group``; the loops that recover (``elastic.run``, ``roll_forward``, ``State``)
a ``Recoverable`` (a ``Group`` that also recovers, finishes, interrupts and
fails); never a ``World``. A ``Group`` is: identity (who this rank is now), agreed
calls (the outcome is the same on every active rank, or ``ProcessFailure``
everywhere), the data plane, fault points and the event log, and ``job``: the
few facts of the job the layers above need (its first size, its settings, was
anything committed, is the job over), and ``environ``: the environment the launcher gave
the process, where the layers above read their own settings.
``World`` implements it; anything that does (a simulated job in a test) can
stand in for it. Membership tables, the lifecycle, the communicators and the
rest of the configuration stay behind it: of the settings, the layers above see
``Settings``, the few they act on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, NoReturn, Protocol, Sequence

from ._errors import Unrecoverable, agreed
from ._ranks import CurrentRank, LogicalRank, Role
from .faults import Injection

if TYPE_CHECKING:
    import numpy as np

    from ._policy import Decision, Outlook
    from ._rebuild import Rebuild


class Settings(Protocol):
    """The settings the layers above comm act on: ``Config``'s fields of the same names, read-only.
    (The training layer's own settings travel in ``Job.environ`` and are read by its own table.)"""

    @property
    def node_store(self) -> str | None: ...      # the store keeps its versions in node memory here (tier 2)
    @property
    def domains(self) -> tuple[str, ...]: ...    # failure domain of each logical rank, instead of the hosts
    @property
    def faults_scheduled(self) -> bool: ...      # fault points inside torch's collectives too


class EventSink(Protocol):
    def emit(self, event: str, **fields: Any) -> None: ...


class Job(Protocol):
    """The job as a rank knows it (local, no communication). ``rebuild_decision``: what the job's
    own rebuild policy would decide if the logical ranks ``lost`` died now, its modes kept only
    where the fill rule places every one of them (``would_fill``): the one rule for "can this
    place be filled", asked before a live rank is evicted."""

    @property
    def initial_size(self) -> int: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def environ(self) -> Mapping[str, str]: ...
    @property
    def alone(self) -> bool: ...
    @property
    def step(self) -> int | None: ...
    @property
    def host_peers(self) -> list[int]: ...
    @property
    def first_survivor(self) -> CurrentRank: ...
    @property
    def committed(self) -> bool: ...
    def note_commit(self) -> None: ...
    @property
    def collectives(self) -> int: ...
    @property
    def waited(self) -> float: ...
    @property
    def spares(self) -> int: ...
    def data_fault(self, action: str) -> Injection | None: ...
    def rebuild_decision(self, lost: Sequence[int], outlook: Outlook) -> Decision: ...
    @property
    def ended(self) -> bool: ...
    @property
    def local_rank(self) -> int: ...


class Group(Protocol):
    # ----------------------------------------------------------- identity (local)
    @property
    def rank(self) -> CurrentRank: ...
    @property
    def size(self) -> int: ...
    @property
    def logical_rank(self) -> LogicalRank: ...
    @property
    def logical_ranks(self) -> tuple[LogicalRank, ...]: ...
    @property
    def generation(self) -> int: ...
    @property
    def role(self) -> Role: ...
    @property
    def last_rebuild(self) -> Rebuild | None: ...

    # ------------------------------------------------ agreed calls (collective)
    def vote(self, ok: bool, why: str = ...) -> None: ...
    def agree_equal(self, value: int, ok: bool = ...) -> bool: ...
    def allgather(self, obj: Any) -> list[Any]: ...
    def bcast(self, obj: Any, root: int) -> Any: ...
    def alltoall(self, objs: Mapping[int, Any]) -> list[Any]: ...

    # ---------------------------------------------------- data plane (collective)
    def exchange(self, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[np.ndarray]],
                 point: str = ..., step: int | None = ..., known: bool = ...) -> int: ...
    def allreduce(self, arrays: list[np.ndarray], step: int | None = ...) -> None: ...
    def neighbors(self, sends: list[tuple[int, int, np.ndarray]], receives: list[tuple[int, int, np.ndarray]],
                  step: int | None = ...) -> None: ...

    # ------------------------------------------------------ faults, record, the job
    def fault_point(self, step: int | None, point: str = ..., *, implied: bool = ...,
                    micro: int | None = ...) -> None: ...
    @property
    def events(self) -> EventSink: ...
    @property
    def job(self) -> Job: ...


class Recoverable(Group, Protocol):
    """What a recovery loop drives beside the ``Group`` (``elastic.run``, ``roll_forward``, ``State``'s
    fencing and evictions): ``World`` implements it, and so does a simulated rank."""

    def recover(self, outlook: Outlook | None = ...) -> Rebuild:
        """Rebuild after a ``ProcessFailure`` (collective over every survivor)."""
        ...

    def finish(self) -> None:
        """End the job cleanly (collective over the active ranks); ``ProcessFailure`` everywhere alike."""
        ...

    def interrupt(self) -> None:
        """Every peer leaves what it waits for in this generation with ``ProcessFailure`` (local)."""
        ...

    def fail(self, kind: str, message: str) -> NoReturn:
        """This process fails alone, now, recorded as ``kind``: the others recover (local)."""
        ...


def first_survivor(group: Group) -> CurrentRank:
    """The lowest current rank of ``group`` that lived through its last rebuild: a safe root to
    resync from (local; the same on every rank). What a ``Job``'s ``first_survivor`` gives."""
    new = group.last_rebuild.replaced if group.last_rebuild else frozenset()
    for current, logical in enumerate(group.logical_ranks):
        if logical not in new:
            return CurrentRank(current)
    raise agreed(Unrecoverable("no active rank survived: every holder of the job's state is gone"))
