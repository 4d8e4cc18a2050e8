"""State that rolls back together: named values, committed to peers' memory, restored after a failure.

``State`` holds values by name, each through the handler of its kind
(``_handlers``); ``TorchState`` (``_torchstate``) adds a model, an optimizer
and the RNG states as three more handlers. Values every rank holds alike (the data-parallel model
and optimizer) are never copied to peers: each rank keeps its own roll-back
copy, and a replacement gets them from the survivors
(``elastic.recovery.share``). Rank-unique values (``local``: the RNG states, a
shard) are replicated through ``elastic.recovery.ReplicatedStore``.

At the step boundary ``State`` makes a frozen ``Capture`` of its values and the
stages take it, each one job in its own module: the integrity gate (``_gate``),
the recovery point (``_points``: every commit or every step), stragglers
(``_stragglers``) and injected data faults (``_datafaults``), the last two
present only when set. ``restore()`` rolls back, and after a shrink gives this
rank handlers for the values it took over. ``elastic.run`` calls the rest
(``_recover``, ``sync``, ``_roll_back``).
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Mapping

import numpy as np

from elastic.comm import ConfigError, Outlook, Recoverable, Unrecoverable, agreed, wire
from elastic.recovery import Adopt, NothingCommitted, ReplicatedStore, share

from ._capture import INDEX, Capture, is_local
from ._clock import StepClock
from ._datafaults import data_faults
from ._gate import Gate, TwinCheck, fingerprints
from ._handlers import Handler, Held, adopted, for_value
from ._integrity import NonFinite, digest
from ._points import Twins, recovery_point
from ._settings import OnNonFinite, Training
from ._stragglers import straggler_watch

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
        twins, twinned: sharded state held by twins (with ``per_step``): ``twinned`` names the
            values (or first dotted parts) that this rank's twins, ``twins.holders(rank)`` (an
            ``elastic.mesh.Mesh``: the replicas of a stage), hold alike and update alike every step (an
            optimizer shard). They are never copied at a step point; a replacement gets them from a
            live twin. Every twin of a shard dead at once: back to the program's last ``commit()``,
            else ``DataLost`` naming the shard. Without ``per_step`` they are committed as ``local``
            values are.
    """

    def __init__(self, world: Recoverable, *, replication: int = 2, local: tuple[str, ...] = (),
                 chunk_bytes: int = 1 << 20, adopt: Adopt | None = None, per_step: bool = False,
                 keep_versions: int | None = None, twins: Twins | None = None, twinned: tuple[str, ...] = (),
                 **values: Any) -> None:
        if (twins is None) != (not twinned):
            raise ConfigError("twins= and twinned= go together: twinned names the values a shard's twins hold "
                              "alike, twins (an elastic.mesh.Mesh) says which ranks those are")
        self._world = world
        settings = Training.of(world)
        keep = settings.keep_versions if keep_versions is None else keep_versions
        self._store = ReplicatedStore(world, replication=replication, chunk_bytes=chunk_bytes, keep=keep)
        self._point = recovery_point(world, per_step, twins, lambda: ReplicatedStore(
            world, replication=replication, chunk_bytes=chunk_bytes))
        self._holds_shared = False  # this rank's shared values are the job's (not on a fresh replacement)
        self._holds_twin = False    # and its twinned values its shard's
        self._adopt = adopt
        self._twinned = frozenset(twinned)
        self._local = frozenset(local) | self._twinned | {INDEX}
        self._handlers: dict[str, Handler] = {}  # every value, the program's and the State's own
        self._public: set[str] = set()            # the program's: state[name], names()
        self._clock = StepClock(world, settings)
        self._gate = Gate(world, settings.max_failures)
        self._gate_every = settings.gate_every if per_step else 0  # commit() runs the gate at every commit
        self._stragglers = straggler_watch(world, settings)
        self._twin_check = TwinCheck(world, twins.holders, settings.twin_check_every) \
            if twins is not None and settings.twin_check_every else None
        self._data_faults = data_faults(world)
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
    def world(self) -> Recoverable:
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
        self._commit(program=True)

    def _commit(self, program: bool) -> None:
        """``commit()``; ``program=False``: the job's start (``sync``) or end (``elastic.run``), which a
        recovery point may keep less of."""
        capture = self._capture()
        self._gate.check(capture, self._next_version())
        arrays, unreplicated = self._point.stored(capture)
        self._store.commit(arrays, self._next_version(), unreplicated=unreplicated)  # in the own payload only
        self._holds_shared = self._holds_twin = True
        self._point.committed(capture, program)
        self._gate.passed()

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
        capture = self._capture()
        # Every point is a version: its number is what every rank agrees on, a replacement included.
        gated = bool(self._gate_every) and self._next_version() % self._gate_every == 0
        if gated:  # the shared values' fingerprints and the losses seen, before the point is made current
            self._gate.check(capture, self._next_version())
        self._point.step_point(capture, lambda arrays: self._store.commit(arrays, self._next_version()))
        if gated:
            self._gate.passed()
        self._world.fault_point(self._world.job.step, "update")  # the step's update runs from here

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
        if any(is_local(name, self._twinned) for name in own):
            self._holds_twin = True  # committed with the rest (per_step=False)
        self._gate.forget()  # the steps it saw are undone
        if self._point.restores_shared:
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
        told = world.allgather((self.version, sorted(self._gate.dropped)))
        versions = [version for version, _ in told]
        self._gate.dropped.update(int(step) for _, dropped in told for step in dropped)  # a replacement learns them
        if len(set(versions)) != 1:
            raise agreed(Unrecoverable(f"ranks restored different versions {versions}: the store's agreement broke "
                                       "(a bug, please report it)"))
        if versions[0] is None:
            everyone = world.allgather(digest(fingerprints(self._capture().shared)))  # O(1) a rank
            first = everyone[world.job.first_survivor]
            differ = [int(r) for r, sums in zip(world.logical_ranks, everyone) if sums != first]
            if differ:
                self._share_to(differ)
            self._commit(program=False)
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
        self._point.step_ended()
        if self._twin_check is not None:
            self._twin_check.step_ended(step, lambda: self._capture().twin)
        self._gate.saw(step, loss, grad_norm)
        self._world.fault_point(step, implied=True)
        if self._data_faults is not None:
            self._data_faults.step_ending(step, self._handlers, self._local, self._clock.own_work)
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        own = self._clock.step_done(step, loss, total, **metrics)
        if self._stragglers is not None:
            self._stragglers.step_ended(step, own)

    def dropped(self, step: int) -> bool:
        """True when the integrity gate dropped the step that ends at ``step`` (the number
        ``record_step`` gets for it), with ``on_nonfinite="skip"`` (local). A loop that allows
        skipping asks at its top, ``if state.dropped(state.step + 1): state.step += 1; continue``:
        the step's batch is not used, nothing is computed or drawn from an RNG."""
        return step in self._gate.dropped

    # ------------------------------------------------------------ internals
    def _recover(self) -> None:
        """After ``World.recover()``: get lost state back from peers and roll back (collective)."""
        t0 = time.perf_counter()
        if not self._store.recover(adopt=self._adopt):
            return  # no version was ever committed: sync() starts over from the first survivor
        self._point.recover(self._adopt)
        self.restore()
        self._share()
        self._world.events.emit("state_restored", version=self.version, seconds=time.perf_counter() - t0,
                                bytes_moved=self._store.bytes_moved)

    def _share(self) -> None:
        """Give the values every rank holds alike to the ranks that lack them: replacements
        (collective)."""
        world = self._world
        ranks = [int(r) for r in world.logical_ranks]
        holds = world.allgather((self._holds_shared, self._holds_twin or not self._twinned))
        self._point.interrupted()
        lacking_twin = [r for r, (_, twin) in zip(ranks, holds) if not twin]
        orphans = self._point.orphans(world, lacking_twin)
        if orphans:  # every twin of some shard died: every rank back to the program's last commit, where a
            self._apply(self._point.last_commit(world, orphans))  # replacement gets its shard from the store
            self._gate.forget()
            self._holds_twin = True
            holds = [(shared, True) for shared, _ in holds]  # the shared values: a survivor's, rolled back
        lacking = [r for r, (shared, _) in zip(ranks, holds) if not shared]
        if lacking:
            self._share_to(lacking)
        lacking = [r for r, (_, twin) in zip(ranks, holds) if not twin]
        if lacking:
            got = self._point.share_twins(world, self._capture().twin, lacking)
            if got is not None:
                self._apply(got)
                self._holds_twin = True
        if orphans:  # the per-step point again, where the job now is
            self._store.commit(self._capture().unique, self._next_version())

    def _share_to(self, lacking: list[int]) -> None:
        """The shared values from the other active ranks to the logical ranks ``lacking`` (collective)."""
        mine = None if int(self._world.logical_rank) in lacking else self._capture().shared
        got = share(self._world, mine, lacking)
        if got is not None:  # the kinds of values it has no handler for yet: from its own index, recovered
            index = self._store.restore().get(INDEX) if self.version is not None else None
            self._apply(got if index is None else {**got, INDEX: index})
            self._holds_shared = True

    def _is_local(self, name: str) -> bool:
        return is_local(name, self._local)

    def _own(self, name: str, handler: Handler) -> None:
        """A value the State keeps for itself (a model, the RNGs): committed, not in ``names()``."""
        if name in self._handlers:
            raise ConfigError(f"state value {name!r}: {type(self).__name__} keeps its own values under that name; "
                              "choose another")
        self._handlers[name] = handler

    def _capture(self) -> Capture:
        """Every value as arrays, with the index of their handlers (local; views of the live values)."""
        labels = {name: handler.label for name, handler in self._handlers.items()}
        arrays = {INDEX: wire.split(labels, "the State's index")[0]}
        for name, handler in self._handlers.items():
            arrays.update(handler.capture(name))
        return Capture(arrays, self._local, self._twinned)

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

    def _roll_back(self, error: NonFinite, mode: OnNonFinite | str) -> None:
        """After ``NonFinite`` (agreed): the gate's answer (``Gate.roll_back``)."""
        self._gate.roll_back(error, OnNonFinite.of(mode), self._store, self.restore, self._point.why_no_roll_back)
