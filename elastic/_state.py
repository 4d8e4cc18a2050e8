"""State that rolls back together: named values, committed to peers' memory, restored after a failure.

``State`` holds values by name, each through the handler of its kind
(``_handlers``); ``TorchState`` adds a model, an optimizer and the RNG states
as three more handlers. Values every rank holds alike (the data-parallel model
and optimizer) are never copied to peers: each rank keeps its own roll-back
copy, and a replacement gets them from the survivors
(``elastic.recovery.share``). Rank-unique values (``local``: the RNG states, a
shard) are replicated through ``elastic.recovery.ReplicatedStore``.
``commit()`` is the multi-step recovery point; ``per_step=True`` makes every
optimizer step one (``step_point``): the shared values' recovery point is then
the live values themselves, no copy at all. ``restore()`` rolls back, and
after a shrink gives this rank handlers for the values it took over.
``elastic.run`` calls the rest (``_recover``, ``sync``).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Iterator, Mapping

import numpy as np

from elastic.comm import ConfigError, Group, Outlook, ProcessFailure, Unrecoverable, agreed, wire
from elastic.recovery import Adopt, CommitRejected, NothingCommitted, ReplicatedStore, checksum, share

from ._handlers import Handler, Held, Module, Rng, Stateful, adopted, for_value
from ._integrity import NonFinite, Stragglers, digest, my_share, nonfinite_values, verdict

_LOG = logging.getLogger("elastic")
INDEX = "__handlers__"  # a committed JSON document: each value's name and its handler's label


class StepClock:
    """Times training steps: an event per step on rank 0, a progress line, the outlook for the policy.

    Local. A step's duration counts from the previous step or from the last
    ``restart()`` (the end of a recovery), so recovery time is never taken for
    training time. ``outlook`` (seconds per step, smoothed; steps left) is what
    ``elastic.run`` hands to ``World.recover`` for the rebuild policy. The
    progress line (logger ``elastic``, INFO) comes every ``progress_every``
    steps and/or ``progress_seconds`` seconds (the configuration's), and at
    the last step.
    """

    def __init__(self, world: Group) -> None:
        self._world = world
        self._last: float | None = None
        self._waited = 0.0  # the world's waiting at the last step's end
        self._shown = time.monotonic()
        self.outlook = Outlook()

    def restart(self) -> None:
        self._last, self._waited = time.perf_counter(), self._world.job.waited

    def own_work(self) -> float:
        """Seconds of this step so far that this rank did not spend waiting for its peers (local)."""
        if self._last is None:
            return 0.0
        return max(time.perf_counter() - self._last - (self._world.job.waited - self._waited), 0.0)

    def step_done(self, step: int, loss: float | None = None, total: int | None = None, **metrics: Any) -> float:
        """Returns the step's own work (``own_work``)."""
        own = self.own_work()
        now = time.perf_counter()
        seconds = now - self._last if self._last is not None else 0.0
        self._last, self._waited = now, self._world.job.waited
        before = self.outlook.step_seconds
        self.outlook = Outlook(seconds if before is None else 0.8 * before + 0.2 * seconds,
                               max(total - step, 0) if total is not None else self.outlook.remaining_steps)
        world = self._world
        if world.rank == 0:
            world.events.emit("step", step=step, loss=loss, seconds=seconds, size=world.size, **metrics)
            if self._due(step, total) and _LOG.isEnabledFor(logging.INFO):
                of = f"/{total}" if total else ""
                shown = f" loss {loss:.5f}" if loss is not None else ""
                rate = 1 / max(self.outlook.step_seconds or 0.0, 1e-9)
                _LOG.info("[train] step %s%s%s  %.1f steps/s  %d ranks  generation %d", step, of, shown, rate,
                          world.size, world.generation)
        return own

    def _due(self, step: int, total: int | None) -> bool:
        config, now = self._world.job.settings, time.monotonic()
        due = step == total or bool(config.progress_every and step % config.progress_every == 0) or \
            bool(config.progress_seconds and now - self._shown >= config.progress_seconds)
        if due:
            self._shown = now
        return due


class State:
    """Named values that are committed and rolled back together. Create on every active rank.

    Values are reached as attributes (``state.step += 1``) or items
    (``state["adam.3.m"]``). Every value must be equal on all ranks at commit
    time, unless its name, or the part before its first dot, is in ``local``:
    a rank's RNG state or its optimizer shard, for example.

    Args:
        world: from ``elastic.init()``.
        replication: copies of each rank's committed state (2 survives any one failure).
        local: names (or first dotted parts) of values that may differ across ranks.
        chunk_bytes: the store's replication unit.
        adopt: after a shrink, which survivor takes a removed rank's values: a function of
            (removed, survivors) -> {removed: survivor}, the same on every rank (default round-robin).
        per_step: every step a recovery point (``step_point``, which ``TorchState`` calls
            before each optimizer step): a failure loses only the step in flight, and the
            values every rank holds alike are never copied, not even locally.
        keep_versions: committed versions kept, the current one included (default
            ``ELASTIC_KEEP_VERSIONS``, 1): when a step is not finite again after the roll-back to
            the last version, every rank goes back one more (a corruption that passed the gate).
            Each costs the memory of one more version.
    """

    def __init__(self, world: Group, *, replication: int = 2, local: tuple[str, ...] = (),
                 chunk_bytes: int = 1 << 20, adopt: Adopt | None = None, per_step: bool = False,
                 keep_versions: int | None = None, **values: Any) -> None:
        if per_step and world.job.settings.node_store:
            raise ConfigError("per_step=True keeps the values every rank shares only in the processes' memory, "
                              "and a tier-2 relaunch (node_store) starts new ones: use per_step=False with "
                              "node_store (each commit then keeps them in node memory)")
        self._world = world
        keep = world.job.settings.keep_versions if keep_versions is None else keep_versions
        self._store = ReplicatedStore(world, replication=replication, chunk_bytes=chunk_bytes, keep=keep)
        self._per_step = per_step
        self._holds_shared = False  # this rank's shared values are the job's (not on a fresh replacement)
        self._in_step = False       # per step: between a step point and the step's end (record_step)
        self._calls_at_point = 0    # world.job.collectives right after the last step point
        self._adopt = adopt
        self._local = frozenset(local) | {INDEX}
        self._handlers: dict[str, Handler] = {}  # every value, the program's and the State's own
        self._public: set[str] = set()            # the program's: state[name], names()
        self._clock = StepClock(world)
        # The integrity gate (``_gate``): the first step since the last commit whose loss or gradient
        # norm was not finite, the steps dropped for it (on_nonfinite="skip"), roll-backs in a row.
        self._seen: tuple[int, str] | None = None
        self._dropped: set[int] = set()
        self._rollbacks: list[int | None] = []
        settings = world.job.settings
        self._stragglers = Stragglers(settings.straggler_factor, settings.straggler_steps) \
            if settings.straggler_factor else None
        for name, value in values.items():
            self[name] = value

    # ------------------------------------------------------------ values
    def __setitem__(self, name: str, value: Any) -> None:
        if name in self._handlers and name not in self._public:
            raise ConfigError(f"state value {name!r}: {type(self).__name__} keeps its own values under that name; "
                              "choose another")
        self._handlers[name] = for_value(name, value)
        self._public.add(name)

    def __getitem__(self, name: str) -> Any:
        if name not in self._public:
            raise KeyError(name)
        return self._handlers[name].value

    def __delitem__(self, name: str) -> None:
        if name not in self._public:
            raise KeyError(name)
        self._public.discard(name)
        del self._handlers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._public

    def names(self) -> Iterator[str]:
        return iter(sorted(self._public))

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_public", ()):
            return self.__dict__["_handlers"][name].value
        raise AttributeError(f"{type(self).__name__} has no value {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            object.__setattr__(self, name, value)  # the class's own attributes
        else:
            self[name] = value

    @property
    def world(self) -> Group:
        return self._world

    @property
    def outlook(self) -> Outlook:
        """The loop's view ahead, from ``record_step`` (for the rebuild policy)."""
        return self._clock.outlook

    @property
    def version(self) -> int | None:
        """The last agreed commit (None before the first)."""
        return self._store.version

    # ---------------------------------------------------- the save / restore contract
    def commit(self) -> None:
        """Replicate the current values as a new version (collective over the active ranks).

        Raises:
            ConfigError: a value that must be equal differs across ranks, or cannot be stored;
                nothing is replaced, the last version stays current on every rank.
            ProcessFailure: a rank died; the last version stays current everywhere.
        """
        arrays = self._capture()
        self._gate(arrays)
        shared = [name for name in arrays if not self._is_local(name)]
        if self._per_step:  # the live values are their recovery point
            arrays, shared = {name: a for name, a in arrays.items() if self._is_local(name)}, []
        self._store.commit(arrays, self._next_version(), unreplicated=shared)  # in the own payload only
        self._holds_shared, self._in_step = True, False
        self._seen, self._rollbacks = None, []

    def step_point(self) -> None:
        """The recovery point of the step in flight (collective over the active ranks); with
        ``per_step=True``. ``TorchState`` calls it before each optimizer step.

        Call it after the step's last collective, once the rank-unique values are what the
        step makes them (the RNG states after the forward; a ZeRO shard after its update), and
        before the values every rank holds alike change (the model's update): every rank votes,
        and either every one goes on (the unique values as they are now are replicated and
        current) or none does (``ProcessFailure`` everywhere, the shared values untouched). A
        later failure finds every survivor past the update, with the shared values alike: the
        job resumes from them, at the next step.
        So between here and ``record_step`` (the step's end, which every step must reach) a
        step does only local work: the update, ``state.step += 1``; a collective there (a loss
        all-reduce: put it before the optimizer step) is refused at ``record_step`` with a
        ``ConfigError`` on every rank, since a failure inside it would leave the bookkeeping
        after it undone on some ranks.
        """
        if not self._per_step:
            raise ConfigError("step_point() is the per-step recovery point: make the State with per_step=True "
                              "(or call commit(), the multi-step one)")
        if self._in_step:
            raise ConfigError("per_step: two step points without record_step() between them; end every step with "
                              "state.record_step(step) (it marks where the step's update is complete)")
        arrays = {name: a for name, a in self._capture().items() if self._is_local(name)}
        self._store.commit(arrays, self._next_version())
        self._in_step, self._calls_at_point = True, self._world.job.collectives

    def _next_version(self) -> int:
        return 0 if self.version is None else self.version + 1

    def restore(self) -> None:
        """Roll every value back to the last agreed version (local); with ``per_step``, the
        rank-unique values (the shared ones are their own recovery point). Values of removed ranks
        this rank took over after a shrink get handlers here, unless it has values of the same name
        (its own win)."""
        if self.version is None:
            raise NothingCommitted("nothing committed yet: elastic.run commits once before calling your function")
        for owner in self._store.owners_here():
            if owner != int(self._world.logical_rank):
                self._apply(self._store.restore_owner(owner), adopting=True)
        own = self._store.restore()
        self._apply(own)
        self._seen = None  # the steps it saw are undone
        if not self._per_step:
            # The shared values roll back from the own payload, which lacks them on a replacement that
            # has not committed since it joined: it must get them again (``_share``), not keep its live
            # ones, which later steps changed. (A relaunch finds them in node memory.)
            self._holds_shared = any(not self._is_local(name) for name in own)

    def sync(self) -> None:
        """Make every rank start from the same state (collective over the active ranks).

        The first time: every value that must be equal is taken from the
        first surviving rank (by the ranks whose values differ from its: by
        checksum, so a seeded start moves nothing), then committed as version 0.
        After a recovery: checks that every rank restored the same version.
        """
        world = self._world
        told = world.allgather((self.version, sorted(self._dropped)))
        versions = [version for version, _ in told]
        self._dropped.update(int(step) for _, dropped in told for step in dropped)  # a replacement learns them
        if len(set(versions)) != 1:
            raise agreed(Unrecoverable(f"ranks restored different versions {versions}: the store's agreement broke "
                                       "(a bug, please report it)"))
        if versions[0] is None:
            everyone = world.allgather(digest(self._fingerprints(self._shared_values())))  # O(1) a rank
            first = everyone[world.job.first_survivor]
            differ = [int(r) for r, sums in zip(world.logical_ranks, everyone) if sums != first]
            if differ:
                self._share_to(differ)
            self.commit()
        self._clock.restart()

    def record_step(self, step: int, loss: float | None = None, total: int | None = None, *,
                    grad_norm: float | None = None, **metrics: Any) -> None:
        """Note that a training step finished (local; collective with straggler detection on, see
        below); see ``StepClock.step_done``. ``loss`` is recorded as given, from rank 0: pass the
        global loss (reduce the ranks' shares first). ``step``: the steps done, so the loop is now at
        step ``step``: the point where the fault schedule's ``R@step`` entries fire, unless the
        program calls ``world.fault_point`` itself.

        The integrity gate: a ``loss`` or ``grad_norm`` (the gradients' global norm, as
        ``clip_grad_norm_`` returns it) that is NaN or Inf keeps the next commit from becoming
        current (``elastic.run`` then rolls back, see ``on_nonfinite``). Pass ``grad_norm``: bad
        gradients show in it at the step that made them, in the loss only a step later.

        With ``ELASTIC_STRAGGLER_FACTOR`` set, every rank's own work in the step (its time less
        what it waited for its peers) is gathered here (one small all-gather), and a rank that
        many times slower than the median for ``ELASTIC_STRAGGLER_STEPS`` steps in a row is
        evicted like a failed rank: call it on every rank then."""
        if self._in_step and self._world.job.collectives != self._calls_at_point:
            raise agreed(ConfigError(  # every rank runs the same code: every rank stops here alike
                "per_step: a collective ran between the step point (optimizer.step()) and record_step(); a "
                "failure inside it would leave the step half ended on some ranks. Do the step's collectives "
                "(the loss all-reduce, logging) before optimizer.step(), or after record_step(), or use "
                "per_step=False"))
        self._in_step = False
        for what, value in (("loss", loss), ("grad_norm", grad_norm)):
            if value is not None and self._seen is None and not math.isfinite(value):
                self._seen = (step, what)
        world = self._world
        world.fault_point(step, implied=True)
        if world.job.data_fault("bitflip"):
            self._flip_a_bit(step)
        slow = world.job.data_fault("slow")
        if slow:  # an injected straggler: X times this step's own work in all
            time.sleep((slow.factor - 1) * self._clock.own_work())
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        own = self._clock.step_done(step, loss, total, **metrics)
        if self._stragglers is not None:
            self._watch_stragglers(step, own)

    def dropped(self, step: int) -> bool:
        """True when the integrity gate dropped the step that ends at ``step`` (the number
        ``record_step`` gets for it), with ``on_nonfinite="skip"`` (local). A loop that allows
        skipping asks at its top, ``if state.dropped(state.step + 1): state.step += 1; continue``:
        the step's batch is not used, nothing is computed or drawn from an RNG."""
        return step in self._dropped

    def _watch_stragglers(self, step: int, own: float) -> None:
        """Gather every rank's own work of this step; evict a straggler when the detector says so
        and the job can fill its place (collective; the same decision on every rank)."""
        assert self._stragglers is not None
        world = self._world
        ranks = [int(r) for r in world.logical_ranks]
        found = self._stragglers.observe(world.generation, ranks, world.allgather(float(own)))
        if found is None:
            return
        rank, ratio, median = found
        settings = world.job.settings
        fill = world.job.spares > 0 or "spawn" in settings.rebuild or \
            ("shrink" in settings.rebuild and world.size - 1 >= settings.min_size)
        why = (f"logical rank {rank} is a straggler: its own work per step was {ratio:.1f}x the median "
               f"({median * 1e3:.1f} ms) for {self._stragglers.steps} steps in a row (factor "
               f"{self._stragglers.factor:g})")
        world.events.emit("straggler", rank=rank, ratio=ratio, median_seconds=median, steps=self._stragglers.steps,
                          step=step, evicted=fill)
        if not fill:  # said once per streak: the streak starts again
            self._stragglers.reset()
            _LOG.warning("[integrity] %s; not evicted: no spare is parked and the rebuild modes %s allow no "
                         "replacement", why, "/".join(settings.rebuild))
            return
        if rank == int(world.logical_rank):
            world.job.fail("straggler", why + ": evicted")
        raise ProcessFailure(why + ": evicted")

    def _flip_a_bit(self, step: int) -> None:
        """An injected silent corruption: one bit of this rank's first shared floating array (a
        model's, where there is one), flipped in the live value (local)."""
        for name in sorted(self._handlers):
            handler = self._handlers[name]
            if self._is_local(name) or name == INDEX:
                continue
            arrays = {k: np.array(a) for k, a in handler.capture(name).items()}
            floating = [k for k in sorted(arrays) if np.issubdtype(arrays[k].dtype, np.floating) and arrays[k].ndim]
            key = floating[0] if floating else None
            if key is None:
                continue
            bits = arrays[key].reshape(-1).view(np.uint8)
            bits[1] ^= 0x10  # a low mantissa bit of the first element: finite, small, silent
            handler.apply(name, arrays)
            self._world.events.emit("bitflip", value=key, step=step)
            return

    # ------------------------------------------------------------ internals
    def _recover(self) -> None:
        """After ``World.recover()``: get lost state back from peers and roll back (collective)."""
        t0 = time.perf_counter()
        if not self._store.recover(adopt=self._adopt):
            return  # no version was ever committed: sync() starts over from the first survivor
        self.restore()
        self._share()
        self._world.events.emit("state_restored", version=self.version, seconds=time.perf_counter() - t0,
                                bytes_moved=self._store.bytes_moved)

    def _share(self) -> None:
        """Give the values every rank holds alike to the ranks that lack them: replacements
        (collective)."""
        world = self._world
        ranks = [int(r) for r in world.logical_ranks]
        lacking = [r for r, holds in zip(ranks, world.allgather(self._holds_shared)) if not holds]
        self._in_step = False  # a failure between a step point and the step's end: only local work was left
        if lacking:
            self._share_to(lacking)

    def _share_to(self, lacking: list[int]) -> None:
        """The shared values from the other active ranks to the logical ranks ``lacking`` (collective)."""
        mine = None if int(self._world.logical_rank) in lacking else self._shared_values()
        got = share(self._world, mine, lacking)
        if got is not None:  # the kinds of values it has no handler for yet: from its own index, recovered
            index = self._store.restore().get(INDEX) if self.version is not None else None
            self._apply(got if index is None else {**got, INDEX: index})
            self._holds_shared = True

    def _shared_values(self) -> dict[str, np.ndarray]:
        """The values every rank holds alike, as arrays (local; views of the live values)."""
        return {name: a for name, a in self._capture().items() if not self._is_local(name)}

    def _is_local(self, name: str) -> bool:
        return name in self._local or name.split(".", 1)[0] in self._local

    def _own(self, name: str, handler: Handler) -> None:
        """A value the State keeps for itself (a model, the RNGs): committed, not in ``names()``."""
        if name in self._handlers:
            raise ConfigError(f"state value {name!r}: {type(self).__name__} keeps its own values under that name; "
                              "choose another")
        self._handlers[name] = handler

    def _capture(self) -> dict[str, np.ndarray]:
        labels = {name: handler.label for name, handler in self._handlers.items()}
        arrays = {INDEX: wire.split(labels, "the State's index")[0]}
        for name, handler in self._handlers.items():
            arrays.update(handler.capture(name))
        return arrays

    def _apply(self, arrays: Mapping[str, np.ndarray], adopting: bool = False) -> None:
        """Take the values in ``arrays`` (read-only views of the store), each through its handler;
        names without one get the handler their index names. ``adopting``: another rank's values,
        taken only where this rank has none of that name."""
        arrays = dict(arrays)
        index = arrays.pop(INDEX, None)
        labels: dict[str, str] = wire.join(index, lambda path, kind: None) if index is not None else {}
        for name, group in self._group(arrays, labels).items():
            handler = self._handlers.get(name)
            if handler is None:
                handler = self._handlers[name] = adopted(labels.get(name, "plain:numpy"), name, group)
                if not isinstance(handler, Held):
                    self._public.add(name)
            elif not adopting:
                handler.apply(name, group)

    def _group(self, arrays: Mapping[str, np.ndarray], labels: Mapping[str, str]) -> dict[str, dict[str, np.ndarray]]:
        """The arrays by the value they belong to: the longest dotted prefix that names a value."""
        groups: dict[str, dict[str, np.ndarray]] = {}
        for key, array in arrays.items():
            name = key
            while name not in self._handlers and name not in labels and "." in name:
                name = name.rsplit(".", 1)[0]
            if name not in self._handlers and name not in labels:
                name = key  # no index (an old version's arrays): a plain array
            groups.setdefault(name, {})[key] = array
        return groups

    def _fingerprints(self, arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
        """Each shared value's dtype, shape and checksum (local; XXH3, 4-5 GB/s per rank here)."""
        return {name: f"{a.dtype.str}:{list(a.shape)}:{checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8))}"
                for name, a in arrays.items() if not self._is_local(name)}

    def _gate(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The integrity gate before a version becomes current (collective: the commit's one exchange
        of fingerprints). Every rank reads the same documents to the same ``Verdict``: a NaN / Inf
        raises ``NonFinite`` everywhere (``elastic.run`` rolls back); ranks whose shared values
        differ from a strict majority's are fenced (they fail, the others recover and roll back, a
        replacement gets the majority's values); with no majority, ``CommitRejected`` everywhere.
        Cost: the fingerprints (XXH3, ~4-5 GB/s) and the non-finite scan (~13 GB/s) of this rank's
        share: its own values, and 1/size of those every rank holds alike (``my_share``)."""
        world = self._world
        sums = self._fingerprints(arrays)
        share = my_share({n: a for n, a in arrays.items() if n != INDEX}, list(sums), int(world.rank), world.size)
        document = {"digest": digest(sums), "seen": list(self._seen) if self._seen else None,
                    "values": nonfinite_values(share)}
        everyone = world.allgather(document)
        if any(d["digest"] != everyone[0]["digest"] for d in everyone):  # rare: which values, on whom
            everyone = [{**d, "sums": s} for d, s in zip(everyone, world.allgather(sums))]
        ranks = [int(r) for r in world.logical_ranks]
        found = verdict(everyone, ranks)
        if found.good:
            return
        version = self._next_version()
        if found.nonfinite:
            what = (f"a non-finite {found.nonfinite_what} at step {found.nonfinite_step}"
                    if found.nonfinite_step is not None else "no non-finite loss or gradient norm was recorded")
            values = f"; committed values holding NaN/Inf: {list(found.nonfinite_values)[:5]}" \
                if found.nonfinite_values else ""
            world.events.emit("integrity", verdict="nonfinite", version=version, step=found.nonfinite_step,
                              what=found.nonfinite_what, values=list(found.nonfinite_values))
            raise agreed(NonFinite(f"version {version} not committed: {what}{values}", found.nonfinite_step,
                                   found.nonfinite_values), final=False)
        if found.fenced:
            listed = "; ".join(f"logical rank {r}: {list(names)[:5]}" for r, names in found.differ.items())
            why = (f"integrity: values that must be equal differ from the majority's ({len(ranks) - len(found.fenced)} "
                   f"of {len(ranks)} ranks) on {listed}; fenced before version {version}")
            world.events.emit("integrity", verdict="fenced", version=version, ranks=list(found.fenced),
                              values={str(r): list(n) for r, n in found.differ.items()})
            if int(world.logical_rank) in found.fenced:
                world.job.fail("integrity", why)
            raise ProcessFailure(why)
        world.events.emit("integrity", verdict="no_majority", version=version, values=list(found.no_majority))
        bad: dict[str, list[int]] = {}
        for name in found.no_majority:
            first = everyone[0]["sums"].get(name)
            bad[name] = [r for r, doc in zip(ranks, everyone) if doc["sums"].get(name) != first]
        listed = "; ".join(f"{n!r} on logical ranks {r} differs from logical rank {ranks[0]}"
                           for n, r in list(bad.items())[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise agreed(CommitRejected(
            f"commit rejected, the last version is kept: state that must be equal across ranks differs: "
            f"{listed}{more}, and no majority of the {len(ranks)} ranks agrees on it (a rank that differs from a "
            "majority of 3 or more is replaced instead). Keep replicas in step (same seed, same all-reduced "
            "gradients), or name per-rank values in local=(...)"), final=False)

    def _roll_back(self, error: NonFinite, mode: str) -> None:
        """After ``NonFinite`` (agreed): roll every rank back to the last good version, dropping the
        offending step with ``skip``. Non-finite again before any commit since (the version passed
        the gate, but the corruption came before it): one version further back, while every rank
        keeps an older one (``keep_versions``); stop when nothing can help (collective only for
        that fall-back; the same on every rank)."""
        world = self._world
        step, again = error.step, bool(self._rollbacks)
        stop = None
        if mode == "stop":
            stop = "on_nonfinite='stop'"
        elif self._per_step:
            stop = ("per_step=True keeps no copy of the values every rank holds alike to roll back to: use "
                    "per_step=False to roll back past a non-finite step")
        elif mode == "skip" and step in self._dropped:
            stop = (f"step {step} was dropped but ran again: ask state.dropped(state.step + 1) at the top of the "
                    "loop and skip the step when it says so")
        elif len(self._rollbacks) >= world.job.settings.max_failures:
            stop = f"{len(self._rollbacks)} roll-backs in a row without a successful commit"
        if stop is not None:
            raise agreed(Unrecoverable(f"{error} ({stop})"))
        fallen = self._store.fall_back() if again else None
        if again and fallen is None:
            raise agreed(Unrecoverable(
                f"{error} (not finite again after the roll-back to version {self.version}, and no older version is "
                f"kept on every rank: keep_versions={self._store.keep}, and a failure keeps only the current one. The "
                "cause is not transient (data, learning rate): on_nonfinite='skip' drops the step; keep_versions=K "
                "goes back further)"))
        self._rollbacks.append(step)
        if mode == "skip" and step is not None:
            self._dropped.add(step)
        self.restore()
        world.events.emit("rolled_back", version=self.version, step=step, dropped=mode == "skip" and step is not None,
                          values=error.values, fallback=fallen is not None)
        _LOG.warning("[integrity] %s: rolled back to version %s%s%s", error, self.version,
                     " (one further: the last one did not help)" if fallen is not None else "",
                     f", step {step} dropped" if mode == "skip" and step is not None else "")


class TorchState(State):
    """Torch models, their optimizers, the RNG states and any scalars, committed together.

    ``model`` / ``optimizer`` are stored as ``model.*`` / ``optim.*``; more
    pairs go in ``modules={"name": (model, optimizer)}`` as ``name.model.*`` /
    ``name.optim.*`` (a rank hosting several pipeline stages, say). Model
    parameters and buffers and, unless ``shard_optimizer``, optimizer state
    must be equal on every rank (data parallel) unless named in ``local``;
    the RNG states (``rng.*``: torch, numpy, python) are per rank.
    Data-loader position is a scalar such as ``step`` (see ``GlobalBatches``).
    Each is a handler of its kind (``_handlers``: ``Module``, ``Stateful``,
    ``Rng``), like the program's values. After a shrink, a pair taken over
    from a removed rank is held as arrays until ``bind(name, model,
    optimizer)`` loads it (see ``unbound()``). With ``per_step=True`` every
    optimizer's ``step()`` is a recovery point (``step_point`` runs just before it).
    """

    def __init__(self, world: Group, *, model: Any = None, optimizer: Any = None,
                 modules: Mapping[str, tuple[Any, Any]] | None = None, shard_optimizer: bool = False,
                 replication: int = 2, local: tuple[str, ...] = (), chunk_bytes: int = 1 << 20,
                 adopt: Adopt | None = None, per_step: bool = False, keep_versions: int | None = None,
                 **values: Any) -> None:
        local = tuple(local) + ("rng",) + (("optim",) if shard_optimizer else ())
        if per_step and shard_optimizer:
            raise ConfigError("per_step=True with shard_optimizer=True: a step point comes before the optimizer "
                              "step, and a sharded optimizer's state changes in it, after the point; use "
                              "per_step=False (commit() every few steps) with a sharded optimizer")
        super().__init__(world, replication=replication, local=local, chunk_bytes=chunk_bytes, adopt=adopt,
                         per_step=per_step, keep_versions=keep_versions, **values)
        self._hooks: list[Any] = []  # the optimizers' step pre-hooks (per step)
        pairs = {"": (model, optimizer)} if model is not None or optimizer is not None else {}
        for name, (module, optim) in {**pairs, **(modules or {})}.items():
            self.bind(name, module, optim)
        self._own("rng", Rng())

    def bind(self, name: str, model: Any, optimizer: Any = None) -> None:
        """Host one more (model, optimizer) pair as ``name`` ("" for ``model`` / ``optimizer``),
        loading the values this rank took over for it, if any (local)."""
        pre = f"{name}." if name else ""
        for key, obj, handler in ((f"{pre}model", model, Module), (f"{pre}optim", optimizer, Stateful)):
            if obj is None:
                continue
            if key in self._public:
                raise ConfigError(f"state value {key!r} is the program's; TorchState keeps the model and the "
                                  "optimizer under that name: rename the value")
            held = self._handlers.get(key)
            self._handlers[key] = handler(obj)
            if isinstance(held, Held):
                self._handlers[key].apply(key, held.value)
            if handler is Stateful and self._per_step:
                if self._hooks:
                    raise ConfigError("per_step=True takes one optimizer: its step() is each step's recovery "
                                      "point; with more, make the TorchState with per_step=False, or a State "
                                      "with per_step=True and call state.step_point() before the first update")
                self._hooks.append(obj.register_step_pre_hook(lambda *_: self.step_point()))

    def unbound(self) -> list[str]:
        """Names of model/optimizer pairs this rank holds values of but no module for (adopted ones)."""
        return sorted(n.removesuffix(".model") for n, h in self._handlers.items()
                      if isinstance(h, Held) and h.label == Module.label and n.endswith(".model"))
