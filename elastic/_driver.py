"""One recovery loop for every kind of job: a driver, and the step policies it drives.

``drive`` runs a ``StepPolicy`` until it ends: on ``ProcessFailure`` (or a data plane's peer
failure) it lets the data planes go, rebuilds the world and hands the rebuild to the policy,
which brings its state back at the top of the next round; on ``NonFinite`` it asks the policy to
roll back. ``max_failures`` (failures in a row without a completed recovery point) holds for
every policy alike. ``elastic.run`` is the ``State`` policy (save / restore / sync / reset);
``elastic.pipeline.roll_forward`` the pipeline's (a vote before each update).
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Protocol, TypeVar

from elastic.comm import Outlook, ProcessFailure, Rebuild, Recoverable, Role, Unrecoverable, agreed

from ._integrity import NonFinite

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
# Data planes besides MPI (elastic.distributed): how each tells a peer's death from other errors,
# and how it lets go of its collectives so that no rank waits in one while the others rebuild.
_DATA_PLANES: list[tuple[Callable[[BaseException], bool], Callable[[], None]]] = []


def register_data_plane(is_peer_failure: Callable[[BaseException], bool], abort: Callable[[], None]) -> None:
    _DATA_PLANES.append((is_peer_failure, abort))


class StepPolicy(Protocol, Generic[T_co]):
    """What ``drive`` drives: how a job brings its state back and runs its steps."""

    @property
    def outlook(self) -> Outlook:
        """The loop's view ahead, for the rebuild policy (local)."""
        ...

    def restore(self, rebuild: Rebuild | None) -> None:
        """After a rebuild (``world.last_rebuild``, which a replacement joined by): bring the state
        back, every rank alike (collective)."""
        ...

    def steps(self) -> T_co:
        """Run the steps to the end, then ``world.finish()`` (collective); what the job returns."""
        ...

    def roll_back(self, error: NonFinite) -> None:
        """After ``NonFinite`` (agreed): every rank back to a good point, or an agreed stop."""
        ...

    def failed(self, rebuild: Rebuild) -> None:
        """A rebuild happened (local): what it lost."""
        ...


def drive(world: Recoverable, policy: StepPolicy[T]) -> T:
    """Run ``policy`` until its steps end, through every failure the job can survive (collective)."""
    reset = world.role is Role.RECOVERED
    non_finite: NonFinite | None = None  # to roll back from, at the top of the next round
    while True:
        try:
            if reset:
                policy.restore(world.last_rebuild)
                reset = False
            elif non_finite is not None:  # here, so that a failure inside a roll-back is one like any other
                error, non_finite = non_finite, None
                policy.roll_back(error)
            return policy.steps()
        except NonFinite as exc:  # agreed: the same on every rank; nothing to rebuild
            non_finite = exc
        except Exception as exc:
            if not peer_failed(exc):
                raise
            for _, abort in _DATA_PLANES:
                abort()
            policy.failed(world.recover(policy.outlook))
            reset = True


def peer_failed(exc: BaseException) -> bool:
    """``exc``, or an error it was raised from or while handling, is a peer's failure (local):
    torch's pipeline stages raise their own ``RuntimeError`` from what failed in a forward or backward."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, ProcessFailure) or any(failed(error) for failed, _ in _DATA_PLANES):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def check_streak(rebuild: Rebuild | None, in_a_row: int, limit: int) -> None:
    """Stop when ``in_a_row`` failures came without a completed recovery point between them (more
    than ``limit``). The counts come with the rebuild's agreed summary, so every process, a
    promoted spare or a spawned one too, stops alike."""
    if rebuild is None or in_a_row <= limit:
        return
    causes = "; ".join(f"logical rank {c.get('logical')}: {c['what']}" for c in rebuild.causes)
    raise agreed(Unrecoverable(
        f"{in_a_row} failures in a row without a successful commit (max_failures={limit}); last failure: "
        f"logical ranks {sorted(map(int, rebuild.failed))}" + (f" ({causes})" if causes else "")))


def never_non_finite(error: NonFinite) -> Any:
    """A policy with no integrity gate cannot see ``NonFinite``: let it through."""
    raise error
