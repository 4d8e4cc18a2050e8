"""Property tests of replica placement and the recovery plan (one process)."""
from __future__ import annotations

import collections
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.recovery import DataLost, place_replicas, plan_transfers


@st.composite
def jobs(draw):
    n = draw(st.integers(1, 12))
    hosts = draw(st.integers(1, n))
    ranks = list(range(n))
    domains = {r: f"host{draw(st.integers(0, hosts - 1))}" for r in ranks}
    replication = draw(st.integers(1, 4))
    chunks = {r: draw(st.integers(0, 6)) for r in ranks}
    return ranks, domains, replication, chunks


@given(jobs())
@settings(max_examples=300)
def test_every_chunk_on_r_distinct_ranks_and_as_many_domains_as_exist(job):
    ranks, domains, r, chunks = job
    placement = place_replicas(ranks, domains, r, chunks)
    assert set(placement) == {(o, c) for o in ranks for c in range(chunks[o])}
    n_domains = len(set(domains.values()))
    for (owner, _), holders in placement.items():
        assert holders[0] == owner
        assert len(set(holders)) == len(holders) == min(r, len(ranks))
        assert len({domains[h] for h in holders}) == min(len(holders), n_domains)
    assert placement == place_replicas(list(reversed(ranks)), domains, r, chunks)  # same on every rank


@given(jobs(), st.data())
@settings(max_examples=300)
def test_fewer_than_r_deaths_lose_nothing_and_the_plan_is_balanced(job, data):
    ranks, domains, r, chunks = job
    if len(ranks) < 2 or r < 2:
        return
    placement = place_replicas(ranks, domains, r, chunks)
    dead = set(data.draw(st.lists(st.sampled_from(ranks), max_size=min(r, len(ranks)) - 1, unique=True)))
    plan = plan_transfers(placement, dead)
    assert set(plan) == {chunk for chunk in placement if chunk[0] in dead}
    load = {s: 0 for s in ranks}
    for chunk, sender in plan.items():
        assert sender not in dead and sender in placement[chunk]
        load[sender] += 1
    # Optimal for unit chunks: no other choice of senders has a smaller largest load (brute force).
    options = [[h for h in placement[chunk] if h not in dead] for chunk in plan]
    if math.prod(map(len, options)) <= 5000:
        best = min((max(collections.Counter(choice).values(), default=0)
                    for choice in itertools.product(*options)), default=0)
        assert max(load.values()) == best


def test_one_owners_chunks_come_back_from_many_senders():
    ranks = list(range(8))
    placement = place_replicas(ranks, {r: f"h{r}" for r in ranks}, 2, {r: 14 for r in ranks})
    plan = plan_transfers(placement, {3})
    assert len(set(plan.values())) == 7  # every survivor sends two chunks, none sends all 14
    assert max(list(plan.values()).count(s) for s in set(plan.values())) == 2


def test_losing_every_holder_names_the_lost_chunks():
    ranks = list(range(4))
    placement = place_replicas(ranks, {r: "one-host" for r in ranks}, 2, {r: 3 for r in ranks})
    holders_of_0 = {placement[(0, c)][1] for c in range(3)}
    victim = sorted(holders_of_0)[0]
    with pytest.raises(DataLost) as info:
        plan_transfers(placement, {0, victim})
    lost_0 = [c for c in range(3) if placement[(0, c)][1] == victim]
    assert info.value.lost[0] == lost_0
    assert "logical rank 0" in str(info.value)


def test_single_domain_falls_back_to_distinct_ranks():
    placement = place_replicas([0, 1, 2], {0: "h", 1: "h", 2: "h"}, 3, {0: 1, 1: 1, 2: 1})
    assert all(sorted(h) == [0, 1, 2] for h in placement.values())
    with pytest.raises(ValueError):
        place_replicas([0], {0: "h"}, 0, {0: 1})
    assert list(itertools.chain(*placement.values())).count(0) == 3
