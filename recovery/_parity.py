"""Parity instead of copies: redundancy settings, parity groups, and the XOR / Reed-Solomon code (pure, no MPI).

A group of K ranks keeps its members' rank-unique payloads recoverable after M losses with
M/(K-M) of a payload in parity on each member, instead of (R-1) whole copies. The layout is
redset's rotated one, generalised to M parities: every member's payload (padded to the group's
longest, in 8-byte words) is cut into K-M segments; codeword ``c`` (one per member, 0..K-1) takes
segment ``t`` of member ``(c + t) % K`` as its data block ``t`` (t < K-M) and puts its M parity
blocks on members ``(c + K - M + j) % K``, so no member holds parity of its own data and any M
lost members lose at most M blocks of each codeword. Parity block 0 is the XOR of the data
blocks (``xor:K`` is ``rs:K+1``); blocks 1..M-1 weigh them by a Cauchy matrix over GF(2^8)
whose columns are scaled so that its first row is all ones (every square submatrix stays
invertible: any M losses decode). A byte code on the payloads' bytes: exact for every dtype.

``group_of`` forms groups from the ``Layout`` one member per failure domain where the domains
allow (the ranks ordered index-major over the domains: every domain's first member, then every
second one, ...; cut into balanced runs of at least K), in O(domains) per rank, never a table.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import dataclasses
import functools
import importlib.util
import re
from pathlib import Path
from typing import Collection, Mapping, Sequence

import numpy as np

from elastic.comm import ConfigError

from ._placement import Layout

# ------------------------------------------------------------------ the setting


@dataclasses.dataclass(frozen=True)
class Redundancy:
    """``copies:R`` (R whole copies, the default ``copies:2``), ``xor:K`` (groups of K, one loss
    each) or ``rs:K+M`` (groups of K, M losses each)."""

    kind: str      # "copies", "xor" or "rs"
    copies: int    # copies: R; parity: 1 (each value's own, on its owner)
    k: int = 0     # members of a parity group
    m: int = 0     # losses a group survives (parity blocks per codeword)

    @classmethod
    def parse(cls, text: str) -> "Redundancy":
        found = re.fullmatch(r"\s*(copies):(\d+)\s*|\s*(xor):(\d+)\s*|\s*(rs):(\d+)\+(\d+)\s*", text or "")
        if found is None:
            raise ConfigError(f"redundancy {text!r}: write copies:R (R whole copies), xor:K (parity over groups of "
                              "K ranks, one loss each) or rs:K+M (Reed-Solomon over groups of K, M losses each)")
        if found[1]:
            copies = int(found[2])
            if copies < 1:
                raise ConfigError(f"redundancy {text!r}: copies:R needs R >= 1 (1 keeps no copy on a peer)")
            return cls("copies", copies)
        k, m = (int(found[4]), 1) if found[3] else (int(found[6]), int(found[7]))
        if m < 1 or k < m + 1 or k > 255 - m:
            raise ConfigError(f"redundancy {text!r}: a parity group needs K > M >= 1 (K members, M of them "
                              "lost at once at most) and K + M <= 255")
        return cls("xor" if found[3] else "rs", 1, k, m)

    def __str__(self) -> str:
        return f"copies:{self.copies}" if self.kind == "copies" else \
            f"xor:{self.k}" if self.kind == "xor" else f"rs:{self.k}+{self.m}"

    @property
    def parity(self) -> bool:
        return self.kind != "copies"


# ------------------------------------------------------------------ the groups


def group_of(layout: Layout, rank: int, k: int) -> tuple[int, ...]:
    """The members of ``rank``'s parity group, in code order (the same tuple on each member).

    Index-major order over the domains, cut into ``max(1, n // k)`` balanced runs: with at least
    as many domains as a run is long and domains of one size, every member of a run is in a domain
    of its own; where they are fewer (one host), members share domains, as copies then do."""
    sizes = [len(members) for members in layout.domains]
    n = len(layout.ranks)
    runs = max(1, n // k)
    pos = _position(sizes, *layout.place[rank])
    g = _run_of(pos, n, runs)
    first, end = _run_bounds(g, n, runs)
    return tuple(_rank_at(layout, sizes, p) for p in range(first, end))


def _run_bounds(g: int, n: int, runs: int) -> tuple[int, int]:
    return g * n // runs, (g + 1) * n // runs


def _run_of(pos: int, n: int, runs: int) -> int:
    g = pos * runs // n
    while _run_bounds(g, n, runs)[1] <= pos:  # (floor division puts a bound at most one run off)
        g += 1
    while _run_bounds(g, n, runs)[0] > pos:
        g -= 1
    return g


def _row_start(sizes: Sequence[int], i: int) -> int:
    """Where index ``i``'s row begins in the index-major order (O(domains))."""
    return sum(min(s, i) for s in sizes)


def _position(sizes: Sequence[int], d: int, i: int) -> int:
    return _row_start(sizes, i) + sum(1 for s in sizes[:d] if s > i)


def _rank_at(layout: Layout, sizes: Sequence[int], pos: int) -> int:
    rows = max(sizes)
    i = bisect.bisect_right(range(rows + 1), pos, key=lambda r: _row_start(sizes, r)) - 1
    left = pos - _row_start(sizes, i)
    for d, s in enumerate(sizes):
        if s > i:
            if left == 0:
                return layout.domains[d][i]
            left -= 1
    raise AssertionError(f"position {pos} past the last rank")


# ------------------------------------------------------------------ GF(2^8)

_POLY = 0x11D  # x^8 + x^4 + x^3 + x^2 + 1, as ISA-L and Jerasure use


def _tables() -> tuple[np.ndarray, np.ndarray]:
    exp, log = np.zeros(512, dtype=np.uint8), np.zeros(256, dtype=np.int32)
    x = 1
    for p in range(255):
        exp[p], log[x] = x, p
        x <<= 1
        if x & 0x100:
            x ^= _POLY
    exp[255:510] = exp[:255]
    return exp, log


_EXP, _LOG = _tables()


def _mul(a: int, b: int) -> int:
    return 0 if a == 0 or b == 0 else int(_EXP[_LOG[a] + _LOG[b]])


def _inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(_EXP[255 - _LOG[a]])


@functools.lru_cache(maxsize=None)
def _times(c: int) -> np.ndarray:
    """The 256-byte table of multiplication by ``c``."""
    return np.array([_mul(c, v) for v in range(256)], dtype=np.uint8)


@functools.lru_cache(maxsize=None)
def coefficients(data: int, m: int) -> tuple[tuple[int, ...], ...]:
    """The M x (K-M) parity rows: a Cauchy matrix 1 / (x_j + y_t), x_j = data + j, y_t = t, each
    column scaled so that row 0 is all ones (parity 0 is the XOR)."""
    rows = [[_inv((data + j) ^ t) for t in range(data)] for j in range(m)]
    scale = [_inv(rows[0][t]) for t in range(data)]
    return tuple(tuple(_mul(rows[j][t], scale[t]) for t in range(data)) for j in range(m))


def _accumulate(out: np.ndarray, c: int, block: np.ndarray) -> None:
    """out ^= c * block over GF(2^8) (uint8 arrays of one length): the XOR in 8-byte words, a
    multiple by ISA-L where it is here (``encoder()``), else by numpy's table lookup."""
    if c == 1:
        _xor(out, block)
    elif c:
        lib = _isal()
        if lib is not None:
            lib.ec_encode_data_update(len(out), 1, 1, 0, _isal_tables(c), block.ctypes.data,
                                      (ctypes.c_void_p * 1)(out.ctypes.data))
        else:
            _accumulate_numpy(out, c, block)


def _accumulate_numpy(out: np.ndarray, c: int, block: np.ndarray) -> None:
    np.bitwise_xor(out, _times(c)[block], out=out)


def xor_into(out: np.ndarray, blocks: Sequence[np.ndarray]) -> None:
    """out ^= every block (uint8 arrays of out's length) in one pass over out: ISA-L's ``xor_gen``
    where the arrays are 32-byte aligned (it reads them with aligned vector loads), ~1.5x two of
    numpy's passes over two blocks here; numpy's, one block at a time, otherwise and for the tail."""
    lib = _isal()
    body = out.size // ALIGN * ALIGN
    arrays = [out, *blocks]
    if lib is not None and len(blocks) > 1 and body and all(a.ctypes.data % ALIGN == 0 for a in arrays):
        lib.xor_gen(len(arrays) + 1, body, (ctypes.c_void_p * (len(arrays) + 1))(
            *(a.ctypes.data for a in arrays), out.ctypes.data))
    else:
        body = 0
    for block in blocks:
        _xor(out[body:], block[body:])


ALIGN = 32  # the alignment ISA-L's vector loads need


def aligned_empty(nbytes: int) -> np.ndarray:
    """A fresh uint8 array whose first byte is ``ALIGN``-aligned (numpy's need not be)."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


def _xor(out: np.ndarray, block: np.ndarray) -> None:
    """out ^= block: 8-byte words over the longest prefix that has them, bytes after it."""
    words = out.size // 8 * 8
    if words and out.ctypes.data % 8 == 0 and block.ctypes.data % 8 == 0:
        np.bitwise_xor(out[:words].view(np.uint64), block[:words].view(np.uint64), out=out[:words].view(np.uint64))
    else:
        words = 0
    np.bitwise_xor(out[words:], block[words:], out=out[words:])


@functools.lru_cache(maxsize=1)
def _isal() -> ctypes.CDLL | None:
    """ISA-L's erasure-code library: the copy the pyeclib wheel ships, else the system's (Debian's
    libisal2); None where neither loads (numpy's path then, ~0.2 GB/s against ~8 for a multiple)."""
    candidates = []
    spec = importlib.util.find_spec("pyeclib")
    if spec is not None and spec.origin:
        candidates += sorted(Path(spec.origin).resolve().parent.parent.glob("pyeclib.libs/libisal*.so*"))
    found = ctypes.util.find_library("isal")
    candidates += [Path(found)] if found else []
    for path in candidates:
        try:
            lib = ctypes.CDLL(str(path))
            lib.ec_init_tables.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            lib.ec_encode_data_update.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.xor_gen.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
            return lib
        except (OSError, AttributeError):
            continue
    return None


@functools.lru_cache(maxsize=None)
def _isal_tables(c: int) -> "ctypes.Array[ctypes.c_ubyte]":
    """ISA-L's expanded tables for multiplying by ``c`` (32 bytes)."""
    lib = _isal()
    assert lib is not None
    tables = (ctypes.c_ubyte * 32)()
    lib.ec_init_tables(1, 1, (ctypes.c_ubyte * 1)(c), tables)
    return tables


def encoder() -> str:
    """What multiplies over GF(2^8) here: ``"isa-l"`` or ``"numpy"`` (the XOR is numpy's either way)."""
    return "isa-l" if _isal() is not None else "numpy"


def _solve(rows: list[list[int]]) -> list[list[int]]:
    """The inverse of a square matrix over GF(2^8) (Gauss-Jordan; tiny: K-M rows)."""
    n = len(rows)
    a = [list(r) + [int(i == j) for j in range(n)] for i, r in enumerate(rows)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col]), None)
        if pivot is None:
            raise ValueError("a singular matrix: those blocks do not determine the data")
        a[col], a[pivot] = a[pivot], a[col]
        f = _inv(a[col][col])
        a[col] = [_mul(f, v) for v in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [v ^ _mul(f, w) for v, w in zip(a[r], a[col])]
    return [row[n:] for row in a]


# ------------------------------------------------------------------ the code


@dataclasses.dataclass(frozen=True)
class Code:
    """The rotated code of a group of ``k`` members surviving ``m`` losses, for payloads of at
    most ``longest`` bytes."""

    k: int
    m: int
    longest: int

    @property
    def segment(self) -> int:
        """Bytes of one block: the longest payload over K-M segments, in whole 8-byte words."""
        words = -(-self.longest // 8)
        return 8 * -(-words // (self.k - self.m))

    def data_blocks(self, c: int) -> list[tuple[int, int]]:
        """Codeword ``c``'s data blocks: (member, its segment), in block order."""
        return [((c + t) % self.k, t) for t in range(self.k - self.m)]

    def parity_members(self, c: int) -> list[int]:
        """The members holding codeword ``c``'s parity blocks 0..M-1."""
        return [(c + self.k - self.m + j) % self.k for j in range(self.m)]

    def parity_of(self, member: int) -> list[tuple[int, int]]:
        """What ``member`` holds in parity: (codeword, parity block), in its parity's order."""
        return [((member - (self.k - self.m) - j) % self.k, j) for j in range(self.m)]

    def segments(self, payload: np.ndarray) -> np.ndarray:
        """A payload's bytes as its K-M segments (a (K-M, segment) uint8 array, zero padded)."""
        flat = np.zeros((self.k - self.m) * self.segment, dtype=np.uint8)
        raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        if raw.size > self.longest:
            raise ValueError(f"a payload of {raw.size} bytes in a code for at most {self.longest}")
        flat[:raw.size] = raw
        return flat.reshape(self.k - self.m, self.segment)

    def sources(self, member: int) -> list[tuple[int, int, int, int]]:
        """What ``member``'s parity is the sum of: (its parity block, data block t, the member whose
        segment t that is, the coefficient), codeword by codeword."""
        rows = coefficients(self.k - self.m, self.m)
        return [(b, t, owner, rows[j][t]) for b, (c, j) in enumerate(self.parity_of(member))
                for t, (owner, _) in enumerate(self.data_blocks(c))]

    def destinations(self, member: int) -> list[tuple[int, int]]:
        """Where ``member``'s segments go to be added in: (segment t, a parity holder of the codeword
        it is data block t of), in t order."""
        return [(t, h) for t in range(self.k - self.m) for h in self.parity_members((member - t) % self.k)]

    def parity(self, member: int, segments: Mapping[int, np.ndarray]) -> np.ndarray:
        """``member``'s parity (M blocks, in ``parity_of`` order) from the other members' segments."""
        out = np.zeros((self.m, self.segment), dtype=np.uint8)
        for b, t, owner, coefficient in self.sources(member):
            _accumulate(out[b], coefficient, segments[owner][t])
        return out

    def rebuild(self, lost: Sequence[int], segments: Mapping[int, np.ndarray],
                parity: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        """The lost members' segments from the survivors' segments and parity (``lost``: at most
        M members; ``segments`` and ``parity`` hold every survivor's)."""
        out = {member: np.zeros((self.k - self.m, self.segment), dtype=np.uint8) for member in lost}
        for c in range(self.k):
            for t, known in self.terms(c, lost):
                owner, s = self.data_blocks(c)[t]
                for kind, member, index, coefficient in known:
                    block = segments[member][index] if kind == "data" else parity[member][index]
                    _accumulate(out[owner][s], coefficient, block)
        return out

    def terms(self, c: int, lost: Collection[int]) -> list[tuple[int, list[tuple[str, int, int, int]]]]:
        """How codeword ``c``'s lost data blocks come back (``lost``: at most M members): for each
        lost block t, the K-M known blocks it is the sum of, each as (``"data"``, member, its
        segment) or (``"parity"``, member, its parity block), with its GF(2^8) coefficient."""
        if len(lost) > self.m:
            raise ValueError(f"{len(lost)} members lost in a group that survives {self.m}")
        gone = set(lost)
        blocks = self.data_blocks(c)
        missing = [t for t, (owner, _) in enumerate(blocks) if owner in gone]
        if not missing:
            return []
        data = self.k - self.m
        known: list[tuple[int, tuple[str, int, int]]] = [(t, ("data", o, s)) for t, (o, s) in enumerate(blocks)
                                                          if o not in gone]
        known += [(data + j, ("parity", h, self._slot(h, c))) for j, h in enumerate(self.parity_members(c))
                  if h not in gone]
        known = known[:data]
        rows = coefficients(data, self.m)
        generator = [[int(t == u) for u in range(data)] for t in range(data)] + [list(row) for row in rows]
        inverse = _solve([generator[r] for r, _ in known])
        return [(t, [(kind, member, index, inverse[t][u]) for u, (_, (kind, member, index)) in enumerate(known)
                     if inverse[t][u]]) for t in missing]

    def _slot(self, holder: int, c: int) -> int:
        return next(b for b, (cw, _) in enumerate(self.parity_of(holder)) if cw == c)
