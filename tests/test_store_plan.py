"""The store's pure parts in one process: the chain of versions a rank keeps, and the fetch plan a
recovery derives from what every rank said it holds (the same answer on every rank)."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.recovery._fetch import newest, plan_fetch
from elastic.recovery._placement import Layout, plan
from elastic.recovery._versions import Version, VersionChain, newest_common


def _version(number: int) -> Version:
    return Version(number, Layout.of({0: "a"}), {0: 8}, {0: np.zeros(8, np.uint8)}, {})


def test_the_chain_keeps_the_newest_versions_and_says_which_one_a_commit_retires():
    chain = VersionChain(keep=3)
    assert chain.number is None and chain.retiring() is None
    versions = [_version(n) for n in range(5)]
    retired = []
    for v in versions:
        retired.append(chain.retiring())
        chain.push(v)
    # Fewer than three kept: nothing retires; then the oldest kept goes with each commit.
    assert retired == [None, None, None, versions[0], versions[1]]
    assert chain.number == 4 and chain.older == [3, 2]
    chain.fall_back(2)
    assert chain.number == 2 and chain.older == []
    with pytest.raises(ValueError, match="not kept"):
        chain.fall_back(1)
    one = VersionChain(keep=1)
    one.push(versions[0])
    assert one.retiring() is versions[0] and one.older == []  # keep=1: the current one's buffers go
    one.push(versions[1])
    assert one.number == 1 and one.retiring() is versions[1]
    chain.only(versions[4])  # a recovery keeps the current version alone
    assert chain.number == 4 and chain.older == []


def test_the_newest_version_every_rank_keeps_is_the_one_to_fall_back_to():
    assert newest_common([[4, 3], [4, 3], [3]]) == 3
    assert newest_common([[4, 3], [], [3]]) is None  # a replacement keeps none
    assert newest_common([]) is None


def _offers(n: int, version: int, replaced: set[int], removed: set[int], adopters: dict[int, list[int]]):
    """What each active rank of a job of ``n`` says after a failure: survivors hold ``version``
    whole (their own payloads, and those they adopted), a replacement holds nothing."""
    active = [r for r in range(n) if r not in removed]
    offers = [(None, False, ()) if r in replaced else (version, True, tuple(sorted([r, *adopters.get(r, [])])))
              for r in active]
    return active, offers


def test_a_fetch_plan_gives_each_replacement_its_own_and_each_removed_rank_to_an_adopter():
    layout = Layout.of({r: f"host{r // 2}" for r in range(6)})
    active, offers = _offers(6, 9, replaced={1}, removed={4, 5}, adopters={})
    assert newest(offers) == (9, 0)
    fetch = plan_fetch(layout, active, offers, 9)
    assert fetch.version == 9 and fetch.dead == (1, 4, 5) and fetch.live == {0, 2, 3}
    assert fetch.receiver == {1: 1, 4: 0, 5: 2}  # round-robin over the survivors that hold it
    adopted = plan_fetch(layout, active, offers, 9, adopt={4: 3, 5: 3})
    assert adopted.receiver == {1: 1, 4: 3, 5: 3}
    by_function = plan_fetch(layout, active, offers, 9, adopt=lambda removed, survivors: {o: survivors[-1]
                                                                                         for o in removed})
    assert by_function.receiver == {1: 1, 4: 3, 5: 3}
    # A survivor that already adopted a removed rank's state holds it whole: nothing to fetch for it.
    active, offers = _offers(6, 9, replaced=set(), removed={4}, adopters={0: [4]})
    assert plan_fetch(layout, active, offers, 9).dead == ()
    # Nobody holds a version: nothing to plan.
    assert newest([(None, False, ())] * 3) is None


@given(st.integers(2, 40), st.data())
@settings(max_examples=200, deadline=None)
def test_the_fetch_plan_is_the_same_on_every_rank_and_brings_back_exactly_what_nobody_holds_whole(n, data):
    hosts = data.draw(st.integers(1, n))
    layout = Layout.of({r: f"host{r % hosts}" for r in range(n)})
    lost = set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n - 1, unique=True)))
    removed = {r for r in lost if data.draw(st.booleans())}
    active, offers = _offers(n, 3, replaced=lost - removed, removed=removed, adopters={})
    fetch = plan_fetch(layout, active, offers, 3)
    assert set(fetch.dead) == lost and fetch.live == set(active) - lost
    assert all(fetch.receiver[o] == o for o in lost - removed)                          # its own
    assert all(fetch.receiver[o] in fetch.live for o in removed)                        # a survivor's
    assert fetch == plan_fetch(layout, list(active), list(offers), 3)                   # deterministic
    counts = [sum(1 for o in removed if fetch.receiver[o] == s) for s in sorted(fetch.live)]
    assert max(counts, default=0) - min(counts, default=0) <= 1                          # spread evenly


def test_a_fetch_plan_at_16k_ranks_is_linear_in_the_ranks():
    """One host of 8 lost in a job of 16,384: the plan and the pieces' plan, as every rank computes
    them. (Timed, not asserted: the figure is printed for the record.)"""
    n = 16384
    layout = Layout.of({r: f"host{r // 8}" for r in range(n)})
    lost = set(range(8, 16))
    active, offers = _offers(n, 5, replaced=lost, removed=set(), adopters={})
    t0 = time.perf_counter()
    fetch = plan_fetch(layout, active, offers, 5)
    chosen = plan(layout, fetch.dead, {o: 64 for o in fetch.dead}, 2, fetch.live)
    seconds = time.perf_counter() - t0
    assert set(fetch.dead) == lost and {p.owner for p in chosen.values()} == lost
    assert all(p.holder not in lost for p in chosen.values())
    print(f"plan_fetch + plan at {n} ranks: {seconds * 1e3:.1f} ms")
