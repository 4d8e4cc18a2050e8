"""What makes a recovery point trustworthy, and a rank worth keeping: the integrity gate, stragglers.

The gate runs inside ``State.commit``'s one exchange of fingerprints (no collective of its own):
each rank adds what it saw since the last commit (a non-finite loss or gradient norm, by step)
and the names of its committed values that hold a NaN or an Inf, and every rank reads the same
gathered documents to the same ``Verdict``: the version becomes current, or it does not and
every rank does the same thing about it. A rank whose values that must be equal differ from a
strict majority's is fenced (it fails, and is replaced like a dead one: its state comes from the
majority); with two ranks, or no majority, nobody can tell which copy is right, and the job stops.
A value whose name, dtype or shape differs on some rank is no corruption (bits flip, shapes do not):
a program error, refused on every rank alike, and nobody is fenced for it.

The straggler detector reads each step's own work per rank (the step's time less what the rank
waited in collectives), gathered on every rank alike, so its decision is agreed without a vote.
Pure logic, no MPI: tested in process (``tests/test_unit.py``).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Mapping, Sequence

import numpy as np

from elastic.recovery import CommitRejected, checksum

_DOT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class NonFinite(CommitRejected):
    """A NaN or an Inf at a recovery point (agreed: the same on every rank); the version was not
    made current. ``step``: the first step whose loss or gradient norm was not finite (None when
    only the committed values showed it); ``values``: the committed values that held one."""

    def __init__(self, message: str, step: int | None, values: Sequence[str]) -> None:
        super().__init__(message)
        self.step, self.values = step, list(values)


def nonfinite_values(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The names of the floating arrays (one dimension or more) that hold a NaN or an Inf (local).

    A dot product of the array with itself is NaN or Inf whenever an element is (one BLAS pass, as
    fast as the commit's XXH3: ``bench_gate.py``); only then, or for a dtype BLAS does not
    take, is each element looked at, so an overflow of the sum alone is never taken for one.
    Scalars (0-d) are not looked at: programs keep ``loss=float("nan")`` as "none yet"."""
    bad = []
    with np.errstate(over="ignore", invalid="ignore"):
        for name, array in arrays.items():
            if not _finite(array):
                bad.append(name)
    return bad


def _finite(array: np.ndarray) -> bool:
    """Every element finite (or not a floating array of one dimension or more)."""
    if array.dtype.kind not in "fc" or array.ndim == 0 or array.size == 0:
        return True
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype in _DOT_DTYPES and math.isfinite(float(np.dot(flat, flat))):
        return True
    return all(bool(np.isfinite(flat[i:i + (1 << 20)]).all()) for i in range(0, flat.size, 1 << 20))


def my_share(arrays: Mapping[str, np.ndarray], shared: Sequence[str], rank: int, size: int) -> dict[str, np.ndarray]:
    """What this rank scans for NaN / Inf (local; the same split on every rank): its own values all,
    and of the values every rank holds alike (``shared``, compared by fingerprint anyway) its part:
    each, largest first, to the rank that has the fewest bytes so far, so that each is scanned once
    in the job and no rank scans much more than 1/size of their bytes."""
    alike = set(shared)
    load = [(0, r) for r in range(min(size, len(alike)))]
    mine = set()
    for name in sorted(alike & set(arrays), key=lambda n: (-arrays[n].nbytes, n)):
        nbytes, owner = heapq.heappop(load)
        if owner == rank:
            mine.add(name)
        heapq.heappush(load, (nbytes + arrays[name].nbytes, owner))
    return {n: a for n, a in arrays.items() if n not in alike or n in mine}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the gathered gate documents say, the same on every rank."""

    nonfinite_step: int | None = None        # the first step seen non-finite, on any rank
    nonfinite_what: str = ""                 # what was (loss, grad_norm), at that step
    nonfinite_values: tuple[str, ...] = ()   # committed values holding a NaN or an Inf, on any rank
    fenced: tuple[int, ...] = ()             # logical ranks whose shared values differ from the majority's
    differ: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # fenced rank -> values
    no_majority: tuple[str, ...] = ()        # values that differ where no strict majority agrees
    # values whose structure differs: name -> {its dtype and shape, or "missing": the logical ranks}
    structure: Mapping[str, Mapping[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_step is not None or bool(self.nonfinite_values)

    @property
    def good(self) -> bool:
        return not (self.nonfinite or self.fenced or self.no_majority or self.structure)


def verdict(documents: Sequence[Mapping[str, Any]], ranks: Sequence[int]) -> Verdict:
    """Read every rank's gate document, in the order of ``ranks`` (logical): ``digest`` (of all its
    ``sums``); ``sums``, needed only when the digests differ (name -> fingerprint, a string, of
    each value that must be equal); ``seen`` ([step, what] of its first non-finite step, or None);
    ``values`` (its committed values holding a NaN or an Inf). Non-finite comes first: it is not a rank's fault
    (every rank took the same update), so nobody is fenced for it."""
    seen = [d["seen"] for d in documents if d.get("seen")]
    values = tuple(sorted({v for d in documents for v in d.get("values", ())}))
    if seen or values:
        first = min(seen, key=lambda s: int(s[0])) if seen else None
        return Verdict(int(first[0]) if first else None, str(first[1]) if first else "", values)
    if all(d["digest"] == documents[0]["digest"] for d in documents):  # the common case: O(ranks)
        return Verdict()
    sums = [d["sums"] for d in documents]
    structure = _structure(sums, ranks)
    if structure:  # a program error (a shape, a dtype, a name cannot flip): nobody is fenced for it
        return Verdict(structure=structure)
    groups: list[tuple[dict[str, str], list[int]]] = []
    for rank, mine in zip(ranks, sums):
        for key, members in groups:
            if key == mine:
                members.append(rank)
                break
        else:
            groups.append((mine, [rank]))
    majority_sums, majority = max(groups, key=lambda group: len(group[1]))  # the first of the largest
    names = sorted({n for key, _ in groups for n in key} | set(majority_sums))
    if len(ranks) < 3 or 2 * len(majority) <= len(ranks):
        return Verdict(no_majority=tuple(n for n in names if len({key.get(n) for key, _ in groups}) > 1))
    differ = {rank: tuple(n for n in names if mine.get(n) != majority_sums.get(n))
              for rank, mine in zip(ranks, sums) if mine != majority_sums}
    return Verdict(fenced=tuple(sorted(differ)), differ=differ)


def _structure(sums: Sequence[Mapping[str, str]], ranks: Sequence[int]) -> dict[str, dict[str, tuple[int, ...]]]:
    """The values whose name, dtype or shape differs across ranks (a fingerprint is
    ``dtype:shape:checksum``): value -> {dtype:shape, or "missing": logical ranks}. O(ranks x values),
    only when two digests differ."""
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for name in sorted({n for mine in sums for n in mine}):
        kinds: dict[str, list[int]] = {}
        for rank, mine in zip(ranks, sums):
            fingerprint = mine.get(name)
            kinds.setdefault("missing" if fingerprint is None else fingerprint.rpartition(":")[0], []).append(rank)
        if len(kinds) > 1:
            out[name] = {kind: tuple(members) for kind, members in kinds.items()}
    return out


def digest(sums: Mapping[str, str]) -> int:
    """One number for all of a rank's fingerprints (local): the gate gathers this, O(1) per rank,
    and the fingerprints themselves only when two differ."""
    return checksum(np.frombuffer("\n".join(f"{k}={v}" for k, v in sorted(sums.items())).encode(), np.uint8))


class Stragglers:
    """A rank whose own work per step is ``factor`` times the median's for ``steps`` steps in a
    row (local; fed the same gathered times on every rank, so every rank decides alike). One slow
    step (a GC pause, a write to disk) resets nothing and evicts nobody: only a streak counts."""

    def __init__(self, factor: float, steps: int) -> None:
        self.factor, self.steps = factor, steps
        self._streaks: dict[int, list[float]] = {}  # rank -> its ratios to the median, steps in a row
        self._generation = -1

    def reset(self) -> None:
        """Every streak starts again (after a straggler that could not be evicted was told)."""
        self._streaks.clear()

    def observe(self, generation: int, ranks: Sequence[int], seconds: Sequence[float]
                ) -> tuple[int, float, float] | None:
        """The rank to evict, with its mean ratio to the median over the streak and the median
        seconds, once a streak reaches ``steps``; None otherwise. A new generation starts afresh."""
        if generation != self._generation:
            self._generation, self._streaks = generation, {}
        median = float(np.median(seconds))
        if median <= 0:
            return None
        worst: tuple[int, float, float] | None = None
        for rank, s in zip(ranks, seconds):
            ratio = s / median
            if ratio < self.factor:
                self._streaks.pop(rank, None)
                continue
            streak = self._streaks.setdefault(rank, [])
            streak.append(ratio)
            if len(streak) >= self.steps:
                mean = sum(streak[-self.steps:]) / self.steps
                if worst is None or mean > worst[1]:
                    worst = (rank, mean, median)
        return worst
