"""Parity groups and the XOR / Reed-Solomon code (issue 55, its pure part): every loss pattern of
small groups rebuilt bit for bit, the code's matrix MDS, groups one member per failure domain."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from elastic.comm import ConfigError
from elastic.recovery._parity import Code, Redundancy, _solve, coefficients, group_of
from elastic.recovery._placement import Layout

SHAPES = [(2, 1), (3, 1), (4, 1), (5, 1), (8, 1), (3, 2), (4, 2), (5, 2), (6, 3)]


def payloads(k: int, seed: int) -> list[np.ndarray]:
    """Uneven payloads of several dtypes, NaN payloads and -0.0 among the floats, one empty."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = [np.array([np.nan, -0.0, np.inf], dtype=np.float64)]
    out[0].view(np.uint64)[0] |= 0x1234  # a NaN with a payload: only its bytes say which
    out.append(np.zeros(0, dtype=np.float32))
    while len(out) < k:
        out.append(rng.integers(-2**31, 2**31, rng.integers(1, 300), dtype=np.int32))
    return out[:k]


@pytest.mark.parametrize("k, m", SHAPES)
def test_every_pattern_of_up_to_m_losses_rebuilds_each_lost_payload_bit_for_bit(k, m):
    data = payloads(k, seed=k * 10 + m)
    code = Code(k, m, max(p.nbytes for p in data))
    segments = {i: code.segments(p) for i, p in enumerate(data)}
    parity = {i: code.parity(i, segments) for i in range(k)}
    for count in range(1, m + 1):
        for lost in itertools.combinations(range(k), count):
            alive = [i for i in range(k) if i not in lost]
            rebuilt = code.rebuild(lost, {i: segments[i] for i in alive}, {i: parity[i] for i in alive})
            assert sorted(rebuilt) == list(lost)
            for i in lost:
                raw = rebuilt[i].reshape(-1)[:data[i].nbytes]
                assert raw.tobytes() == data[i].tobytes(), (k, m, lost, i)
                # the replacement's own parity, recomputed from what it and the others now hold
                again = {**{j: segments[j] for j in alive}, **rebuilt}
                assert np.array_equal(code.parity(i, again), parity[i])


def test_no_member_holds_parity_of_its_own_data_and_parity_is_m_over_k_minus_m_of_a_payload():
    for k, m in SHAPES:
        code = Code(k, m, 1000)
        for member in range(k):
            for c, _ in code.parity_of(member):
                assert member not in {owner for owner, _ in code.data_blocks(c)}
                assert member in code.parity_members(c)
        # each member's segments are used once each, over the K codewords
        used = sorted((owner, s) for c in range(k) for owner, s in code.data_blocks(c))
        assert used == sorted((i, s) for i in range(k) for s in range(k - m))
        assert code.parity(0, {i: code.segments(np.zeros(1000, np.uint8)) for i in range(k)}).nbytes == \
            m * code.segment and code.segment * (k - m) >= 1000


def test_more_losses_than_the_group_survives_is_refused():
    code = Code(4, 1, 64)
    with pytest.raises(ValueError, match="2 members lost in a group that survives 1"):
        code.rebuild([0, 1], {}, {})


@pytest.mark.parametrize("data, m", [(d, m) for m in (1, 2, 3) for d in range(1, 9)])
def test_every_square_submatrix_of_the_generator_is_invertible(data, m):
    """[I; C]: any K-M of its K rows solve (what makes any M losses decodable)."""
    rows = [[int(t == u) for u in range(data)] for t in range(data)] + [list(r) for r in coefficients(data, m)]
    assert all(v == 1 for v in coefficients(data, m)[0])  # parity 0 is the XOR
    for chosen in itertools.combinations(range(data + m), data):
        inverse = _solve([rows[r] for r in chosen])  # raises (no pivot) where singular
        assert len(inverse) == data


def test_the_redundancy_setting_parses_and_says_what_to_write():
    assert Redundancy.parse("copies:2") == Redundancy("copies", 2)
    assert Redundancy.parse("xor:4") == Redundancy("xor", 1, 4, 1)
    assert Redundancy.parse("rs:4+2") == Redundancy("rs", 1, 4, 2) and str(Redundancy.parse(" rs:4+2 ")) == "rs:4+2"
    assert not Redundancy.parse("copies:3").parity and Redundancy.parse("xor:8").parity
    for bad in ("xor", "xor:1", "rs:2+2", "rs:4", "copies:0", "parity:4", "rs:250+10"):
        with pytest.raises(ConfigError, match="redundancy|parity group|copies:R"):
            Redundancy.parse(bad)


@pytest.mark.parametrize("nodes, per, k", [(10, 4, 4), (4, 8, 4), (9, 2, 8), (3, 5, 4), (1, 6, 4), (6, 1, 3)])
def test_groups_partition_the_ranks_one_member_per_domain_where_the_domains_allow(nodes, per, k):
    layout = Layout.of({r: f"node{r // per}" for r in range(nodes * per)})
    groups = {group_of(layout, r, k) for r in layout.ranks}
    assert sorted(r for g in groups for r in g) == list(layout.ranks)  # each rank in one group
    for g in groups:
        assert all(group_of(layout, r, k) == g for r in g)  # every member computes the same group
        assert len(g) >= min(k, len(layout.ranks)) and len(g) < 2 * k
        if nodes >= 2 * k - 1:
            assert len({r // per for r in g}) == len(g), g  # distinct nodes


def test_uneven_domains_still_give_every_rank_one_group():
    sizes = [5, 1, 3, 2, 4]
    domain_of, r = {}, 0
    for d, s in enumerate(sizes):
        for _ in range(s):
            domain_of[r] = f"n{d}"
            r += 1
    layout = Layout.of(domain_of)
    groups = {group_of(layout, r, 3) for r in layout.ranks}
    assert sorted(r for g in groups for r in g) == list(layout.ranks)
    assert all(all(group_of(layout, r, 3) == g for r in g) for g in groups)


def test_a_rank_finds_its_group_at_16k_ranks_without_a_table():
    layout = Layout.of({r: f"node{r // 8}" for r in range(16384)})
    group = group_of(layout, 12345, 4)
    assert 12345 in group and len({r // 8 for r in group}) == 4  # four nodes, one member each


def test_isa_l_and_numpy_multiply_alike_and_the_wheel_brings_isa_l_where_it_ships(monkeypatch):
    """The GF(2^8) multiple-and-add through ISA-L (the pyeclib wheel's library) and through numpy's
    table give the same bytes, for every coefficient and odd lengths; a rebuild with either is the
    same; where the wheel installs (Linux x86_64: setup.cfg), ISA-L is what runs."""
    import platform

    from elastic.recovery import _parity

    if platform.system() == "Linux" and platform.machine() == "x86_64":
        assert _parity.encoder() == "isa-l"
    rng = np.random.default_rng(3)
    for n in (1, 7, 8, 13, 4099):
        block = rng.integers(0, 256, n, dtype=np.uint8)
        for c in range(256):
            here, there = rng.integers(0, 256, n, dtype=np.uint8), None
            there = here.copy()
            _parity._accumulate(here, c, block)
            if c > 1:
                _parity._accumulate_numpy(there, c, block)
            elif c == 1:
                there ^= block
            assert np.array_equal(here, there), (n, c)
    code = Code(6, 3, 1000)
    segments = {i: code.segments(rng.integers(0, 256, 1000, dtype=np.uint8)) for i in range(6)}
    parity = {i: code.parity(i, segments) for i in range(6)}
    rebuilt = code.rebuild([0, 2, 5], {i: segments[i] for i in (1, 3, 4)}, {i: parity[i] for i in (1, 3, 4)})
    monkeypatch.setattr(_parity, "_isal", lambda: None)
    assert _parity.encoder() == "numpy"
    assert all(np.array_equal(code.parity(i, segments), parity[i]) for i in range(6))
    again = code.rebuild([0, 2, 5], {i: segments[i] for i in (1, 3, 4)}, {i: parity[i] for i in (1, 3, 4)})
    assert all(np.array_equal(rebuilt[i], again[i]) and np.array_equal(rebuilt[i], segments[i]) for i in (0, 2, 5))


def test_the_one_pass_xor_of_several_blocks_is_their_xor_aligned_or_not_and_takes_isa_l_when_aligned(monkeypatch):
    from elastic.recovery import _parity

    rng = np.random.default_rng(5)
    calls: list[int] = []
    lib = _parity._isal()
    if lib is not None:  # count the fused calls: a wrapper over the real function
        real = lib.xor_gen
        monkeypatch.setattr(lib, "xor_gen", lambda vects, n, arrays: calls.append(vects) or real(vects, n, arrays))
    for n, shift, count in ((4096, 0, 2), (4099, 0, 3), (40, 0, 2), (4096, 8, 2), (31, 0, 2), (4096, 0, 1)):
        raw = [_parity.aligned_empty(n + shift) for _ in range(count + 1)]
        out, *blocks = [a[shift:] for a in raw]
        for a in (out, *blocks):
            a[:] = rng.integers(0, 256, n, dtype=np.uint8)
        want = out.copy()
        for block in blocks:
            want ^= block
        before = len(calls)
        _parity.xor_into(out, blocks)
        assert np.array_equal(out, want), (n, shift, count)
        fused = len(calls) > before
        assert fused == (lib is not None and shift == 0 and count > 1 and n >= _parity.ALIGN), (n, shift, count)
    assert all(_parity.aligned_empty(n).ctypes.data % _parity.ALIGN == 0 for n in (1, 1000, 1 << 20, 5 << 20))


def test_a_decode_lands_each_segments_first_whole_term_of_weight_one_in_the_payload_and_stages_the_rest():
    """The receiver's plan for one exchange (pure): the first term from a peer that covers the whole
    piece with weight 1 is received into the dead member's payload (no zeroing, no staging, no
    pass to add it); the other terms are staged and added; with no such term the piece is zeroed."""
    from elastic.recovery._paritystore import _Piece
    seg, me, dead = 4096, 5, 1
    sizes = {0: 3 * seg, 1: 3 * seg, 2: 3 * seg, 3: seg}
    xor = [(me, dead, 0, seg, [(0, "data", 0, 1, 3 * seg), (2, "data", 0, 1, 3 * seg), (3, "parity", 0, 1, seg)])]
    plan = _Piece.of(xor, sizes, me, q=0, pieces=2)  # the first half of the segment
    assert plan.zeros == [] and plan.receives[0] == (0, dead, 0, seg // 2)
    assert plan.receives[1:] == [(2, None, 0, seg // 2), (3, None, seg // 2, seg // 2)] and plan.staged == seg
    assert [a[3][0] for a in plan.adds] == ["staged", "staged"]
    # Weights other than 1 (Reed-Solomon's) are staged and added: the piece is zeroed first.
    rs = [(me, dead, 0, seg, [(0, "data", 0, 7, 3 * seg), (3, "parity", 0, 3, seg)])]
    plan = _Piece.of(rs, sizes, me, q=0, pieces=2)
    assert plan.zeros == [(dead, 0, seg // 2)] and all(r[1] is None for r in plan.receives) and len(plan.adds) == 2
    # A term that ends inside the piece (its payload is shorter) cannot stand for the whole piece.
    short = [(me, dead, 0, seg, [(0, "data", 0, 1, seg // 4), (3, "parity", 0, 1, seg)])]
    plan = _Piece.of(short, {**sizes, 0: seg // 4}, me, q=0, pieces=2)
    assert plan.zeros == [] and plan.receives[1] == (3, dead, 0, seg // 2) and plan.receives[0][1] is None
