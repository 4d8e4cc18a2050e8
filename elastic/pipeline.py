"""Pipeline parallelism that loses a stage and goes on: the roll-forward loop and the stage rebuild.

Ways back for a lost stage:

* a replica: commit the stage with ``TorchState`` and let ``elastic.run`` bring it
  back from peers' memory (every rank rolls back to the commit; exact);
* no copy anywhere: ``roll_forward`` never rolls back. A step's update is applied
  only after a vote that every stage finished the step, so survivors never
  disagree; after a rebuild ``StageRebuild`` brings the lost stages back
  (``elastic.recovery.plan_mesh_recovery`` decides): from a live
  data-parallel twin where the pipeline is one of several replicas (a mesh,
  ``elastic.mesh``: exact), else from their neighbours (CheckFree, Blagoev et
  al., arXiv 2506.15461: the neighbours' blocks averaged by their last
  gradient norms; CheckFree+: an end stage as a copy of its swapped
  neighbour, which kept a copy of the end layer), and training goes on from
  the current step.

A stage is an ``nn.Module`` with ``body`` (its blocks: the same structure on
every stage), ``embed`` on the first stage and ``head`` on the last.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from elastic.comm import Group, LogicalRank, ProcessFailure, Role, Unrecoverable, World, agreed
from elastic.recovery import LR_BOOST, checkfree_average, plan_mesh_recovery, whole_replicas

from ._state import StepClock, TorchState

__all__ = ["roll_forward", "StageRebuild", "body_grad_norm", "stage_state", "host_stages", "LR_BOOST"]


def roll_forward(world: World, steps: int, compute: Callable[[int], float], apply: Callable[[int], None],
                 rebuild: Callable[[set[int]], int | None], after: Callable[[int], None] | None = None,
                 clock: StepClock | None = None) -> int:
    """Run steps until ``steps`` so that every update lands on every stage or on none (collective).

    Args:
        compute: forward and backward of step ``s`` on this rank's stages; returns the loss.
            A ``ProcessFailure`` inside is voted on: no stage applies that step.
        apply: the update of step ``s`` (the optimizer step; local), after the vote.
        rebuild: after a rebuild, brings back the stages of the logical ranks in ``lost`` (collective
            over the new world; a failure inside it adds the next rebuild's to them); returns the step
            to go on from, or None for the step the survivors were at.
        after: collective work once step ``s`` counts as done (``keep_end_copies``, a checkpoint).
        clock: records each step (events, progress line).

    Ends with ``world.finish()``; returns the steps done.
    """
    step = 0
    lost = {int(r) for r in world.last_rebuild.replaced} if world.last_rebuild else set()
    pending = world.role is Role.RECOVERED
    clock = clock or StepClock(world)
    clock.restart()
    while True:
        try:
            if pending:
                # Every rank learns where the others are and what to bring back: a newcomer knows only
                # its own rebuild, and one of an earlier, interrupted rebuild may not know the step yet.
                known = world.allgather((step, sorted(lost)))
                step, lost = max(k[0] for k in known), set().union(*(k[1] for k in known))
                world.fault_point(None, "restore")  # the lost stages are about to be brought back
                step = rebuild(lost) or step
                pending = False
                clock.restart()
            if step == steps:
                break
            world.fault_point(step)
            try:
                loss, ok = compute(step), True
            except ProcessFailure:
                loss, ok = float("nan"), False
                world.mpi.interrupt()  # peers waiting on this rank's messages must not wait for ever
            world.vote(ok, "a stage could not finish the step")
            apply(step)
            step += 1
            if after is not None:
                after(step)
            clock.step_done(step, loss, total=steps)
        except ProcessFailure:  # a failure during a rebuild leaves its stages to bring back too
            lost = (lost if pending else set()) | {int(r) for r in world.recover(clock.outlook).replaced}
            pending = True
    world.finish()
    return step


def stage_state(world: Group, stage: Any, optimizer: Any, **values: Any) -> TorchState:
    """The replica way back: this rank's stage and optimizer (and ``values``) in a ``TorchState``.

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
    """Brings lost stages back: from a live data-parallel twin (exact), else from their neighbours
    (CheckFree, CheckFree+), as ``elastic.recovery.plan_mesh_recovery`` decides; collective.

    Args:
        world: the world; stage ``s`` of data-parallel replica ``d`` lives on logical rank
            ``d * stages + s`` (a single pipeline: ``replicas=1``, stage ``s`` on logical rank ``s``;
            ``elastic.mesh.Mesh`` lays a mesh out alike).
        stages: pipeline depth S.
        plus: CheckFree+ (the end stages were trained in swapped order half the time; stages 1 and
            S-2 keep copies of the embedding and the head through ``keep_end_copies``).
        average_moments: also average the neighbours' Adam moments (beyond the paper, which starts
            the rebuilt stage with a fresh optimizer).
        replicas: data-parallel replicas of the pipeline (their stages kept equal by the program's
            gradient all-reduce, e.g. ``Mesh.allreduce_stage``).
    """

    def __init__(self, world: Group, stages: int, plus: bool = False, average_moments: bool = False,
                 replicas: int = 1) -> None:
        self.world, self.stages, self.plus, self.average_moments = world, stages, plus, average_moments
        self.replicas = replicas
        self.copies: dict[str, dict[str, np.ndarray]] = {}  # CheckFree+: the end layer this stage keeps

    def _current(self, logical: int) -> int:
        return self.world.logical_ranks.index(LogicalRank(logical))

    def _dropped(self) -> set[int]:
        """Replicas out of use: a shrink took one of their ranks (their stages are stale)."""
        present = {int(r) for r in self.world.logical_ranks}
        return set(range(self.replicas)) - set(whole_replicas(self.replicas, self.stages, present))

    def keep_end_copies(self, stage: Any, me: int) -> None:
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
                make_optimizer: Callable[[float], Any]) -> tuple[Any, float]:
        """Bring back the stages of the logical ranks in ``lost``: each from a live twin (its weights,
        optimizer state, last gradient norm and end-layer copies: bitwise), else CheckFree, else
        CheckFree+ for an end stage, else ``Unrecoverable`` naming the stages, on every rank alike
        (collective). ``me``: this rank's logical rank; ``make_optimizer(lr_factor)`` gives a stage
        rebuilt by CheckFree its fresh optimizer. Returns the optimizer and the gradient norm this
        rank goes on with."""
        try:
            plan = plan_mesh_recovery(self.replicas, self.stages, lost, self.plus, self._dropped())
        except Unrecoverable as exc:  # every rank plans from the same agreed rebuild: stop together
            raise agreed(exc) from None
        sends: dict[int, list] = {}
        for way in plan:
            if way.method == "twin" and me == way.sources[0]:
                sends.setdefault(self._current(way.rank), []).append(
                    (me, _arrays(stage), grad_norm, optimizer.state_dict(), self.copies))
            elif way.method != "twin" and me in way.sources:
                sends.setdefault(self._current(way.rank), []).append(
                    (me, _arrays(stage.body), grad_norm,
                     _moments(stage, optimizer) if self.average_moments else {}, self.copies))
        received = {item[0]: item[1:] for got in self.world.alltoall(sends) if got for item in got}
        for way in (w for w in plan if w.rank == me):
            moments: Any = {}
            if way.method == "twin":
                weights, grad_norm, state, copies = received[way.sources[0]]
                _load(stage, weights)
                optimizer.load_state_dict(state)
                self.copies = copies
            elif way.method == "checkfree":
                (b0, n0, m0, _), (b1, n1, m1, _) = received[way.sources[0]], received[way.sources[1]]
                _load(stage.body, checkfree_average(b0, b1, n0, n1))
                moments = checkfree_average(m0, m1, n0, n1) if m0 and m1 else {}
            else:  # checkfree+: the swapped neighbour's blocks, and the end layer it kept a copy of
                body, _, moments, copies = received[way.sources[0]]
                part = "embed" if way.stage == 0 else "head"
                _load(stage.body, body)
                _load(getattr(stage, part), copies[part])
            self.world.events.emit("stage_rebuilt", stage=way.stage, method=way.method, sources=list(way.sources),
                                   replica=me // self.stages, moments=bool(moments))
            if way.method != "twin":
                optimizer = make_optimizer(LR_BOOST)
                if moments:
                    _seed_moments(stage, optimizer, moments)
        return optimizer, grad_norm


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
