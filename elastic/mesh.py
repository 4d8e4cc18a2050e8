"""Data x pipeline parallelism over the World: ``dp`` replicas of a ``pp``-stage pipeline.

Logical rank ``r`` holds stage ``r % pp`` of replica ``r // pp`` (the stage
index fastest: stage ``s`` lives on logical ranks ``s, s + pp, s + 2 pp, ...``).
A substitution (spare, spawn) keeps every logical rank's coordinates, and the
groups are computed from the current world (once per generation), so a
rebuild leaves no bookkeeping to the program. Loop with
``elastic.pipeline.roll_forward`` (a step lands on every rank or on none) and
bring lost stages back with ``StageRebuild(..., replicas=dp)``: from a live
twin, exact; from the store's last commit where no twin lives (``commit_every``:
every rank rolls back, exact); CheckFree(+) when no copy is left either;
``Unrecoverable`` naming the stages when not even that can rebuild them
(``elastic.recovery.plan_mesh_recovery``).

A shrink takes the lost ranks' replicas out of use for good: the replicas
left carry the whole global batch (``Mesh.shard``), and the surviving ranks
of a replica out of use idle (they take part in the loop's votes and in the
world's collectives, nothing else). The rebuild policy (``mesh_policy``, for
``elastic.init``) shrinks only where a whole replica stays in use, replaces
every lost rank or none, and stops the job at once, naming the stages, when
the dead took a stage that nothing can bring back: no replacement is started
for nothing.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from elastic.comm import ConfigError, Decision, Group, RebuildContext, RebuildPolicy, Unrecoverable, agreed
from elastic.comm.runtime import fill
from elastic.recovery import Policy, plan_mesh_recovery, whole_replicas

__all__ = ["Mesh", "mesh_policy", "without_shrink"]
_TAG = 700  # the twins' gradient exchange (the pipeline's own messages use other tags)


class Mesh:
    """Where this rank sits in a ``dp`` x ``pp`` mesh, and the collectives of its groups. Create on every active rank.

    Raises:
        ConfigError: the job's size is not ``dp * pp``.
    """

    def __init__(self, world: Group, dp: int, pp: int) -> None:
        size = world.job.initial_size
        if dp < 1 or pp < 1 or dp * pp != size:  # the same facts on every rank: every rank stops alike
            raise agreed(ConfigError(
                f"a {dp} x {pp} mesh (data x pipeline) needs {dp * pp} ranks and the job has {size}: launch with "
                f"-n {max(dp, 1) * max(pp, 1)}, or choose dp and pp with dp * pp = {size}"))
        self.world, self.dp, self.pp = world, dp, pp
        self._where: tuple[int, dict[int, int], list[int]] = (-1, {}, [])  # generation, logical -> current, in use

    @property
    def replica(self) -> int:
        return int(self.world.logical_rank) // self.pp

    @property
    def stage(self) -> int:
        return int(self.world.logical_rank) % self.pp

    def rank_of(self, replica: int, stage: int) -> int:
        """The current rank holding ``stage`` of ``replica`` (local; O(1))."""
        return self._generation()[1][replica * self.pp + stage]

    def _generation(self) -> tuple[int, dict[int, int], list[int]]:
        """This generation's logical -> current rank table and replicas in use, made once per generation."""
        if self._where[0] != self.world.generation:
            where = {int(logical): rank for rank, logical in enumerate(self.world.logical_ranks)}
            self._where = (self.world.generation, where, whole_replicas(self.dp, self.pp, where))
        return self._where

    @property
    def in_use(self) -> list[int]:
        """The replicas that train: those with a rank for every stage (local; a copy)."""
        return list(self._generation()[2])

    @property
    def working(self) -> bool:
        """This rank's replica trains (else a shrink took part of it: this rank idles)."""
        return self.replica in self.in_use

    def shard(self, batch: np.ndarray) -> np.ndarray:
        """This replica's part of a global batch, split among the replicas in use (local)."""
        in_use = self.in_use
        return np.array_split(batch, len(in_use))[in_use.index(self.replica)]

    def stage_hosts(self) -> dict[int, int]:
        """Stage -> current rank, along this rank's replica: its pipeline (local; a working rank's)."""
        return {s: self.rank_of(self.replica, s) for s in range(self.pp)}

    def twins(self) -> list[int]:
        """The current ranks holding this rank's stage in the replicas in use, in replica order (local)."""
        return [self.rank_of(d, self.stage) for d in self.in_use]

    def holders(self, logical: int) -> list[int]:
        """The logical ranks that hold ``logical``'s stage, one per replica, in use or not (local):
        its twins, for ``State(twins=mesh)``."""
        stage = logical % self.pp
        return [replica * self.pp + stage for replica in range(self.dp)]

    def allreduce_stage(self, arrays: list[np.ndarray], step: int | None = None) -> None:
        """Sum each array over this stage's replicas, in place (collective over the twins; every
        rank of the mesh calls it at the same point of its step). The sum is taken in replica order
        on every twin, so the twins stay bitwise equal (what a twin's recovery relies on). Each
        twin sends its arrays to each other twin: fine for the few replicas of a mesh on this
        scale, O(dp) per rank. A ``collective`` fault of ``step`` fires in flight. Working ranks
        only (an idle one has no twins to sum with)."""
        if not self.working:
            raise ConfigError("Mesh.allreduce_stage on a rank whose replica is out of use (after a shrink): "
                              "only working ranks (mesh.working) compute and sum their stage's gradients")
        if len(self.in_use) == 1:
            return
        if len({a.dtype for a in arrays}) > 1 or not all(a.flags.c_contiguous and a.flags.writeable for a in arrays):
            raise ConfigError("Mesh.allreduce_stage takes writable contiguous arrays of one dtype (a stage's "
                              "gradients as numpy views: [p.grad.numpy() for p in stage.parameters()])")
        flat = np.concatenate([a.reshape(-1) for a in arrays])
        twins, me = self.twins(), int(self.world.rank)
        got = {r: np.empty_like(flat) for r in twins if r != me}
        self.world.neighbors([(r, _TAG, flat) for r in got], [(r, _TAG, buf) for r, buf in got.items()], step)
        total = np.zeros_like(flat)
        for r in twins:
            total += flat if r == me else got[r]
        offset = 0
        for a in arrays:
            a.reshape(-1)[:] = total[offset:offset + a.size]
            offset += a.size


@dataclasses.dataclass(frozen=True)
class _MeshPolicy:
    """``base``'s decision where a mesh can take it; an empty one (the job stops, every process
    alike, with the plan's reason) for a loss it cannot."""

    base: Policy
    dp: int
    stages: int | None  # None: the job's initial size over dp
    checkfree_plus: bool
    copies: bool

    def decide(self, context: RebuildContext) -> Decision:
        pp = self.stages or context.initial_size // self.dp
        survivors, lost = set(context.active_ranks), set(context.lost_ranks)
        dropped = set(range(self.dp)) - set(whole_replicas(self.dp, pp, survivors | lost))  # an earlier shrink
        whole = whole_replicas(self.dp, pp, survivors)
        decision = (self.base if whole else without_shrink(self.base)).decide(context)
        if not whole and self.copies and _leaves_some(decision, context):  # the spares cannot replace every
            completed = self._completed(context, pp)  # lost rank: the replicas they make whole, the others out of use
            if completed is not None:
                return completed
        if "shrink" in decision.modes:  # all lost ranks' replicas go out of use, none half replaced
            return Decision(("shrink",), f"{decision.reason}; replicas {sorted({r // pp for r in lost})} go out "
                                         f"of use, replicas {whole} carry the global batch")
        try:
            plan_mesh_recovery(self.dp, pp, lost, self.checkfree_plus, dropped)
        except Unrecoverable as exc:
            if not self.copies:  # with copies in a store, only its recovery can tell
                return Decision((), str(exc))
        return decision


    def _completed(self, context: RebuildContext, pp: int) -> Decision | None:
        """With no whole replica among the survivors and no way to replace every lost rank: the
        base decision's spares, filling the lowest lost ranks, and a shrink of the rest, where that
        leaves a whole replica in use; None where it does not. With ``copies`` only: a replaced
        rank's state then comes from the State (its store, or a twin's shard, ``State(twins=)``),
        not from a plan of stages this policy can check."""
        decision = self.base.decide(context)
        plan = fill(decision.modes, sorted(context.lost_ranks), context.spares)
        replaced = {r for mode, take in plan if mode != "shrink" for r in take}
        whole = whole_replicas(self.dp, pp, set(context.active_ranks) | replaced)
        if not whole or _leaves_some(decision, context):
            return None
        return Decision(decision.modes, f"{decision.reason}; replicas {whole} whole again carry the global batch, "
                                        "the others go out of use")


def _leaves_some(decision: Decision, context: RebuildContext) -> bool:
    """``decision`` cannot give every lost rank a place (the fill rule, as the rebuild applies it)."""
    taken = {r for _, take in fill(decision.modes, context.lost_ranks, context.spares) for r in take}
    return bool(set(context.lost_ranks) - taken)


def mesh_policy(dp: int, pp: int | None = None, base: Policy | None = None, checkfree_plus: bool = False,
                copies: bool = False) -> RebuildPolicy:
    """The rebuild policy of a ``dp`` x ``pp`` mesh (``pp`` None: the job's size over ``dp``, for a
    program that learns its size from ``elastic.init``): ``base`` (default: the launcher's,
    ``Policy.from_env()``), shrinking only where a whole replica stays in use and then every lost
    rank's replica out of use (never a replica half replaced, half removed), and a stop before
    any replacement is started when the ranks lost in one rebuild took every replica of a stage
    that CheckFree cannot rebuild, unless ``copies`` (the stages are committed to a store too,
    ``StageRebuild(commit_every=...)``, or a ``State`` brings each rank's state back, its twins'
    shards with it, ``State(twins=mesh)``: which of them still have a copy only that recovery
    tells, after the replacements). With ``copies``, when no replica is whole among the survivors
    and the modes cannot replace every lost rank, the spares make what replicas they can whole
    and the others go out of use. (A failure during an earlier rebuild's copy adds its lost
    stages to the next rebuild's plan, which ``StageRebuild`` then finds impossible, after the
    replacements: the same error.)"""
    return _MeshPolicy(base if base is not None else Policy.from_env(), dp, pp, checkfree_plus, copies)


def without_shrink(policy: Policy) -> Policy:
    """``policy`` with shrinking taken out (a mesh, or a pipeline rebuilt without copies, needs a new
    process in a lost rank's place): spare first, then spawn, as the policy orders them."""
    modes = tuple(m for m in policy.modes if m != "shrink") or ("spare", "spawn")
    return dataclasses.replace(policy, modes=modes)
