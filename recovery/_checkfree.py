"""Getting a lost pipeline stage back: an exact replica, else CheckFree(+) from its neighbours (pure, no MPI).

CheckFree (Blagoev, Ersoy, Chen, "All is Not Lost: LLM Recovery without
Checkpoints", arXiv 2506.15461): an interior stage i that no replica holds is
re-initialised as the average of its neighbours weighted by their last
gradient L2 norms, W_i = (g_{i-1} W_{i-1} + g_{i+1} W_{i+1}) / (g_{i-1} + g_{i+1})
(the neighbour that has converged less counts more); the rebuilt stage then
trains with a fresh optimizer and its learning rate times 1.1. The norms must
be taken before gradient clipping, or the average degenerates to uniform.
CheckFree+ covers the first and last stages: trained half the time in swapped
order, stage 2 can stand in for stage 1 (and S-1 for S), so a lost end stage
is a copy of its swapped neighbour. Two consecutive lost stages cannot be
rebuilt this way: only a replica brings them back.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Collection, Mapping

import numpy as np

from elastic.comm import ConfigError, Unrecoverable

LR_BOOST = 1.1  # the paper's learning-rate factor for a CheckFree-rebuilt stage


class Method(str, enum.Enum):
    """How a lost stage comes back (a ``str``: events and reports carry its value)."""

    TWIN = "twin"                      # a live rank of the same stage in another data-parallel replica
    REPLICA = "replica"                # a copy of the stage kept elsewhere
    CHECKFREE = "checkfree"            # the average of its two neighbours, by their gradient norms
    CHECKFREE_PLUS = "checkfree+"      # an end stage: its swapped neighbour, and the end layer it kept


@dataclasses.dataclass(frozen=True)
class StageRecovery:
    """How one lost stage comes back: ``method`` is "replica", "checkfree" or "checkfree+";
    ``sources`` are the stages whose weights it is built from (the replica's holder for "replica")."""

    stage: int
    method: Method
    sources: tuple[int, ...]


def checkfree_average(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
                      norm_before: float, norm_after: float) -> dict[str, np.ndarray]:
    """CheckFree's weighted average of the two neighbouring stages' weights (local).

    Raises:
        ConfigError: the neighbours' tensors differ in names or shapes, or a norm is not positive and finite.
    """
    if set(before) != set(after) or any(before[k].shape != after[k].shape for k in before):
        raise ConfigError("CheckFree needs neighbouring stages of the same structure (names and shapes); "
                          "use a replica for this stage instead")
    if not all(np.isfinite(n) and n > 0 for n in (norm_before, norm_after)):
        raise ConfigError(f"gradient norms {norm_before}, {norm_after}: CheckFree needs positive finite norms, "
                          "taken before clipping")
    total = norm_before + norm_after
    return {k: ((norm_before * before[k].astype(np.float64) + norm_after * after[k].astype(np.float64)) / total)
            .astype(before[k].dtype) for k in before}


def plan_stage_recovery(stages: int, lost: set[int], replicas: Mapping[int, set[int]],
                        checkfree_plus: bool = False) -> list[StageRecovery]:
    """Decide, for each lost stage, replica first, then CheckFree(+) (local, deterministic).

    Args:
        stages: pipeline depth S (stages 0..S-1).
        lost: the stages whose weights died with their rank.
        replicas: stage -> the stages (ranks) that held an exact copy of it before the failure.
        checkfree_plus: the first and last stages were trained in swapped order half the time.

    Raises:
        Unrecoverable: naming every stage that no method can bring back, and why.
    """
    plan, problems = _plan_stages(stages, lost, replicas, checkfree_plus)
    if problems:
        raise Unrecoverable("cannot rebuild the pipeline without a replica: " + "; ".join(problems)
                            + "; keep replicas of these stages (replication >= 2)")
    return plan


def _plan_stages(stages: int, lost: set[int], replicas: Mapping[int, set[int]],
                 checkfree_plus: bool) -> tuple[list[StageRecovery], list[str]]:
    """``plan_stage_recovery``'s plan, and what it cannot bring back (a sentence per stage)."""
    plan: dict[int, StageRecovery] = {}
    for s in sorted(lost):
        live = sorted(set(replicas.get(s, ())) - lost)
        if live:
            plan[s] = StageRecovery(s, Method.REPLICA, (live[0],))
    def whole(t: int) -> bool:
        return t not in lost or t in plan

    # A stage rebuilt from a replica can serve its neighbours' CheckFree: repeat until nothing moves.
    progress = True
    while progress:
        progress = False
        for s in sorted(lost - set(plan)):
            if 0 < s < stages - 1 and whole(s - 1) and whole(s + 1):
                plan[s] = StageRecovery(s, Method.CHECKFREE, (s - 1, s + 1))
            elif s in (0, stages - 1) and stages > 2 and checkfree_plus and whole(1 if s == 0 else s - 1):
                plan[s] = StageRecovery(s, Method.CHECKFREE_PLUS, (1 if s == 0 else s - 1,))
            else:
                continue
            progress = True
    problems = []
    for s in sorted(lost - set(plan)):
        if s in (0, stages - 1) and not checkfree_plus:
            problems.append(f"stage {s}: an end stage without a replica needs CheckFree+ (swapped-order training)")
        else:
            problems.append(f"stage {s}: a neighbouring stage was lost too, and CheckFree cannot rebuild two "
                            "consecutive stages")
    return [plan[s] for s in sorted(plan)], problems


@dataclasses.dataclass(frozen=True)
class MeshRecovery:
    """How one lost rank of a data x pipeline mesh gets its stage back: ``method`` is "twin" (the
    exact state of a live rank of the same stage in another data-parallel replica), "checkfree" or
    "checkfree+" (every twin is gone: from the neighbouring stages); ``sources`` are logical ranks."""

    rank: int
    stage: int
    method: Method
    sources: tuple[int, ...]


def whole_replicas(dp: int, pp: int, present: Collection[int]) -> list[int]:
    """The replicas of a ``dp`` x ``pp`` mesh with a rank for every stage in ``present`` (logical
    ranks, a set or a mapping keyed by them), in order: those a shrink has not taken out of use."""
    return [d for d in range(dp) if all(d * pp + s in present for s in range(pp))]


def plan_mesh_recovery(dp: int, pp: int, lost: set[int], checkfree_plus: bool = False,
                       dropped: Collection[int] = ()) -> list[MeshRecovery]:
    """Decide, for each lost rank of a ``dp`` x ``pp`` mesh (logical rank = replica * pp + stage),
    how its stage comes back: a live twin first (exact), else CheckFree(+) from the neighbouring
    stages of live ranks, else ``Unrecoverable`` naming the stages (local, deterministic: every
    rank plans alike). Every replica of a stage rebuilt by CheckFree takes the same sources, so
    the replicas are equal again. ``dropped``: replicas out of use (a shrink took one of their
    ranks): their stages are stale, so they are no source, and their lost ranks need nothing.

    Raises:
        Unrecoverable: a stage lost on every replica that CheckFree cannot rebuild either.
    """
    lost = {r for r in lost if r // pp not in dropped}

    def live(stage: int) -> list[int]:
        return [d * pp + stage for d in range(dp) if d not in dropped and d * pp + stage not in lost]

    gone = {r % pp for r in lost if not live(r % pp)}
    stage_plan, problems = _plan_stages(pp, gone, {}, checkfree_plus)
    if problems:
        raise Unrecoverable(f"every data-parallel replica of stage(s) {sorted(gone)} was lost and CheckFree cannot "
                            f"rebuild them: {'; '.join(problems)}; run more replicas (--dp), or train the end stages "
                            "for CheckFree+")
    by_stage = {p.stage: p for p in stage_plan}
    plan = []
    for rank in sorted(lost):
        stage = rank % pp
        if stage not in gone:
            plan.append(MeshRecovery(rank, stage, Method.TWIN, (live(stage)[0],)))
        else:
            way = by_stage[stage]
            plan.append(MeshRecovery(rank, stage, way.method, tuple(live(t)[0] for t in way.sources)))
    return plan


def replica_holders(stages: int) -> dict[int, set[int]]:
    """One replica per stage, on a stage that is not its neighbour where the pipeline allows, each
    stage holding exactly one (a perfect matching in the non-adjacency graph, by networkx).

    A lost stage then keeps both ways back: its replica, and CheckFree from its neighbours.
    """
    import networkx as nx  # here, not at import: every process of a job imports this package, few plan pipelines

    if stages < 2:
        raise ConfigError("a pipeline of one stage has nowhere to keep a replica")
    candidates = nx.Graph()
    rows = [("stage", s) for s in range(stages)]
    candidates.add_nodes_from(rows)
    far = [(s, h) for s in range(stages) for h in range(stages) if abs(s - h) > 1]
    near = [(s, h) for s in range(stages) for h in range(stages) if abs(s - h) == 1]
    for s, h in far:
        candidates.add_edge(("stage", s), ("holder", h))
    matching = nx.bipartite.maximum_matching(candidates, top_nodes=rows) if far else {}
    holders = {s: {matching[("stage", s)][1]} for s in range(stages) if ("stage", s) in matching}
    if len(holders) < stages:  # short pipelines: neighbours have to do
        for s, h in near:
            candidates.add_edge(("stage", s), ("holder", h))
        matching = nx.bipartite.maximum_matching(candidates, top_nodes=rows)
        holders = {s: {matching[("stage", s)][1]} for s in range(stages)}
    return holders
