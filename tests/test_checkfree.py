"""CheckFree(+) reconstruction and the stage-recovery policy, in one process."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic import ConfigError, Unrecoverable
from elastic.recovery import checkfree_average, plan_mesh_recovery, plan_stage_recovery, replica_holders


def test_average_weights_the_neighbour_with_the_larger_gradient_norm_more():
    before = {"w": np.full((2, 2), 1.0, np.float32), "b": np.zeros(2, np.float32)}
    after = {"w": np.full((2, 2), 4.0, np.float32), "b": np.ones(2, np.float32)}
    rebuilt = checkfree_average(before, after, norm_before=1.0, norm_after=2.0)
    assert rebuilt["w"].dtype == np.float32 and np.allclose(rebuilt["w"], 3.0) and np.allclose(rebuilt["b"], 2 / 3)
    with pytest.raises(ConfigError, match="same structure"):
        checkfree_average(before, {"w": after["w"]}, 1.0, 1.0)
    with pytest.raises(ConfigError, match="before clipping"):
        checkfree_average(before, after, 0.0, 1.0)


def test_replica_first_then_checkfree_then_checkfree_plus():
    replicas = {2: {5}}
    plan = plan_stage_recovery(6, {2}, replicas)
    assert [(p.method, p.sources) for p in plan] == [("replica", (5,))]
    plan = plan_stage_recovery(6, {3}, replicas)
    assert [(p.method, p.sources) for p in plan] == [("checkfree", (2, 4))]
    plan = plan_stage_recovery(6, {0, 5}, {}, checkfree_plus=True)
    assert [(p.stage, p.method, p.sources) for p in plan] == [(0, "checkfree+", (1,)), (5, "checkfree+", (4,))]


def test_what_checkfree_cannot_do_is_named():
    with pytest.raises(Unrecoverable, match="stage 2: a neighbouring stage was lost too.*stage 3: a neighbouring"):
        plan_stage_recovery(6, {2, 3}, {})
    with pytest.raises(Unrecoverable, match="stage 0: an end stage without a replica needs CheckFree"):
        plan_stage_recovery(6, {0}, {})
    # A replica of one of two consecutive stages brings both back: the replica first, then CheckFree.
    plan = plan_stage_recovery(6, {2, 3}, {2: {5}})
    assert [(p.stage, p.method, p.sources) for p in plan] == [(2, "replica", (5,)), (3, "checkfree", (2, 4))]
    with pytest.raises(Unrecoverable, match="stage 3"):
        plan_stage_recovery(6, {2, 3}, {2: {3}})  # the replica died with the other stage


def test_a_mesh_takes_a_lost_stage_from_a_live_twin_first_then_checkfree_then_says_what_it_cannot():
    # 2 replicas x 3 stages: logical rank = replica * 3 + stage.
    plan = plan_mesh_recovery(2, 3, {1})
    assert [(p.rank, p.stage, p.method, p.sources) for p in plan] == [(1, 1, "twin", (4,))]
    plan = plan_mesh_recovery(2, 3, {0, 4})  # a stage of each replica: both from their twins
    assert [(p.rank, p.method, p.sources) for p in plan] == [(0, "twin", (3,)), (4, "twin", (1,))]
    # Every replica of stage 1 gone: CheckFree from live neighbours, the same sources for both replicas,
    # so the rebuilt replicas are equal again.
    plan = plan_mesh_recovery(2, 3, {1, 4})
    assert [(p.rank, p.method, p.sources) for p in plan] == [(1, "checkfree", (0, 2)), (4, "checkfree", (0, 2))]
    plan = plan_mesh_recovery(2, 3, {1, 4, 0})  # a neighbour lost on one replica only still serves from its twin
    assert [(p.rank, p.method, p.sources) for p in plan] == [
        (0, "twin", (3,)), (1, "checkfree", (3, 2)), (4, "checkfree", (3, 2))]
    plan = plan_mesh_recovery(2, 3, {2, 5}, checkfree_plus=True)
    assert [(p.rank, p.method, p.sources) for p in plan] == [(2, "checkfree+", (1,)), (5, "checkfree+", (1,))]
    with pytest.raises(Unrecoverable, match=r"every data-parallel replica of stage\(s\) \[1, 2\] was lost.*stage 1: a "
                                            "neighbouring stage was lost too"):
        plan_mesh_recovery(2, 3, {1, 2, 4, 5}, checkfree_plus=True)
    # One replica is a pipeline: no twin, CheckFree as before.
    assert [(p.method, p.sources) for p in plan_mesh_recovery(1, 4, {2})] == [("checkfree", (1, 3))]


def test_a_mesh_policy_shrinks_whole_replicas_away_and_stops_before_replacing_a_loss_it_cannot_rebuild():
    from elastic.comm import RebuildContext
    from elastic.mesh import mesh_policy
    from elastic.recovery import Policy

    policy = mesh_policy(2, 3, base=Policy(modes=("spare", "shrink", "spawn")))

    def decide(lost, spares=0, gone=()):  # gone: logical ranks a shrink took earlier
        active = tuple(r for r in range(6) if r not in lost and r not in gone)
        return policy.decide(RebuildContext(len(lost), spares, len(active), lost_ranks=lost, active_ranks=active))

    assert decide((1,), spares=1).modes == ("spare",)
    one = decide((1,))  # replica 1 stays whole: replica 0 goes out of use
    assert one.modes == ("shrink",) and "replicas [0] go out of use, replicas [1] carry the global batch" in one.reason
    assert decide((1, 2), spares=1).modes == ("shrink",)  # never half replaced, half removed
    assert decide((1, 3), spares=1).modes == ("spare", "spawn")  # no replica left whole: replaced (twins)
    assert decide((1, 4)).modes == ("spawn",)  # replaced (CheckFree)
    doomed = decide((1, 2, 4, 5), spares=4)
    assert doomed.modes == () and "every data-parallel replica of stage(s) [1, 2] was lost" in doomed.reason
    # With copies in a store, only its recovery can tell which stages still have one: replaced.
    with_copies = mesh_policy(2, 3, base=Policy(modes=("spare", "shrink", "spawn")), copies=True)
    assert with_copies.decide(RebuildContext(4, 4, 2, lost_ranks=(1, 2, 4, 5), active_ranks=(0, 3))).modes == \
        ("spare",)
    # Replica 0 went out of use earlier: its ranks are no twins, so losing replica 1's stage 1 needs CheckFree.
    assert decide((4,), gone=(1,)).modes == ("spawn",)
    assert [(p.rank, p.method, p.sources) for p in plan_mesh_recovery(2, 3, {4}, dropped={0})] == [
        (4, "checkfree", (3, 5))]
    assert plan_mesh_recovery(2, 3, {0}, dropped={0}) == []  # an idle rank's replacement needs nothing


@settings(max_examples=50, deadline=None)
@given(dp=st.integers(1, 4), pp=st.integers(2, 6), data=st.data())
def test_a_mesh_plan_brings_every_lost_rank_back_from_live_ranks_or_names_the_stages(dp, pp, data):
    lost = data.draw(st.sets(st.integers(0, dp * pp - 1), min_size=1, max_size=dp * pp - 1))
    try:
        plan = plan_mesh_recovery(dp, pp, lost, checkfree_plus=True)
    except Unrecoverable as exc:
        gone = sorted({r % pp for r in lost if all(d * pp + r % pp in lost for d in range(dp))})
        assert f"stage(s) {gone}" in str(exc)
        return
    assert sorted(p.rank for p in plan) == sorted(lost)
    for p in plan:
        assert p.stage == p.rank % pp and not set(p.sources) & lost  # sources are live ranks
        twin_alive = any(d * pp + p.stage not in lost for d in range(dp))
        assert (p.method == "twin") == twin_alive
        if p.method == "twin":
            assert p.sources[0] % pp == p.stage
        else:  # the same sources for every replica of the stage
            assert {q.sources for q in plan if q.stage == p.stage} == {p.sources}


@settings(max_examples=30, deadline=None)
@given(stages=st.integers(2, 12))
def test_every_stage_has_one_replica_off_its_neighbours_where_possible(stages):
    holders = replica_holders(stages)
    assert sorted(holders) == list(range(stages))
    assert all(len(h) == 1 and s not in h for s, h in holders.items())
    assert sorted(h for hs in holders.values() for h in hs) == list(range(stages))  # each holds one
    if stages >= 4:
        assert all(abs(s - h) > 1 for s, hs in holders.items() for h in hs)
