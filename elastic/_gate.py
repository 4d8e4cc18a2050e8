"""The integrity gate: a stage that stands before a version becomes current, and what a refused one does.

It takes the commit's ``Capture``, runs inside the commit's one exchange of fingerprints (no
collective of its own) and reads the gathered documents to the same ``Verdict`` on every rank
(``_integrity.verdict``): non-finite values or steps refuse the version everywhere (``NonFinite``),
a rank whose shared values differ from a strict majority's is fenced, no majority stops the job.
``roll_back`` is the answer to ``NonFinite``, by ``OnNonFinite``.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from elastic.comm import ConfigError, ProcessFailure, Recoverable, Unrecoverable, agreed
from elastic.recovery import CommitRejected, ReplicatedStore, checksum

from ._capture import INDEX, Capture, StepEnd
from ._integrity import NonFinite, digest, my_share, nonfinite_values, verdict
from ._settings import OnNonFinite

_LOG = logging.getLogger("elastic")


def fingerprints(shared: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Each value's dtype, shape and checksum (local; XXH3: ``bench_gate.py`` measures it)."""
    return {name: f"{a.dtype.str}:{list(a.shape)}:{checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8))}"
            for name, a in shared.items()}


class Gate:
    """The gate of one ``State``: what this rank saw since the last commit, the steps dropped, the
    roll-backs in a row (local state; ``check`` and ``roll_back`` are collective)."""

    def __init__(self, world: Recoverable, max_failures: int) -> None:
        self._world, self._max_failures = world, max_failures
        self._seen: tuple[int, str] | None = None  # the first step since the last commit not finite
        self.dropped: set[int] = set()             # steps dropped for it (OnNonFinite.SKIP)
        self._rollbacks: list[int | None] = []     # roll-backs since the last commit
        self._loss: float | None = None            # the last finite loss record_step got
        self._told_local = False                   # a rank-local loss was said once

    def step_ended(self, end: StepEnd) -> None:
        """A step's loss and gradient norm (local; a stage of the step's end): the first non-finite
        one is kept for the gate."""
        for what, value in (("loss", end.loss), ("grad_norm", end.grad_norm)):
            if value is not None and self._seen is None and not math.isfinite(value):
                self._seen = (end.step, what)
        if end.loss is not None and math.isfinite(end.loss):
            self._loss = float(end.loss)

    def forget(self) -> None:
        """The steps it saw were undone (a restore)."""
        self._seen = None

    def passed(self) -> None:
        """A version became current: nothing seen, no roll-back in a row."""
        self._seen, self._rollbacks = None, []

    def check(self, capture: Capture, version: int) -> None:
        """Before ``version`` becomes current (collective: the commit's one exchange of fingerprints).
        Every rank reads the same documents to the same ``Verdict``: a NaN / Inf raises ``NonFinite``
        everywhere (``elastic.run`` rolls back); ranks whose shared values differ from a strict
        majority's are fenced (they fail, the others recover and roll back, a replacement gets the
        majority's values); with no majority, ``CommitRejected`` everywhere; a value whose name,
        dtype or shape differs, a ``ConfigError`` everywhere (the program's error: nobody fenced).
        Cost: the fingerprints and the non-finite scan of this rank's share: its own values, and
        1/size of those every rank holds alike (``my_share``)."""
        world = self._world
        sums = fingerprints(capture.shared)
        values = {n: a for n, a in capture.arrays.items() if n != INDEX}
        share = my_share(values, list(sums), int(world.rank), world.size)
        document = {"digest": digest(sums), "seen": list(self._seen) if self._seen else None,
                    "values": nonfinite_values(share), "loss": self._loss}
        everyone = world.allgather(document)
        self._local_loss([d.get("loss") for d in everyone])
        if any(d["digest"] != everyone[0]["digest"] for d in everyone):  # rare: which values, on whom
            everyone = [{**d, "sums": s} for d, s in zip(everyone, world.allgather(sums))]
        ranks = [int(r) for r in world.logical_ranks]
        found = verdict(everyone, ranks)
        if found.good:
            return
        if found.nonfinite:
            self._refuse_nonfinite(found.nonfinite_step, found.nonfinite_what, found.nonfinite_values, version)
        if found.structure:
            named = {n: {k: list(r) for k, r in kinds.items()} for n, kinds in found.structure.items()}
            world.events.emit("integrity", verdict="structure", version=version, values=named)
            raise agreed(_structure_error(found.structure, version))
        if found.fenced:
            self._fence(found.fenced, found.differ, len(ranks), version)
        world.events.emit("integrity", verdict="no_majority", version=version, values=list(found.no_majority))
        raise agreed(_no_majority(found.no_majority, everyone, ranks), final=False)

    def _local_loss(self, losses: list[float | None]) -> None:
        """Say once (every rank alike) that ``record_step`` got a loss that differs across ranks: an
        all-reduced loss is the same bits everywhere, so this is each rank's own share, and the
        steps, the report and a shrink's comparison read rank 0's alone."""
        told = [x for x in losses if x is not None]
        if self._told_local or len(told) < 2 or len(set(told)) == 1:
            return
        self._told_local = True
        self._world.events.emit("local_loss", losses=told)
        _LOG.warning("[integrity] record_step got a loss that differs across ranks (%s ...): the job's steps, "
                     "progress lines and report show rank 0's own. Pass the global loss: all-reduce the "
                     "ranks' shares first (world.allreduce), as examples/train.py does", told[:4])

    def _refuse_nonfinite(self, step: int | None, what: str, values: tuple[str, ...], version: int) -> None:
        said = f"a non-finite {what} at step {step}" if step is not None else \
            "no non-finite loss or gradient norm was recorded"
        holding = f"; committed values holding NaN/Inf: {list(values)[:5]}" if values else ""
        self._world.events.emit("integrity", verdict="nonfinite", version=version, step=step, what=what,
                                values=list(values))
        raise agreed(NonFinite(f"version {version} not committed: {said}{holding}", step, values), final=False)

    def _fence(self, fenced: tuple[int, ...], differ: Mapping[int, tuple[str, ...]], size: int, version: int) -> None:
        world = self._world
        listed = "; ".join(f"logical rank {r}: {list(names)[:5]}" for r, names in differ.items())
        why = (f"integrity: values that must be equal differ from the majority's ({size - len(fenced)} "
               f"of {size} ranks) on {listed}; fenced before version {version}")
        world.events.emit("integrity", verdict="fenced", version=version, ranks=list(fenced),
                          values={str(r): list(n) for r, n in differ.items()})
        if int(world.logical_rank) in fenced:
            world.fail("integrity", why)
        raise ProcessFailure(why)

    def roll_back(self, error: NonFinite, mode: OnNonFinite, store: ReplicatedStore, restore: Callable[[], None],
                  refusal: str | None) -> None:
        """After ``NonFinite`` (agreed): every rank back to the last good version (``restore``),
        dropping the offending step with ``SKIP``. Non-finite again before any commit since (the
        version passed the gate, but the corruption came before it): one version further back,
        while every rank keeps an older one (``keep_versions``); stop when nothing can help, or
        with ``refusal`` (the recovery point's reason it keeps nothing to roll back to).
        Collective only for that fall-back; the same on every rank."""
        world = self._world
        step, again = error.step, bool(self._rollbacks)
        stop = self._stop_reason(step, mode, refusal)
        if stop is not None:
            raise agreed(Unrecoverable(f"{error} ({stop})"))
        fallen = store.fall_back() if again else None
        if again and fallen is None:
            raise agreed(Unrecoverable(
                f"{error} (not finite again after the roll-back to version {store.version}, and no older version is "
                f"kept on every rank: keep_versions={store.keep}, and a failure keeps only the current one. The "
                "cause is not transient (data, learning rate): on_nonfinite='skip' drops the step; keep_versions=K "
                "goes back further)"))
        self._rollbacks.append(step)
        drop = False
        if mode is OnNonFinite.SKIP and step is not None:
            self.dropped.add(step)
            drop = True
        restore()
        world.events.emit("rolled_back", version=store.version, step=step, dropped=drop, values=error.values,
                          fallback=fallen is not None)
        _LOG.warning("[integrity] %s: rolled back to version %s%s%s", error, store.version,
                     " (one further: the last one did not help)" if fallen is not None else "",
                     f", step {step} dropped" if drop else "")

    def _stop_reason(self, step: int | None, mode: OnNonFinite, refusal: str | None) -> str | None:
        if mode is OnNonFinite.STOP:
            return "on_nonfinite='stop'"
        if refusal is not None:
            return refusal
        if mode is OnNonFinite.SKIP and step in self.dropped:
            return (f"step {step} was dropped but ran again: ask state.dropped(state.step + 1) at the top of the "
                    "loop and skip the step when it says so")
        if len(self._rollbacks) >= self._max_failures:
            return f"{len(self._rollbacks)} roll-backs in a row without a successful commit"
        return None


class TwinCheck:
    """Duplicate execution as an integrity check (``State(twins=...)``): the twins of a shard hold
    the same bits by construction (the same summed gradient, the same update), so every ``every``
    steps, at ``record_step`` (the step ended), they compare fingerprints of their twinned values:
    one small all-gather, a second only when some differ. Cost: XXH3 over the twinned bytes, ~0.2 s
    per GB here, once every ``every`` steps. A twin that differs from a strict majority of its
    shard's twins is fenced (it fails, the others recover, its replacement takes the shard from the
    majority); with two twins nothing tells which is right, and every rank stops, naming the shard
    and the values. A wrong shard feeds the model, and so every rank's gradient, until it is found:
    a smaller ``every`` finds it sooner."""

    def __init__(self, world: Recoverable, holders: Callable[[int], Sequence[int]], every: int) -> None:
        self._world, self._holders, self._every = world, holders, every

    def step_ended(self, end: StepEnd) -> None:
        """Every ``every`` steps (collective: a stage of the step's end)."""
        step = end.step
        if step % self._every:
            return
        world = self._world
        sums = fingerprints(end.capture.twin)
        ranks = [int(r) for r in world.logical_ranks]
        told = dict(zip(ranks, world.allgather(digest(sums))))
        groups = sorted({tuple(h for h in self._holders(r) if h in told) for r in ranks})
        odd = [group for group in groups if len({told[h] for h in group}) > 1]
        if not odd:
            return
        everyone = dict(zip(ranks, world.allgather(sums)))
        fenced: dict[int, tuple[str, ...]] = {}
        undecided: dict[tuple[int, ...], tuple[str, ...]] = {}
        for group in odd:
            found = verdict([{"digest": told[h], "sums": everyone[h]} for h in group], list(group))
            if found.fenced:
                fenced.update(found.differ)
            else:
                undecided[group] = found.no_majority or tuple(found.structure)
        world.events.emit("integrity", verdict="twins", step=step, ranks=sorted(fenced),
                          values={str(r): list(n) for r, n in fenced.items()},
                          undecided={str(list(g)): list(n) for g, n in undecided.items()})
        if undecided:
            listed = "; ".join(f"the twins {list(g)} differ in {list(n)[:5]}" for g, n in undecided.items())
            raise agreed(Unrecoverable(
                f"integrity: at step {step} {listed}: they hold the same shard and took the same update, so one was "
                "corrupted (a flipped bit, a faulty device), and with no majority nothing tells which one. Run with "
                "more replicas (a majority of 3 replaces the odd twin) or commit() to roll back"))
        listed = "; ".join(f"logical rank {r}: {list(n)[:5]}" for r, n in fenced.items())
        why = f"integrity: at step {step} a twin's shard differs from its majority's ({listed}); fenced"
        if int(world.logical_rank) in fenced:
            world.fail("integrity", why)
        raise ProcessFailure(why)


def _structure_error(structure: Mapping[str, Mapping[str, tuple[int, ...]]], version: int) -> ConfigError:
    listed = "; ".join(f"{name!r}: " + ", ".join(f"{kind or 'another structure'} on logical ranks {list(ranks)}"
                                                 for kind, ranks in kinds.items())
                       for name, kinds in list(structure.items())[:5])
    more = f" (and {len(structure) - 5} more)" if len(structure) > 5 else ""
    return ConfigError(
        f"version {version} not committed: values that must be equal on every rank differ in name, dtype or shape "
        f"({listed}{more}). That is the program's doing, not a corruption: every rank must hold the same values "
        "alike (same names, shapes, dtypes), or name per-rank values in local=(...); nothing was fenced")


def _no_majority(names: tuple[str, ...], everyone: list[dict[str, Any]], ranks: list[int]) -> CommitRejected:
    bad: dict[str, list[int]] = {}
    for name in names:
        first = everyone[0]["sums"].get(name)
        bad[name] = [r for r, doc in zip(ranks, everyone) if doc["sums"].get(name) != first]
    listed = "; ".join(f"{n!r} on logical ranks {r} differs from logical rank {ranks[0]}"
                       for n, r in list(bad.items())[:5])
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return CommitRejected(
        f"commit rejected, the last version is kept: state that must be equal across ranks differs: "
        f"{listed}{more}, and no majority of the {len(ranks)} ranks agrees on it (a rank that differs from a "
        "majority of 3 or more is replaced instead). Keep replicas in step (same seed, same all-reduced "
        "gradients), or name per-rank values in local=(...)")
