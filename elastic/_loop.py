"""The loop users write against: init, run (save / restore / sync / reset), gradient all-reduce, batches."""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Any, Callable, Generic, Iterable, TypeVar

import numpy as np

from elastic.comm import Config, ConfigError, Group, Outlook, Rebuild, RebuildPolicy, Recoverable, Role, World
from elastic.comm import init as _comm_init
from elastic.recovery import Policy

from ._driver import check_streak, drive
from ._integrity import NonFinite
from ._settings import FIELDS, OnNonFinite, Training
from ._state import State

T = TypeVar("T")


def init(config: Config | None = None, *, policy: RebuildPolicy | None = None,
         rehearse: Callable[[], None] | bool | None = None, **settings: Any) -> World:
    """Join the resilient world (collective over every process of the job, blocking).

    Args:
        config: the job's settings (default ``Config.from_env()``: what the launcher set);
            keyword ``settings`` override single fields, of it (``spares=1``, ``run_dir=...``) or
            of the training settings (``keep_versions=2``, ``max_failures=5``: ``Training``).
        policy: how lost ranks are filled (default ``Policy.from_config(config)``: the
            launcher's ``--rebuild``, ``--min-size`` and the other policy settings).
        rehearse: a torch program's setup and first step, which a spare runs once before it
            parks on a rehearsal group of the job's size (``elastic._rehearsal``: its collectives
            move nothing): build and shard the model, make the optimizer, take a step, so what
            torch does on first use (FSDP2's and DTensor's set-up, each operator's first
            dispatch) is done when the spare is promoted. Active ranks never call it; one that
            raises is logged and the spare parks all the same. ``True``: the program itself
            (``elastic._rehearsal.rehearse_program``): the spare runs its file once more, as
            rank 0, up to its first step's end, its output discarded; what it does outside the
            World and torch (files it writes, a tracker it starts) happens there too.

    A parked spare returns from here only once promoted, as ``Role.RECOVERED``.
    """
    rehearsing = sys.modules.get("elastic._rehearsal")
    if rehearsing is not None and rehearsing.PROGRAM:  # a spare's rehearsal of this program: its mirror World
        return rehearsing.PROGRAM[0]
    training = {k: settings.pop(k) for k in list(settings) if k in FIELDS}
    config = Config.from_env(**settings) if config is None else config.replace(**settings)
    environ = {**os.environ, **Training.from_env(os.environ, **training).to_env()} if training else None
    if sys.modules.get("torch") is not None:  # (a program may block torch with None there)
        # A torch optimizer imports torch._dynamo when the first one is made (about a second): a program
        # that makes it after init (a pipeline stage's, which needs the logical rank) would have its
        # promoted spare pay that after the failure; every process pays it here instead, a spare
        # while it waits.
        import torch._dynamo  # noqa: F401

        from ._rehearsal import warm_loads_after_steps

        warm_loads_after_steps()  # a recovery's first load into a sharded model: decided before it
    world = _comm_init(config, policy=Policy.from_config(config) if policy is None else policy, environ=environ,
                       before_parking=functools.partial(_before_parking, rehearse))
    if rehearse is not None and world.role is Role.RECOVERED:  # a promoted spare: its place in what it rehearsed
        from ._rehearsal import take_place

        take_place(world.rank)
    if sys.modules.get("torch") is not None:
        from ._torchrun import serve_init_process_group

        serve_init_process_group(world)  # torch.distributed.init_process_group() makes the World's group
        if world.job.settings.faults_scheduled:
            _fire_update_in_optimizers(world)
    return world


def _before_parking(rehearse: Callable[[], None] | bool | None, world: Group) -> None:
    """What a spare does before it parks, so that its promotion does not: the imports of the rest of
    ``init`` (torch's: ~5 ms of the recovery on the 4-rank benchmark, every survivor waiting in the
    store's first collective for the promoted spare), and the program's rehearsal."""
    if sys.modules.get("torch") is not None:
        from . import _torchrun  # noqa: F401
    if rehearse is True:  # the program itself, up to its first step
        from ._rehearsal import program_file, rehearse_program

        _rehearse(lambda: rehearse_program(world.job.initial_size, program_file()), world)
    elif callable(rehearse):
        _rehearse(rehearse, world)


def _rehearse(rehearse: Callable[[], None], world: Group) -> None:
    from ._rehearsal import rehearse as run

    began = time.monotonic()
    try:
        run(world.job.initial_size, rehearse)
    except Exception as exc:  # the spare still parks: a promotion pays torch's first use instead
        logging.getLogger("elastic").warning("[elastic] the spare's rehearsal failed (%s: %s); it parks without one",
                                             type(exc).__name__, exc)
        world.events.emit("rehearsed", ok=False, seconds=time.monotonic() - began, error=repr(exc))
        return
    world.events.emit("rehearsed", ok=True, seconds=time.monotonic() - began)


_UPDATE_HOOK: list[Any] = []  # the handle of the one global hook of this process


def _fire_update_in_optimizers(world: Group) -> None:
    """Every torch optimizer's ``step()`` fires the ``update`` fault point of the World's step as
    it begins (``1@u20``: inside step 20's optimizer step), but one whose step is a per-step
    recovery point: that fires it once the point passed (``State.step_point``)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from ._torchstate import POINTED

    def fire(optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer not in POINTED:
            world.fault_point(world.job.step, "update")

    if not _UPDATE_HOOK:
        _UPDATE_HOOK.append(register_optimizer_step_pre_hook(fire))


def run(func: Callable[..., T] | None = None, *, max_failures: int | None = None,
        on_reset: Callable[[Any, Rebuild], None] | None = None, on_nonfinite: OnNonFinite | str | None = None) -> Any:
    """Decorate ``func(world, state, ...)`` so that it survives the loss of ranks.

    The contract, on every active rank: *sync* (everyone starts from the same
    committed state), call ``func``; on ``ProcessFailure`` *reset* (rebuild the
    world), *restore* (lost state from peers' memory, everyone rolls back to the
    last commit), *sync* again and call ``func`` once more, so ``func`` must
    resume from what ``state`` holds. When ``func`` returns, a final commit and
    ``world.finish()``. A promoted spare or a spawned process joins at *restore*.

    Args:
        max_failures: failures in a row without a successful commit before giving up
            (default: the configuration's, ``ELASTIC_MAX_FAILURES``, 3).
        on_reset: ``on_reset(world, rebuild)``, called on every active rank after each
            rebuild, restore and sync, before ``func`` is called again (a promoted spare or
            spawned process too): rebuild what lives outside the State there (a DataLoader and
            its iterator, a logger, a learning-rate scale for the new size). ``rebuild``
            says how (``mode``, ``failed``, ``replaced``, ``removed``); ``world.size`` the new size.
        on_nonfinite: what a NaN or an Inf at a commit does (the integrity gate, see
            ``State.record_step``): the version is never made current, and every rank rolls back
            to the last good one and runs the step again (``"rollback"``, the default:
            ``ELASTIC_ON_NONFINITE``), rolls back and drops the offending step (``"skip"``: the
            loop asks ``state.dropped``), or stops (``"stop"``). A step that is not finite again
            after a roll-back, or more roll-backs in a row than ``max_failures``, stops the job.
            ``on_reset`` is not called for these roll-backs: nothing was rebuilt.

    Raises:
        Unrecoverable: more failures than the policy or ``max_failures`` allow; the
            store's ``DataLost`` when every copy of some state died.
    """
    if func is None:
        return functools.partial(run, max_failures=max_failures, on_reset=on_reset, on_nonfinite=on_nonfinite)
    if max_failures is not None and max_failures < 0:
        raise ConfigError(f"max_failures={max_failures}: give a whole number >= 0")
    mode = None if on_nonfinite is None else OnNonFinite.of(on_nonfinite)

    @functools.wraps(func)
    def wrapper(world: Recoverable, state: State, *args: Any, **kwargs: Any) -> T:
        settings = Training.of(world)
        limit = settings.max_failures if max_failures is None else max_failures
        return drive(world, _Training(world, state, functools.partial(func, world, state, *args, **kwargs), limit,
                                      mode or settings.on_nonfinite, on_reset))

    return wrapper


class _Training(Generic[T]):
    """``elastic.run``'s step policy: *sync*, the program's function, a final commit; after a
    rebuild, *restore* (lost state from peers' memory, every rank back to the last commit) and
    *reset* (``on_reset``) before the function runs again."""

    def __init__(self, world: Recoverable, state: State, func: Callable[[], T], limit: int, mode: OnNonFinite,
                 on_reset: Callable[[Any, Rebuild], None] | None) -> None:
        self._world, self._state, self._func, self._limit = world, state, func, limit
        self._mode, self._on_reset = mode, on_reset
        self._resumed = False  # restored since the function last ran

    @property
    def outlook(self) -> Outlook:
        return self._state.outlook

    def restore(self, rebuild: Rebuild | None) -> None:
        check_streak(rebuild, rebuild.streak if rebuild else 0, self._limit)
        self._state._recover()
        self._resumed = True

    def steps(self) -> T:
        world, state = self._world, self._state
        state.sync()
        resumed, self._resumed = self._resumed, False
        if resumed and world.last_rebuild is not None:
            world.events.emit("resumed", version=state.version, failures=world.last_rebuild.streak)
            if self._on_reset is not None:
                self._on_reset(world, world.last_rebuild)
        try:
            result = self._func()
        except SystemExit as exc:  # sys.exit() on one rank is that rank's failure, with its code
            world.fail("SystemExit", f"sys.exit({exc.code!r}) before the training finished")
        state._commit(program=False)  # the job's end: a sharded job's twins need no copy of their shards
        world.finish()
        return result

    def roll_back(self, error: NonFinite) -> None:
        self._state._roll_back(error, self._mode)

    def failed(self, rebuild: Rebuild) -> None:
        pass  # the State knows what to bring back: the store's copies say


def allreduce_gradients(world: Group, model: Any, bucket_bytes: int = 4 << 20, step: int | None = None) -> None:
    """Sum every parameter's gradient over the active ranks (collective, blocking).

    Gradients are packed into buckets of about ``bucket_bytes`` and reduced
    with one non-blocking all-reduce per bucket, all in flight together.
    Losses should be scaled by the global batch size, so that the sum is the
    global mean whatever the number of ranks. ``step`` lets an injected
    ``collective`` fault fire while the reduction is in flight.
    """
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[Any]] = [[]]
    size = 0
    for p in params:
        if buckets[-1] and size + p.grad.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.grad.nbytes
    flats = [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in buckets if bucket]
    if world.job.data_fault("nan") and flats:  # an injected corruption (``R@S:nan``): this rank's share
        flats[0][0] = float("nan")
    world.allreduce([flat.numpy() for flat in flats], step=step)
    for bucket, flat in zip(buckets, flats):
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()


class GlobalBatches:
    """A deterministic sequence of global batches, the same whatever the number of ranks.

    Step ``s`` takes the samples at positions ``[s*B, (s+1)*B)`` of an endless
    walk through the data set, each epoch in the order of a permutation seeded
    by ``(seed, epoch)``. A rank's share is its slice of the global batch
    among the ranks of the current world, so after a shrink the global batch
    and its order stay as they were; only the per-rank share grows.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0) -> None:
        if not 0 < batch_size <= num_samples:
            raise ConfigError(f"batch_size={batch_size} with {num_samples} samples: need 0 < batch_size <= samples")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self._orders: dict[int, np.ndarray] = {}

    def batch(self, step: int) -> np.ndarray:
        """The sample indices of global batch ``step`` (local)."""
        start, wanted = step * self.batch_size, self.batch_size
        out: list[np.ndarray] = []
        while wanted:
            epoch, offset = divmod(start, self.num_samples)
            take = self._order(epoch)[offset:offset + wanted]
            out.append(take)
            start, wanted = start + len(take), wanted - len(take)
        return np.concatenate(out)

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation, drawn once: a step asks for it again (and a batch that
        crosses an epoch's end asks for two), and drawing it costs O(samples)."""
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # the walk only moves forward, except after a roll-back
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._orders[epoch]

    def shard(self, step: int, world: Group) -> np.ndarray:
        """This rank's part of global batch ``step`` (local; uneven when the size does not divide)."""
        return np.array_split(self.batch(step), world.size)[world.rank]


def micro_batches(indices: np.ndarray, max_size: int | None) -> Iterable[np.ndarray]:
    """Cut a rank's share into pieces of at most ``max_size`` for gradient accumulation (local)."""
    if not max_size or len(indices) <= max_size:
        yield indices
        return
    for start in range(0, len(indices), max_size):
        yield indices[start:start + max_size]


def device(world: Group) -> Any:
    """The torch device for this rank: ``cuda:<local rank % GPUs>`` where CUDA is present, else the
    CPU (local). Ask again after a rebuild: a rank's place on its host can change."""
    import torch
    if torch.cuda.is_available():
        return torch.device("cuda", world.job.local_rank % torch.cuda.device_count())
    return torch.device("cpu")
