"""State that rolls back together: named values, committed to peers' memory, restored after a failure.

``State`` holds values by name, each through the handler of its kind
(``_values``, ``_handlers``); ``TorchState`` (``_torchstate``) adds a model, an optimizer
and the RNG states as three more handlers. Values every rank holds alike (the data-parallel model
and optimizer) are never copied to peers: each rank keeps its own roll-back
copy, and a replacement gets them from the survivors
(``elastic.recovery.share``). Rank-unique values (``local``: the RNG states, a
shard) are replicated through ``elastic.recovery.ReplicatedStore``.

At a commit ``State`` makes a frozen ``Capture`` of its values for the integrity
gate (``_gate``) and the recovery point (``_points``: every commit, every step,
twins); at the step's end a frozen ``StepEnd`` for the tuple of stages
``_stages`` builds, only those that apply. ``restore()`` rolls back, and after
a shrink gives this rank handlers for the values it took over; the recovery
point brings back what a rank still lacks. ``elastic.run`` calls the rest
(``_recover``, ``sync``, ``_roll_back``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Mapping

import numpy as np

from elastic.comm import ConfigError, Outlook, Recoverable, Unrecoverable, agreed
from elastic.recovery import Adopt, NothingCommitted, ParityStore, Redundancy, ReplicatedStore

from ._capture import INDEX, Capture, StepEnd
from ._clock import StepClock
from ._gate import Gate, fingerprints
from ._integrity import NonFinite, digest
from ._points import Into, Twins, give_shared, recovery_point
from ._settings import OnNonFinite, Training
from ._stages import stages
from ._values import Values


class State:
    """Named values that are committed and rolled back together. Create on every active rank.

    Values are reached as attributes (``state.step += 1``) or items
    (``state["adam.3.m"]``). Every value must be equal on all ranks at commit
    time, unless its name, or the part before its first dot, is in ``local``:
    a rank's RNG state or its optimizer shard, for example.

    Args:
        world: from ``elastic.init()``.
        replication: copies of each rank's committed state (2 survives any one failure).
        redundancy: instead, ``"copies:R"``, ``"xor:K"`` or ``"rs:K+M"`` (``Redundancy``): parity
            over groups of K ranks in place of copies, 1/(K-M) of the state per rank for M losses
            per group (default ``ELASTIC_REDUNDANCY``, else ``replication``'s copies).
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

    def __init__(self, world: Recoverable, *, replication: int | None = None, redundancy: str | None = None,
                 local: tuple[str, ...] = (), chunk_bytes: int = 1 << 20, adopt: Adopt | None = None,
                 per_step: bool = False, keep_versions: int | None = None, twins: Twins | None = None,
                 twinned: tuple[str, ...] = (), **values: Any) -> None:
        if (twins is None) != (not twinned):
            raise ConfigError("twins= and twinned= go together: twinned names the values a shard's twins hold "
                              "alike, twins (an elastic.mesh.Mesh) says which ranks those are")
        self._world = world
        settings = Training.of(world)
        keep = settings.keep_versions if keep_versions is None else keep_versions
        kept = _redundancy(replication, redundancy, settings.redundancy)
        if kept.parity and keep > 1:
            raise ConfigError(f"keep_versions={keep} with redundancy {kept}: older versions are kept as copies; "
                              "use copies:R, or keep_versions=1")

        def store(keep: int = 1) -> ReplicatedStore:
            if kept.parity:
                return ParityStore(world, kept, chunk_bytes=chunk_bytes)
            return ReplicatedStore(world, replication=kept.copies, chunk_bytes=chunk_bytes, keep=keep)
        self._store = store(keep)
        self._point = recovery_point(world, per_step, twins, store, adopt)
        self._adopt = adopt
        self._values = Values(type(self).__name__, frozenset(local), frozenset(twinned))
        self._clock = StepClock(world, settings)
        self._gate = Gate(world, settings.max_failures)
        self._gate_every = settings.gate_every if per_step else 0  # commit() runs the gate at every commit
        self._stages = stages(world, settings, self._point, self._gate, self._clock, twins)
        self._into = Into(self._capture, lambda: Capture(self._store.restore(), self._values.local,
                                                         self._values.twinned),
                          self._take, lambda arrays: self._store.commit(arrays, self._next_version()))
        for name, value in values.items():
            self[name] = value

    # ------------------------------------------------------------ values
    def __setitem__(self, name: str, value: Any) -> None:
        self._values.set(name, value)

    def __getitem__(self, name: str) -> Any:
        if name not in self._values.public:
            raise KeyError(name)
        return self._values.handlers[name].value

    def __delitem__(self, name: str) -> None:
        if name not in self._values.public:
            raise KeyError(name)
        self._values.public.discard(name)
        del self._values.handlers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values.public

    def names(self) -> Iterator[str]:
        return iter(sorted(self._values.public))

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values")
        if values is not None and name in values.public:
            return values.handlers[name].value
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
        self._point.step_point(capture, self._into.commit)
        if gated:
            self._gate.passed()
        self._world.fault_point(self._world.job.step, "update")  # the step's update runs from here

    def _next_version(self) -> int:
        return 0 if self.version is None else self.version + 1

    def restore(self) -> None:
        """Roll every value back to the last agreed version (local); with ``per_step``, the
        rank-unique values (the shared ones are their own recovery point). Values of removed ranks
        this rank took over after a shrink get handlers here, unless it has values of the same name
        (its own win). A value this rank's version lacks (a replacement's shared values, which are
        never replicated) is the recovery point's to bring back (``elastic.run`` has it do so)."""
        if self.version is None:
            raise NothingCommitted("nothing committed yet: elastic.run commits once before calling your function")
        for owner in self._store.owners_here():
            if owner != int(self._world.logical_rank):
                self._values.apply(self._store.restore_owner(owner), adopting=True)
        self._values.apply(self._store.restore())
        self._gate.forget()  # the steps it saw are undone

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
                give_shared(world, differ, self._into)
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
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        end = StepEnd(step, loss, grad_norm, total, metrics, self._clock.own_work(), self._capture)
        for stage in self._stages:
            changed = stage.step_ended(end)
            if changed is not None:
                self._values.take_changed(changed.changed)
                end = dataclasses.replace(changed, changed={})

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
        self._back()
        self._world.events.emit("state_restored", version=self.version, seconds=time.perf_counter() - t0,
                                bytes_moved=self._store.bytes_moved)

    def _back(self) -> None:
        """Every rank back to the current version, and what a rank still lacks of it brought back by
        the recovery point (collective)."""
        self.restore()
        self._point.bring_back(self._world, self._into)

    def _take(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Arrays another rank sent, or a roll-back's, into the live values; named by this rank's
        committed index where they come without one (a kind of value it has no handler for yet)."""
        if INDEX not in arrays and self.version is not None:
            arrays = {**arrays, INDEX: self._store.restore()[INDEX]}
        self._values.apply(arrays)

    def _is_local(self, name: str) -> bool:
        return self._values.is_local(name)

    def _capture(self) -> Capture:
        return self._values.capture()

    def _roll_back(self, error: NonFinite, mode: OnNonFinite | str) -> None:
        """After ``NonFinite`` (agreed): the gate's answer (``Gate.roll_back``)."""
        self._gate.roll_back(error, OnNonFinite.of(mode), self._store, self._back, self._point.why_no_roll_back)


def _redundancy(replication: int | None, redundancy: str | None, setting: str | None) -> Redundancy:
    """What ``State(replication=, redundancy=)`` asks for, else the job's setting, else 2 copies."""
    if replication is not None and redundancy is not None:
        raise ConfigError(f"State(replication={replication}, redundancy={redundancy!r}): give one of them "
                          f"(copies:{replication} is replication={replication})")
    if redundancy is not None:
        return Redundancy.parse(redundancy)
    if replication is not None:
        return Redundancy("copies", replication)
    return Redundancy.parse(setting) if setting else Redundancy("copies", 2)
