"""Pipeline parallelism that loses a stage and goes on: the roll-forward loop and the stage rebuild.

``roll_forward`` applies a step's update only after a vote that every stage
finished the step, so survivors never disagree on it; after a rebuild
``StageRebuild`` brings the lost stages back, in this order: from a live
data-parallel twin where the pipeline is one of several replicas (a mesh,
``elastic.mesh``: exact, at the current step); from the copies each rank
committed to a replicated store every few steps (every rank rolls back to
that commit: exact); for a stage whose copies died too, from its neighbours
(CheckFree, Blagoev et al., arXiv 2506.15461: the neighbours' blocks averaged
by their last gradient norms; CheckFree+: an end stage as a copy of its
swapped neighbour, which kept a copy of the end layer); else every rank stops
with ``Unrecoverable`` naming the stages (``elastic.recovery.plan_mesh_recovery``).

A pipeline can also run on ``elastic.run`` with its stages in a ``TorchState``
(``stage_state``): every rank rolls back to the last commit, and after a
shrink a surviving neighbour adopts the lost stage and hosts two (``host_stages``).

A stage is an ``nn.Module`` with ``body`` (its blocks: the same structure on
every stage), ``embed`` on the first stage and ``head`` on the last.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import numpy as np

from elastic.comm import Group, Outlook, ProcessFailure, Rebuild, Recoverable, Role, Unrecoverable, agreed
from elastic.comm.wire import message
from elastic.recovery import (LR_BOOST, Method, ReplicatedStore, checkfree_average, plan_mesh_recovery,
                              whole_replicas)

from ._handlers import Module, Stateful
from ._clock import StepClock
from ._driver import drive, check_streak, never_non_finite
from ._settings import Training
from ._torchstate import TorchState

__all__ = ["roll_forward", "StageRebuild", "Rebuilt", "body_grad_norm", "stage_state", "host_stages", "LR_BOOST"]


class Rebuilt(NamedTuple):
    """What ``StageRebuild.rebuild`` leaves this rank with."""

    optimizer: Any          # its stage's optimizer (a fresh one after CheckFree)
    grad_norm: float        # its stage's last gradient norm (a twin's, after a twin)
    resume: int | None      # the step to go on from (the commit's, after a roll-back), or None: the survivors'


@message
@dataclasses.dataclass(frozen=True)
class StagePayload:
    """What a source sends a stage being rebuilt: a twin its whole stage and optimizer state, a
    neighbour its blocks (``weights``) and, with ``average_moments``, its moments (``state``)."""

    source: int                                   # the sender's logical rank
    weights: dict[str, np.ndarray]
    grad_norm: float
    state: dict[str, Any]
    copies: dict[str, dict[str, np.ndarray]]      # CheckFree+: the end layer the sender kept


def roll_forward(world: Recoverable, steps: int, compute: Callable[[int], float], apply: Callable[[int], None],
                 rebuild: Callable[[set[int]], int | None], after: Callable[[int], None] | None = None,
                 clock: StepClock | None = None, max_failures: int | None = None) -> int:
    """Run steps until ``steps`` so that every update lands on every stage or on none (collective).

    Args:
        compute: forward and backward of step ``s`` on this rank's stages; returns the loss.
            A ``ProcessFailure`` inside is voted on: no stage applies that step.
        apply: the update of step ``s`` (the optimizer step; local), after the vote.
        rebuild: after a rebuild, brings back the stages of the logical ranks in ``lost`` (collective
            over the new world; a failure inside it adds the next rebuild's to them); returns the step
            to go on from (every rank rolled back to a copy), or None for the step the survivors were at.
        after: collective work once step ``s`` counts as done (``StageRebuild.after_step``, a checkpoint).
        clock: records each step (events, progress line).
        max_failures: failures in a row without a step every stage applied before the job stops
            (default: the training settings', ``ELASTIC_MAX_FAILURES``).

    The loop is ``elastic.run``'s driver with the pipeline's step policy: the data-plane aborts,
    ``max_failures`` and the ``resumed`` events hold alike. Ends with ``world.finish()``; returns
    the steps done.
    """
    limit = Training.of(world).max_failures if max_failures is None else max_failures
    return drive(world, _RollForward(world, steps, compute, apply, rebuild, after, clock or StepClock(world), limit))


class _RollForward:
    """``roll_forward``'s step policy: a vote before each update; after a rebuild, every rank learns
    the step and the stages to bring back, and ``rebuild`` brings them back."""

    def __init__(self, world: Recoverable, steps: int, compute: Callable[[int], float],
                 apply: Callable[[int], None], rebuild: Callable[[set[int]], int | None],
                 after: Callable[[int], None] | None, clock: StepClock, limit: int) -> None:
        self._world, self._steps, self._compute, self._apply = world, steps, compute, apply
        self._rebuild, self._after, self._clock, self._limit = rebuild, after, clock, limit
        self.step = 0
        self._lost = {int(r) for r in world.last_rebuild.replaced} if world.last_rebuild else set()
        self._pending = world.role is Role.RECOVERED  # stages to bring back before the next step
        self._applied_at = 0  # the generation of the last step every stage applied (failures in a row since)
        clock.restart()

    @property
    def outlook(self) -> Outlook:
        return self._clock.outlook

    def restore(self, rebuild: Rebuild | None) -> None:
        world = self._world
        # Every rank learns where the others are and what to bring back: a newcomer knows only its
        # own rebuild, and one of an earlier, interrupted rebuild may not know the step yet.
        known = world.allgather((self.step, sorted(self._lost), self._applied_at))
        self.step, self._lost = max(k[0] for k in known), set().union(*(k[1] for k in known))
        self._applied_at = max(k[2] for k in known)
        check_streak(rebuild, world.generation - self._applied_at, self._limit)
        world.fault_point(None, "restore")  # the lost stages are about to be brought back
        resume = self._rebuild(self._lost)
        self.step = self.step if resume is None else resume
        self._pending = False
        world.events.emit("resumed", version=None, step=self.step,
                          failures=world.generation - self._applied_at)
        self._clock.restart()

    def steps(self) -> int:
        world = self._world
        while self.step < self._steps:
            world.fault_point(self.step)
            try:
                loss, ok = self._compute(self.step), True
            except ProcessFailure:
                loss, ok = float("nan"), False
                world.interrupt()  # peers waiting on this rank's messages must not wait for ever
            world.vote(ok, "a stage could not finish the step")
            self._applied_at = world.generation
            self._apply(self.step)
            self.step += 1
            if self._after is not None:
                self._after(self.step)
            self._clock.step_done(self.step, loss, total=self._steps)
        world.finish()
        return self.step

    roll_back = staticmethod(never_non_finite)

    def failed(self, rebuild: Rebuild) -> None:
        # A failure while stages were brought back leaves their stages to bring back too.
        self._lost = (self._lost if self._pending else set()) | {int(r) for r in rebuild.replaced}
        self._pending = True


def stage_state(world: Recoverable, stage: Any, optimizer: Any, **values: Any) -> TorchState:
    """A pipeline on ``elastic.run``: this rank's stage and optimizer (and ``values``) in a ``TorchState``.

    Every stage's values are per rank (they differ across stages), and after a
    shrink a removed stage goes to a surviving neighbour (the one before it, if
    alive), which then hosts two stages; see ``host_stages``.
    """
    me = int(world.logical_rank)
    return TorchState(world, modules={f"s{me}": (stage, optimizer)}, local=tuple(f"s{s}" for s in range(
        world.job.initial_size)), adopt=lambda removed, survivors: {
            r: min(survivors, key=lambda s: (abs(s - r), s)) for r in removed}, **values)


def host_stages(state: TorchState, hosted: dict[int, Any], optimizers: dict[int, Any],
                make: Callable[[int], tuple[Any, Any]]) -> None:
    """Call at the top of the function ``elastic.run`` wraps (local): on a replacement, say which stage
    came back here; after a shrink, host the stages this rank adopted (``make(s)`` builds stage ``s``
    and its optimizer, which then load the adopted values)."""
    world = state.world
    if world.role is Role.RECOVERED:  # a spare or spawned process, in the generation it took over
        world.events.emit("stage_rebuilt", stage=int(world.logical_rank), method="replica", sources=[])
    for name in state.unbound():
        s = int(name[1:])
        hosted[s], optimizers[s] = make(s)
        state.bind(name, hosted[s], optimizers[s])
        world.events.emit("stage_rebuilt", stage=s, method="replica", sources=[], adopted=True)


def body_grad_norm(stage: Any) -> float:
    """L2 norm of the blocks' gradients, before any clipping (CheckFree's weight)."""
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in stage.body.parameters() if p.grad is not None))


class StageRebuild:
    """Brings lost stages back, in this order: from a live data-parallel twin (exact, at the current
    step); from the replicated store, every rank rolling back to the last commit (exact; with
    ``commit_every``); from their neighbours (CheckFree, CheckFree+), where no copy is left; else
    ``Unrecoverable`` naming the stages. ``elastic.recovery.plan_mesh_recovery`` decides between a
    twin and CheckFree; collective.

    Args:
        world: the world; stage ``s`` of data-parallel replica ``d`` lives on logical rank
            ``d * stages + s`` (a single pipeline: ``replicas=1``, stage ``s`` on logical rank ``s``;
            ``elastic.mesh.Mesh`` lays a mesh out alike).
        stages: pipeline depth S.
        plus: CheckFree+ (the end stages were trained in swapped order half the time; stages 1 and
            S-2 keep copies of the embedding and the head through ``after_step``).
        average_moments: also average the neighbours' Adam moments (beyond the paper, which starts
            the rebuilt stage with a fresh optimizer).
        replicas: data-parallel replicas of the pipeline (their stages kept equal by the program's
            gradient all-reduce, e.g. ``Mesh.allreduce_stage``).
        commit_every: every this many steps ``after_step`` commits each rank's stage (weights,
            optimizer, gradient norm, end-layer copies; the step is its version) to a ``ReplicatedStore`` in its
            peers' memory; 0: no copies (twins and CheckFree only).
    """

    def __init__(self, world: Group, stages: int, plus: bool = False, average_moments: bool = False,
                 replicas: int = 1, commit_every: int = 0) -> None:
        self.world, self.stages, self.plus, self.average_moments = world, stages, plus, average_moments
        self.replicas, self.commit_every = replicas, commit_every
        self.copies: dict[str, dict[str, np.ndarray]] = {}  # CheckFree+: the end layer this stage keeps
        self.store = ReplicatedStore(world) if commit_every else None
        # This generation's logical -> current rank table and replicas out of use, made once per
        # generation (as ``Mesh`` keeps its own): the end-layer copies read them every step.
        self._layout: tuple[int, dict[int, int], set[int]] = (-1, {}, set())

    def _generation(self) -> tuple[int, dict[int, int], set[int]]:
        if self._layout[0] != self.world.generation:
            where = {int(logical): rank for rank, logical in enumerate(self.world.logical_ranks)}
            dropped = set(range(self.replicas)) - set(whole_replicas(self.replicas, self.stages, where))
            self._layout = (self.world.generation, where, dropped)
        return self._layout

    def _current(self, logical: int) -> int:
        return self._generation()[1][logical]

    def _dropped(self) -> set[int]:
        """Replicas out of use: a shrink took one of their ranks (their stages are stale)."""
        return self._generation()[2]

    def after_step(self, step: int, stage: Any, optimizer: Any, grad_norm: float) -> None:
        """Once step ``step`` is done on every stage (collective; ``roll_forward``'s ``after``): the
        CheckFree+ end-layer copies, and every ``commit_every`` steps a commit to the store."""
        me = int(self.world.logical_rank)
        self._keep_end_copies(stage, me)
        if self.store is not None and step % self.commit_every == 0:
            arrays = {**Module(stage).capture("stage"), **Stateful(optimizer).capture("optim"),
                      "grad_norm": np.array([grad_norm])}
            arrays.update({f"copy.{part}.{k}": v for part, values in self.copies.items() for k, v in values.items()})
            self.store.commit(arrays, version=step)

    def _roll_back(self, stage: Any, optimizer: Any) -> float:
        """This rank's stage, optimizer and end-layer copies as the store's last version holds them
        (local); returns the gradient norm of that version."""
        assert self.store is not None
        arrays = self.store.restore()
        Module(stage).apply("stage", arrays)
        Stateful(optimizer).apply("optim", arrays)
        self.copies = {}
        for key, value in arrays.items():
            if key.startswith("copy."):
                part, name = key[len("copy."):].split(".", 1)
                self.copies.setdefault(part, {})[name] = value.copy()
        return float(arrays["grad_norm"][0])

    def _keep_end_copies(self, stage: Any, me: int) -> None:
        """CheckFree+: stage 1 keeps a copy of the embedding, stage S-2 of the head, in each replica
        (collective, after an update); ``me``: this rank's logical rank."""
        if not self.plus or self.stages < 3:
            return
        sends = {}
        base = me - me % self.stages  # the first logical rank of this rank's replica
        for part, owner, keeper in (("embed", 0, 1), ("head", self.stages - 1, self.stages - 2)):
            if me % self.stages == owner and me // self.stages not in self._dropped():
                sends[self._current(base + keeper)] = (part, _arrays(getattr(stage, part)))
        for got in self.world.alltoall(sends):
            if got is not None:
                self.copies[got[0]] = got[1]

    def rebuild(self, lost: set[int], me: int, stage: Any, optimizer: Any, grad_norm: float,
                make_optimizer: Callable[[float], Any]) -> Rebuilt:
        """Bring back the stages of the logical ranks in ``lost``, on every rank alike (collective):
        each from a live twin (its weights, optimizer state, last gradient norm and end-layer copies:
        bitwise); where one has none, every rank rolls back to the store's last commit, which brings
        back each lost stage that still has a copy (bitwise); CheckFree, or CheckFree+ for an end
        stage, for those that have neither; else ``Unrecoverable`` naming the stages. ``me``: this
        rank's logical rank; ``make_optimizer(lr_factor)`` gives a stage rebuilt by CheckFree its
        fresh optimizer. Returns what this rank goes on with (``Rebuilt``)."""
        resume = None
        plan, problem = self._plan(lost)
        # The store comes back on every rebuild (it must follow the world), and is used where a twin is not enough.
        if self.store is not None and self.store.recover(give_up=True) and \
                (problem is not None or any(way.method is not Method.TWIN for way in plan)):
            grad_norm, resume, plan, problem = self._from_store(lost, me, stage, optimizer, grad_norm)
        if problem is not None:  # every rank plans from the same agreed data: stop together
            raise agreed(problem)
        received = self._exchange(plan, me, stage, optimizer, grad_norm)
        for way in (w for w in plan if w.rank == me):
            optimizer, grad_norm = self._take(way, received, stage, optimizer, grad_norm, make_optimizer)
        return Rebuilt(optimizer, grad_norm, resume)

    def _from_store(self, lost: set[int], me: int, stage: Any, optimizer: Any, grad_norm: float
                    ) -> tuple[float, int | None, list[Any], Unrecoverable | None]:
        """Every rank back to the store's last commit (collective): the lost stages that kept a copy
        come back bitwise; returns the gradient norm, the step to resume at, and the plan for the
        stages that had none (from twins or neighbours at the commit)."""
        assert self.store is not None
        given_up = set(self.store.given_up)
        if me not in given_up:
            grad_norm = self._roll_back(stage, optimizer)
        resume = self.store.version  # the step it was committed at
        if me in lost - given_up and me // self.stages not in self._dropped():
            self.world.events.emit("stage_rebuilt", stage=me % self.stages, method="store", sources=[],
                                   replica=me // self.stages, moments=True, step=resume)
        plan, problem = self._plan(given_up)
        if problem is not None:
            problem = Unrecoverable(f"{problem} (and no copy of them was left in the store)")
        return grad_norm, resume, plan, problem

    def _exchange(self, plan: list[Any], me: int, stage: Any, optimizer: Any, grad_norm: float
                  ) -> dict[int, StagePayload]:
        """What each source sends to each stage being rebuilt (collective): a twin its whole stage, a
        neighbour its blocks (and its moments, with ``average_moments``); by source."""
        sends: dict[int, list[StagePayload]] = {}
        for way in plan:
            if way.method is Method.TWIN and me == way.sources[0]:
                payload = StagePayload(me, _arrays(stage), grad_norm, optimizer.state_dict(), self.copies)
            elif way.method is not Method.TWIN and me in way.sources:
                payload = StagePayload(me, _arrays(stage.body), grad_norm,
                                       _moments(stage, optimizer) if self.average_moments else {}, self.copies)
            else:
                continue
            sends.setdefault(self._current(way.rank), []).append(payload)
        return {p.source: p for got in self.world.alltoall(sends) if got for p in got}

    def _take(self, way: Any, received: dict[int, StagePayload], stage: Any, optimizer: Any, grad_norm: float,
              make_optimizer: Callable[[float], Any]) -> tuple[Any, float]:
        """This rank's stage from what its sources sent, by the plan's method (local)."""
        moments: Any = {}
        if way.method is Method.TWIN:
            twin = received[way.sources[0]]
            _load(stage, twin.weights)
            optimizer.load_state_dict(twin.state)
            self.copies, grad_norm = twin.copies, twin.grad_norm
        elif way.method is Method.CHECKFREE:
            a, b = received[way.sources[0]], received[way.sources[1]]
            _load(stage.body, checkfree_average(a.weights, b.weights, a.grad_norm, b.grad_norm))
            moments = checkfree_average(a.state, b.state, a.grad_norm, b.grad_norm) if a.state and b.state else {}
        else:  # CHECKFREE_PLUS: the swapped neighbour's blocks, and the end layer it kept a copy of
            swapped = received[way.sources[0]]
            _load(stage.body, swapped.weights)
            _load(getattr(stage, "embed" if way.stage == 0 else "head"), swapped.copies["embed" if way.stage == 0
                                                                                       else "head"])
            moments = swapped.state
        me = int(self.world.logical_rank)
        self.world.events.emit("stage_rebuilt", stage=way.stage, method=way.method.value, sources=list(way.sources),
                               replica=me // self.stages, moments=bool(moments))
        if way.method is not Method.TWIN:
            optimizer = make_optimizer(LR_BOOST)
            if moments:
                _seed_moments(stage, optimizer, moments)
        return optimizer, grad_norm

    def _plan(self, lost: set[int]) -> tuple[list[Any], Unrecoverable | None]:
        try:
            return plan_mesh_recovery(self.replicas, self.stages, lost, self.plus, self._dropped()), None
        except Unrecoverable as exc:
            return [], exc


def _arrays(module: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def _load(module: Any, values: dict[str, np.ndarray]) -> None:
    import torch
    module.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in values.items()})


def _moments(stage: Any, optimizer: Any) -> dict[str, np.ndarray]:
    """Adam's moments of the blocks, by parameter name (empty before the first step)."""
    out = {}
    for name, p in stage.body.named_parameters():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{name}:{key}"] = state[key].numpy().copy()
    return out


def _seed_moments(stage: Any, optimizer: Any, moments: dict[str, np.ndarray]) -> None:
    import torch
    for name, p in stage.body.named_parameters():
        if f"{name}:exp_avg" in moments:
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.from_numpy(moments[f"{name}:exp_avg"]),
                                  "exp_avg_sq": torch.from_numpy(moments[f"{name}:exp_avg_sq"])}
