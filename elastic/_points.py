"""Recovery points: what a ``State`` keeps to come back to after a failure, one strategy each.

``EveryCommit``: the last ``commit()`` (a few steps back); the values every rank holds alike are
kept in each rank's own payload (never sent to a peer), the rank-unique ones replicated.
``EveryStep``: every optimizer step (``step_point``, before the update): the rank-unique values
are replicated at each step, and the shared values' point is the live values themselves.
``TwinSteps``: every step too, for sharded state held by twins (ranks that hold the same shard and
apply the same update to it): only the rank-unique values are replicated, a shard comes back
from a live twin.

Each answers what every strategy must: what a commit hands the store (``stored``), that a commit
made the values current (``committed``), the step point (``step_point``), and, after a restore,
bringing back what this rank lacks from the ranks that hold it (``bring_back``: the shared values
a replacement lacks; a shard from its twins, and when every twin of one died, every rank back to
the program's last commit). ``State`` calls the one it was made with and never asks which it is,
as the store does its ``Backing``; a per-step point is a stage of the step's end too (``_stages``).
Pick one with ``recovery_point``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from elastic.comm import ConfigError, Group, agreed
from elastic.recovery import Adopt, DataLost, ReplicatedStore, share, share_within

from ._capture import Capture, StepEnd

_LOG = logging.getLogger("elastic")

Store = Callable[[dict[str, np.ndarray]], None]  # commits the arrays as the next version (collective)


@dataclasses.dataclass(frozen=True)
class Into:
    """A State's side of ``bring_back`` (its own methods: a point never holds the State)."""

    values: Callable[[], Capture]                     # its values now (views of the live ones)
    restored: Callable[[], Capture]                   # its own values at the current version
    take: Callable[[Mapping[str, np.ndarray]], None]  # arrays into its live values: a roll-back, or another rank's
    commit: Store                                     # its rank-unique values as the next version (collective)


class RecoveryPoint(Protocol):
    why_no_roll_back: str | None  # a non-finite step cannot roll back past this point, and why

    def stored(self, capture: Capture) -> tuple[dict[str, np.ndarray], list[str]]:
        """What a commit hands the store: the arrays, and which of them stay in the own payload."""
        ...

    def committed(self, capture: Capture, program: bool) -> None:
        """A commit made ``capture`` a current version (``program``: the program's ``commit()``, not
        the job's start or end)."""
        ...

    def step_point(self, capture: Capture, commit: Store) -> None:
        """The recovery point of the step in flight (collective)."""
        ...

    def bring_back(self, world: Group, into: Into) -> None:
        """After a restore (a rebuild's or a roll-back's): what this rank lacks, from the ranks that
        hold it (collective; every rank ends with the job's values of the point)."""
        ...


class Twins(Protocol):
    """Which ranks hold the same shard (``elastic.mesh.Mesh``: the replicas of a stage)."""

    def holders(self, logical: int) -> list[int]:
        """The logical ranks that hold ``logical``'s shard, itself included."""
        ...


def give_shared(world: Group, lacking: Sequence[int], into: Into) -> None:
    """The values every rank holds alike, from the other active ranks to the logical ranks
    ``lacking`` (collective)."""
    got = share(world, None if int(world.logical_rank) in lacking else into.values().shared, lacking)
    if got is not None:
        into.take(got)


def _lacking(world: Group, holds: bool) -> list[int]:
    """The logical ranks that do not hold what ``holds`` says of this one (collective)."""
    return [int(r) for r, held in zip(world.logical_ranks, world.allgather(holds)) if not held]


class EveryCommit:
    """The last commit is the recovery point (``State(per_step=False)``, the default)."""

    why_no_roll_back: str | None = None

    def stored(self, capture: Capture) -> tuple[dict[str, np.ndarray], list[str]]:
        return dict(capture.arrays), list(capture.shared)

    def committed(self, capture: Capture, program: bool) -> None:
        pass  # the commit is the point: nothing kept beside it

    def step_point(self, capture: Capture, commit: Store) -> None:
        raise ConfigError("step_point() is the per-step recovery point: make the State with per_step=True "
                          "(or call commit(), the multi-step one)")

    def bring_back(self, world: Group, into: Into) -> None:
        # The shared values rolled back from the own payload, which lacks them on a replacement that has
        # not committed since it joined (they are never replicated): it gets them again, rather than keep
        # its live ones, which later steps changed. (A relaunch finds them in node memory.)
        lacking = _lacking(world, bool(into.restored().shared))
        if lacking:
            give_shared(world, lacking, into)


class EveryStep:
    """Every optimizer step is a recovery point (``State(per_step=True)``).

    The point comes after the step's last collective and before the values every rank holds
    alike change: every rank votes in the commit of its rank-unique values, and either every one
    goes on or none does. Between the point and ``record_step`` a step does only local work; a
    collective there is refused at ``record_step`` on every rank (this point is a stage of the
    step's end), since a failure inside it would leave the step half ended on some ranks."""

    why_no_roll_back: str | None = ("per_step=True keeps no copy of the values every rank holds alike to roll "
                                    "back to: use per_step=False to roll back past a non-finite step")

    def __init__(self, world: Group) -> None:
        if world.job.settings.node_store:
            raise ConfigError("per_step=True keeps the values every rank shares only in the processes' memory, "
                              "and a tier-2 relaunch (node_store) starts new ones: use per_step=False with "
                              "node_store (each commit then keeps them in node memory)")
        self._world = world
        self._holds = False    # this rank's live shared values are the job's (not on a fresh replacement)
        self._in_step = False  # between a step point and the step's end (record_step)
        self._calls = 0        # world.job.collectives right after the last step point

    def stored(self, capture: Capture) -> tuple[dict[str, np.ndarray], list[str]]:
        return capture.unique, []  # the live shared values are their recovery point

    def committed(self, capture: Capture, program: bool) -> None:
        self._holds, self._in_step = True, False

    def step_point(self, capture: Capture, commit: Store) -> None:
        if self._in_step:
            raise ConfigError("per_step: two step points without record_step() between them; end every step with "
                              "state.record_step(step) (it marks where the step's update is complete)")
        commit(capture.unique)
        self._in_step, self._calls = True, self._world.job.collectives

    def step_ended(self, end: StepEnd) -> None:
        if self._in_step and self._world.job.collectives != self._calls:
            raise agreed(ConfigError(  # every rank runs the same code: every rank stops here alike
                "per_step: a collective ran between the step point (optimizer.step()) and record_step(); a "
                "failure inside it would leave the step half ended on some ranks. Do the step's collectives "
                "(the loss all-reduce, logging) before optimizer.step(), or after record_step(), or use "
                "per_step=False"))
        self._in_step = False

    def bring_back(self, world: Group, into: Into) -> None:
        self._in_step = False  # the step in flight was abandoned: only local work was left of it
        lacking = _lacking(world, self._holds)
        if lacking:
            give_shared(world, lacking, into)
        self._holds = True


class TwinSteps(EveryStep):
    """Every optimizer step a recovery point, for sharded state held by twins
    (``State(per_step=True, twins=...)``): each shard lives on r ranks that receive the same
    reduced gradient bits and apply the same update (Megatron's partial distributed optimizer,
    torch's HSDP), so its values, ``twinned``, are never copied at a step point, only the
    rank-unique ones (the RNG states). A replacement gets its shard from its live twins, bitwise;
    with none left, every rank goes back to the program's last ``commit()`` (kept, every value, in
    a store of this point's own), or without one ``DataLost`` names the shard on every rank.

    The update of a shard is local work after the point, as ``EveryStep`` asks; the shards' all-gather
    (the model every rank computes with) belongs at the top of the next step, before its point: a
    failure inside it finds every survivor past the update already, and the step, redone, gathers again."""

    def __init__(self, world: Group, twins: Twins, commits: ReplicatedStore, adopt: Adopt | None) -> None:
        super().__init__(world)
        self._twins = twins
        self._commits = commits  # the program's commit()s, every value: the way back when every twin dies
        self._adopt = adopt
        self._holds_twin = False  # this rank's twinned values are its shard's (not on a fresh replacement)
        _say_shared_domains(world, twins)

    def committed(self, capture: Capture, program: bool) -> None:
        super().committed(capture, program)
        self._holds_twin = True
        if program:  # the job's start is none: losing every twin before the program commits is DataLost
            self._commits.commit(dict(capture.arrays), self._commits.version + 1 if self._commits.version is not None
                                 else 0, unreplicated=list(capture.shared))

    def bring_back(self, world: Group, into: Into) -> None:
        self._in_step = False
        # The store takes "the job committed, nobody holds a version" for data lost; the program may
        # never have committed (the State's own store holds the step points).
        if any(world.allgather(self._commits.version is not None)):
            self._commits.recover(adopt=self._adopt)
        ranks = [int(r) for r in world.logical_ranks]
        told = world.allgather((self._holds, self._holds_twin))
        lacking_twin = [r for r, (_, twin) in zip(ranks, told) if not twin]
        live = set(ranks) - set(lacking_twin)
        orphans = [r for r in lacking_twin if not live & set(self._twins.holders(r))]
        if orphans:  # every twin of some shard died: every rank back to the program's last commit, where a
            into.take(self._last_commit(world, orphans))  # replacement gets its shard from the store
            lacking_twin = []
        lacking = [r for r, (shared, _) in zip(ranks, told) if not shared]
        if lacking:  # (after a roll-back to the last commit: the survivors' shared values of it)
            give_shared(world, lacking, into)
        if lacking_twin:
            got = share_within(world, into.values().twin,
                               {r: [h for h in self._twins.holders(r) if h in live] for r in lacking_twin})
            if got is not None:
                into.take(got)
        self._holds = self._holds_twin = True
        if orphans:  # the per-step point again, where the job now is
            into.commit(into.values().unique)

    def _last_commit(self, world: Group, orphans: Sequence[int]) -> dict[str, np.ndarray]:
        """This rank's values at the program's last ``commit()``, every rank's way back when the
        twins of ``orphans`` all died; ``DataLost`` naming their shards on every rank without one."""
        if self._commits.version is None:  # every rank knows the same: every one raises alike
            world.events.emit("data_lost", lost={str(r): [] for r in orphans},
                              twins=[self._twins.holders(r) for r in orphans])
            held = "; ".join(f"logical rank {r}'s shard, held by logical ranks {self._twins.holders(r)}"
                             for r in orphans)
            raise agreed(DataLost({r: [] for r in orphans}, f"{held}: every twin died at once and no commit "
                                  "holds it"))
        world.events.emit("twins_lost", ranks=list(orphans), version=self._commits.version)
        return self._commits.restore()


def _say_shared_domains(world: Group, twins: Twins) -> None:
    """Warn (local, once per rank) when a twin of this rank's shard shares its failure domain (the
    job's ``domains``, else its host) in a job that spans several: that domain's loss takes the
    shard's every copy there. A job on one host has no other place for them."""
    me, names = int(world.logical_rank), world.job.settings.domains
    if names:
        domain_of = {r: names[r % len(names)] for r in range(world.job.initial_size)}
        spans, same = len(set(domain_of.values())) > 1, [h for h in twins.holders(me) if h != me
                                                         and domain_of[h] == domain_of[me]]
    else:
        peers = set(world.job.host_peers)
        spans, same = len(peers) < world.size, [h for h in twins.holders(me) if h != me and h in peers]
    if spans and same:
        world.events.emit("twins_colocated", twins=[me, *same])
        _LOG.warning("[elastic] logical rank %d and its twins %s share a failure domain: losing it loses their "
                     "shard's copies there. Place each instance on its own nodes (the mesh's replica r is logical "
                     "ranks r * n/R .. (r + 1) * n/R - 1: map ranks to nodes in blocks, e.g. mpirun --map-by "
                     "ppr:K:node)", me, same)


def recovery_point(world: Group, per_step: bool, twins: Twins | None = None,
                   store: Callable[[], ReplicatedStore] | None = None, adopt: Adopt | None = None) -> RecoveryPoint:
    """The strategy for ``State(per_step=..., twins=...)``; ``store`` makes a store like the State's,
    ``adopt`` is the State's (who takes a removed rank's values after a shrink)."""
    if not per_step:
        return EveryCommit()
    if twins is None:
        return EveryStep(world)
    assert store is not None
    return TwinSteps(world, twins, store(), adopt)
