"""State that rolls back together: named values, committed to peers' memory, restored after a failure.

``State`` holds plain values (numbers, numpy arrays, torch tensors) by name;
``TorchState`` adds a model, an optimizer and the RNG states. ``commit()``
replicates through ``elastic.recovery.ReplicatedStore``; ``restore()`` rolls
back to the last commit. ``elastic.run`` calls the rest (``_recover``, ``sync``).
"""
from __future__ import annotations

import logging
import random
import time
from typing import Any, Iterator, Mapping

import numpy as np

from elastic.comm import ConfigError, Outlook, Unrecoverable, World, agreed
from elastic.comm import wire
from elastic.comm.wire import is_tensor as _is_tensor
from elastic.comm.wire import torch_kind as _torch_kind
from elastic.recovery import ReplicatedStore, checksum
from elastic.recovery._store import Adopt

_PY_SCALARS = (bool, int, float, complex)
_LOG = logging.getLogger("elastic")


def kind_of(name: str, value: Any) -> str:
    """How a State value is stored (local): 'object' (anything with state_dict() and
    load_state_dict(): a scheduler, a GradScaler, a sampler, a module), 'tree' (dicts, lists and
    tuples of numbers, strings, arrays and tensors: a plain state_dict), else an array's kind.

    Raises:
        ConfigError: none of those, saying what to do.
    """
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "object"
    if isinstance(value, (dict, list, tuple)):
        wire.split(value, f"state value {name!r}")  # refused here, when it is set, if it cannot be stored
        return "tree"
    return to_array(name, value)[1]


def to_array(name: str, value: Any) -> tuple[np.ndarray, str]:
    """A number, numpy array or tensor as an array and the kind to give back on restore (local).

    Raises:
        ConfigError: the value is not a number, a numpy array or a torch tensor.
    """
    if isinstance(value, _PY_SCALARS) or isinstance(value, np.generic):
        return np.asarray(value), "python" if isinstance(value, _PY_SCALARS) else "numpy"
    if isinstance(value, np.ndarray) and value.dtype != object:
        return value, "numpy"
    if _is_tensor(value):
        return _tensor_array(value), _torch_kind(value.dtype)
    raise ConfigError(f"state value {name!r} is a {type(value).__name__}: a State holds numbers, numpy arrays "
                      "and torch tensors, objects with state_dict() and load_state_dict(), and dicts and lists of "
                      "those; convert it (np.asarray(...)) or keep it outside the State")


def from_array(array: np.ndarray, kind: str) -> Any:
    """The inverse of ``to_array``: a new value of its own, never a view of ``array`` (local)."""
    if kind == "python":
        return array.item()
    if kind.startswith("torch:"):
        import torch
        tensor = torch.from_numpy(np.array(array))
        dtype = getattr(torch, kind.removeprefix("torch:"))
        return tensor.view(dtype) if tensor.dtype != dtype else tensor
    return np.array(array)


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

    def __init__(self, world: World) -> None:
        self._world = world
        self._last: float | None = None
        self._shown = time.monotonic()
        self.outlook = Outlook()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def step_done(self, step: int, loss: float | None = None, total: int | None = None, **metrics: Any) -> None:
        now = time.perf_counter()
        seconds = now - self._last if self._last is not None else 0.0
        self._last = now
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

    def _due(self, step: int, total: int | None) -> bool:
        config, now = self._world.config, time.monotonic()
        due = step == total or bool(config.progress_every and step % config.progress_every == 0) or \
            bool(config.progress_seconds and now - self._shown >= config.progress_seconds)
        if due:
            self._shown = now
        return due


def _tensor_array(tensor: Any) -> np.ndarray:
    """A CPU view of a tensor's bytes (no copy for contiguous CPU tensors; bfloat16 travels as int16)."""
    import torch
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


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
    """

    def __init__(self, world: World, *, replication: int = 2, local: tuple[str, ...] = (),
                 chunk_bytes: int = 1 << 20, adopt: Adopt | None = None, **values: Any) -> None:
        self._world = world
        self._store = ReplicatedStore(world, replication=replication, chunk_bytes=chunk_bytes)
        self._adopt = adopt
        self._local = frozenset(local)
        self._values: dict[str, Any] = {}
        self._kinds: dict[str, str] = {}
        self._clock = StepClock(world)
        for name, value in values.items():
            self[name] = value

    # ------------------------------------------------------------ values
    def __setitem__(self, name: str, value: Any) -> None:
        self._kinds[name] = kind_of(name, value)
        self._values[name] = value

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __delitem__(self, name: str) -> None:
        del self._values[name], self._kinds[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def names(self) -> Iterator[str]:
        return iter(sorted(self._values))

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"{type(self).__name__} has no value {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            object.__setattr__(self, name, value)  # the class's own attributes
        else:
            self[name] = value

    @property
    def world(self) -> World:
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
        self._check_shared(arrays)
        self._store.commit(arrays, 0 if self.version is None else self.version + 1)

    def restore(self) -> None:
        """Roll every value back to the last agreed version (local)."""
        if self.version is None:
            raise ConfigError("nothing committed yet: elastic.run commits once before calling your function")
        merged: dict[str, np.ndarray] = {}
        for owner in self._store.owners_here():  # own values win over adopted ones of the same name
            if owner != int(self._world.logical_rank):
                merged.update(self._store.restore_owner(owner))
        merged.update(self._store.restore())
        self._apply(merged)

    def sync(self) -> None:
        """Make every rank start from the same state (collective over the active ranks).

        The first time: every value that must be equal is taken from the
        first surviving rank, then committed as version 0. After a recovery:
        checks that every rank restored the same version.
        """
        world = self._world
        versions = world.allgather(self.version)
        if len(set(versions)) != 1:
            raise agreed(Unrecoverable(f"ranks restored different versions {versions}: the store's agreement broke "
                                       "(a bug, please report it)"))
        if versions[0] is None:
            shared = {k: v for k, v in self._capture().items() if not self._is_local(k)}
            self._apply(world.bcast(shared, root=world.first_survivor))
            self.commit()
        self._clock.restart()

    def record_step(self, step: int, loss: float | None = None, total: int | None = None, **metrics: Any) -> None:
        """Note that a training step finished (local); see ``StepClock.step_done``. ``loss`` is
        recorded as given, from rank 0: pass the global loss (reduce the ranks' shares first)."""
        self._world.progress(step)
        self._clock.step_done(step, loss, total, **metrics)

    # ------------------------------------------------------------ internals
    def _recover(self) -> None:
        """After ``World.recover()``: get lost state back from peers and roll back (collective)."""
        t0 = time.perf_counter()
        if not self._store.recover(adopt=self._adopt):
            return  # no version was ever committed: sync() starts over from the first survivor
        self.restore()
        self._world.events.emit("state_restored", version=self.version, seconds=time.perf_counter() - t0,
                                bytes_moved=self._store.bytes_moved)

    def _is_local(self, name: str) -> bool:
        return name in self._local or name.split(".", 1)[0] in self._local

    def _capture(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {}
        for name, value in self._values.items():
            kind = self._kinds[name]
            if kind == "object":
                arrays.update(_split_value(name, value.state_dict()))
            elif kind == "tree":
                arrays.update(_split_value(name, value))
            else:
                arrays[name] = to_array(name, value)[0]
        return arrays

    def _apply(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the values in ``arrays`` (read-only views of the store: copied, into the existing
        numpy arrays and tensors in place where the shape and type still fit)."""
        arrays = dict(arrays)
        for name in [k.removesuffix(_STRUCTURE) for k in arrays if k.endswith(_STRUCTURE)]:
            kind = self._kinds.get(name)
            if kind not in ("object", "tree"):
                continue  # not held here (adopted from a removed rank): kept as plain arrays
            mine = {k: arrays.pop(k) for k in [k for k in arrays if k.startswith(f"{name}.")]}
            current = self._values[name]
            if kind == "object":
                current.load_state_dict(_join_value(name, mine, current.state_dict()))
            else:
                self._values[name] = _join_value(name, mine, current)
        for name, array in arrays.items():
            kind = self._kinds.setdefault(name, "numpy")
            current = self._values.get(name)
            if kind == "numpy" and isinstance(current, np.ndarray) and current.flags.writeable and \
                    current.shape == array.shape and current.dtype == array.dtype:
                current[...] = array
            elif kind.startswith("torch:") and current is not None and _is_tensor(current) and \
                    tuple(current.shape) == array.shape and _torch_kind(current.dtype) == kind:
                _copy_into(current, array)
            else:
                self._values[name] = from_array(array, kind)

    def _check_shared(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Raise the same ConfigError on every rank when a value that must be equal differs (collective)."""
        world = self._world
        sums = {name: (a.dtype.str, a.shape, checksum(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
                for name, a in arrays.items() if not self._is_local(name)}
        everyone = world.allgather(sums)
        ranks = [int(r) for r in world.logical_ranks]
        bad: dict[str, list[int]] = {}
        for name in sorted(set().union(*everyone)):
            first = everyone[0].get(name)
            for rank, sums_of in zip(ranks, everyone):
                if sums_of.get(name) != first:
                    bad.setdefault(name, []).append(rank)
        if bad:
            listed = "; ".join(f"{n!r} on logical ranks {r} differs from logical rank {ranks[0]}"
                               for n, r in list(bad.items())[:5])
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise agreed(ConfigError(
                f"commit rejected, the last version is kept: state that must be equal across ranks differs: "
                f"{listed}{more}. Keep replicas in step (same seed, same all-reduced gradients), or name per-rank "
                "values in local=(...)"), final=False)


class TorchState(State):
    """Torch models, their optimizers, the RNG states and any scalars, committed together.

    ``model`` / ``optimizer`` are stored as ``model.*`` / ``optim.*``; more
    pairs go in ``modules={"name": (model, optimizer)}`` as ``name.model.*`` /
    ``name.optim.*`` (a rank hosting several pipeline stages, say). Model
    parameters and buffers and, unless ``shard_optimizer``, optimizer state
    must be equal on every rank (data parallel) unless named in ``local``;
    the RNG states (``rng.*``: torch, numpy, python) are per rank.
    Data-loader position is a scalar such as ``step`` (see ``GlobalBatches``).
    After a shrink, a pair adopted from a removed rank waits as plain arrays
    until ``bind(name, model, optimizer)`` loads it (see ``unbound()``).
    """

    def __init__(self, world: World, *, model: Any = None, optimizer: Any = None,
                 modules: Mapping[str, tuple[Any, Any]] | None = None, shard_optimizer: bool = False,
                 replication: int = 2, local: tuple[str, ...] = (), chunk_bytes: int = 1 << 20,
                 adopt: Adopt | None = None, **values: Any) -> None:
        local = tuple(local) + ("rng",) + (("optim",) if shard_optimizer else ())
        self._modules: dict[str, tuple[Any, Any]] = \
            {"": (model, optimizer)} if model is not None or optimizer is not None else {}
        self._modules.update(modules or {})
        super().__init__(world, replication=replication, local=local, chunk_bytes=chunk_bytes, adopt=adopt,
                         **values)

    def bind(self, name: str, model: Any, optimizer: Any = None) -> None:
        """Host one more (model, optimizer) pair as ``name``, loading its values if this rank holds them (local)."""
        self._modules[name] = (model, optimizer)
        pre = f"{name}."
        held = {k: self._values.pop(k) for k in [k for k in self._values if k.startswith(pre)]}
        for k in held:
            self._kinds.pop(k, None)
        if held:
            self._apply(held)

    def unbound(self) -> list[str]:
        """Names of model/optimizer pairs this rank holds values of but no module for (adopted ones)."""
        return sorted({k.split(".model.", 1)[0] for k in self._values if ".model." in k} - set(self._modules))

    def _capture(self) -> dict[str, np.ndarray]:
        import torch
        arrays = super()._capture()
        for name, (model, optimizer) in self._modules.items():
            pre = f"{name}." if name else ""
            if model is not None:
                for key, tensor in model.state_dict().items():
                    arrays[f"{pre}model.{key}"] = _tensor_array(tensor)
            if optimizer is not None:
                arrays.update(_split_value(f"{pre}optim", optimizer.state_dict()))
        arrays["rng.torch"] = torch.get_rng_state().numpy()
        arrays.update(_split_value("rng.numpy", np.random.get_state()))
        arrays.update(_split_value("rng.python", random.getstate()))
        return arrays

    def _apply(self, arrays: Mapping[str, np.ndarray]) -> None:
        import torch
        owned = lambda k: k.startswith("rng.") or any(  # noqa: E731
            k.startswith(f"{name}.model." if name else "model.") or k.startswith(f"{name}.optim." if name else "optim.")
            for name in self._modules)
        super()._apply({k: v for k, v in arrays.items() if not owned(k)})
        for name, (model, optimizer) in self._modules.items():
            pre = f"{name}." if name else ""
            if model is not None and any(k.startswith(f"{pre}model.") for k in arrays):  # absent when all local
                for key, tensor in model.state_dict().items():  # tensors that share the model's memory
                    _copy_into(tensor, arrays[f"{pre}model.{key}"])
            if optimizer is not None and f"{pre}optim{_STRUCTURE}" in arrays:
                optimizer.load_state_dict(_join_value(f"{pre}optim", arrays, optimizer.state_dict()))
        if "rng.torch" in arrays:
            torch.set_rng_state(torch.from_numpy(np.array(arrays["rng.torch"])))
            np.random.set_state(_join_value("rng.numpy", arrays))
            random.setstate(_join_value("rng.python", arrays))


_STRUCTURE = ".__structure__"  # the name suffix of a structured value's JSON document


def _split_value(name: str, tree: Any) -> dict[str, np.ndarray]:
    """A nested value (a state_dict) as arrays: its structure as JSON under ``name.__structure__``,
    each tensor or array under ``name.<path>`` (local)."""
    doc, leaves = wire.split(tree, f"state value {name!r}")
    out = {f"{name}{_STRUCTURE}": doc}
    for path, leaf in leaves.items():
        out[f"{name}.{path}"] = _tensor_array(leaf) if _is_tensor(leaf) else leaf
    return out


def _join_value(name: str, arrays: Mapping[str, np.ndarray], current: Any = None) -> Any:
    """The inverse of ``_split_value``: each tensor or array copied into ``current``'s at the same
    path where it still fits (an optimizer then keeps its own tensors), else new (local)."""
    have = wire.split(current, name)[1] if current is not None else {}

    def leaf(path: str, kind: str) -> Any:
        array, mine = arrays[f"{name}.{path}"], have.get(path)
        if kind.startswith("torch:") and mine is not None and _is_tensor(mine) and \
                tuple(mine.shape) == array.shape and _torch_kind(mine.dtype) == kind:
            _copy_into(mine, array)
            return mine
        return from_array(array, kind)

    return wire.join(arrays[f"{name}{_STRUCTURE}"], leaf)


def _copy_into(tensor: Any, array: np.ndarray) -> None:
    """Copy a (read-only) array into a tensor's memory, once: no intermediate copy."""
    import warnings

    import torch
    with warnings.catch_warnings():  # torch warns on read-only arrays; the array is only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(array)
    if tensor.dtype == torch.bfloat16:
        source = source.view(torch.bfloat16)
    with torch.no_grad():
        tensor.copy_(source.reshape(tensor.shape))
