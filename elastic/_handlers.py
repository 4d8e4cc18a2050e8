"""How each kind of State value becomes arrays and comes back: one handler per kind.

A handler owns one name and every ``name.*`` below it: ``capture`` gives its
arrays under those names, ``apply`` takes them back (copied: the store's views
are read-only and reused). Kinds: a number, array or tensor (``Plain``); any
object with ``state_dict()`` / ``load_state_dict()`` (``Stateful``: a
scheduler, a GradScaler, an optimizer); a nested value of those (``Tree``: a
plain state_dict); a torch module, loaded into its own tensors in place
(``Module``); the torch / numpy / python RNG states (``Rng``); and values this
rank took over from a removed rank but has no object for yet (``Held``: a
pipeline stage until it is bound). Each handler names its kind (``label``):
the State commits the labels, so a rank that adopts another's values after a
shrink makes the same handlers for them. Structures travel as
``elastic.comm.wire`` documents, never pickle.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Mapping, cast

import numpy as np

from elastic.comm import ConfigError, wire
from elastic.comm.wire import is_tensor, torch_kind

_PY_SCALARS = (bool, int, float, complex)
STRUCTURE = ".__structure__"  # the name suffix of a structured value's JSON document


class Handler:
    """One State value's arrays (local). ``value``: what ``state[name]`` gives back."""

    label = ""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def capture(self, name: str) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        raise NotImplementedError


class Plain(Handler):
    """A number, numpy array or tensor: rolled back into the same array or tensor where it fits."""

    def __init__(self, value: Any, kind: str) -> None:
        super().__init__(value)
        self.kind, self.label = kind, f"plain:{kind}"

    def capture(self, name: str) -> dict[str, np.ndarray]:
        return {name: to_array(name, self.value)[0]}

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        array, current = arrays[name], self.value
        if self.kind == "numpy" and isinstance(current, np.ndarray) and current.flags.writeable and \
                current.shape == array.shape and current.dtype == array.dtype:
            current[...] = array
        elif self.kind.startswith("torch:") and is_tensor(current) and tuple(current.shape) == array.shape and \
                torch_kind(current.dtype) == self.kind:
            copy_into(current, array)
        else:
            self.value = from_array(array, self.kind)


class Stateful(Handler):
    """Anything with ``state_dict()`` and ``load_state_dict()``; its tensors are copied into the
    ones it has where they fit (an optimizer keeps its own)."""

    label = "stateful"

    def capture(self, name: str) -> dict[str, np.ndarray]:
        return split_value(name, self.value.state_dict())

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.value.load_state_dict(join_value(name, arrays, self.value.state_dict()))
        if hasattr(self.value, "param_groups"):
            _shard_like_params(self.value)


def _shard_like_params(optimizer: Any) -> None:
    """An optimizer's state loaded into one that had none yet (a replacement's, from its twin):
    each state tensor of a DTensor parameter (FSDP2, tensor parallel) becomes a DTensor laid out
    as the parameter, as the optimizer's own first step makes it (local: no communication)."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = optimizer.state.get(param, {})
            local = param.to_local()
            for key, value in state.items():
                if is_tensor(value) and not isinstance(value, DTensor) and value.shape == local.shape:
                    state[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                    shape=param.shape, stride=param.stride())


class Tree(Handler):
    """Dicts, lists and tuples of numbers, strings, arrays and tensors (a plain state_dict)."""

    label = "tree"

    def capture(self, name: str) -> dict[str, np.ndarray]:
        return split_value(name, self.value)

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.value = join_value(name, arrays, self.value)


class Module(Handler):
    """A torch module's state_dict, tensor by tensor under ``name.<key>``, loaded in place."""

    label = "module"

    def capture(self, name: str) -> dict[str, np.ndarray]:
        return {f"{name}.{key}": tensor_array(t) for key, t in self.value.state_dict().items()}

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        for key, tensor in self.value.state_dict().items():  # tensors that share the module's memory
            copy_into(tensor, arrays[f"{name}.{key}"])
        # Gradients are not state: a step cut short by a failure leaves some behind, and a loop
        # that zeroes them after optimizer.step() would add the next backward to them.
        for parameter in self.value.parameters():
            parameter.grad = None


class Rng(Handler):
    """This process's torch (CPU, and each CUDA device's once CUDA is in use), numpy and python
    random states."""

    label = "rng"

    def capture(self, name: str) -> dict[str, np.ndarray]:
        import torch
        arrays = {f"{name}.torch": torch.get_rng_state().numpy()}
        initialized = cast(Callable[[], bool], torch.cuda.is_initialized)  # untyped in torch
        if torch.cuda.is_available() and initialized():  # dropout on a GPU draws from these
            for i, device_state in enumerate(torch.cuda.get_rng_state_all()):
                arrays[f"{name}.cuda{i}"] = device_state.numpy()
        arrays.update(split_value(f"{name}.numpy", np.random.get_state()))
        arrays.update(split_value(f"{name}.python", random.getstate()))
        return arrays

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        import torch
        torch.set_rng_state(torch.from_numpy(np.array(arrays[f"{name}.torch"])))
        cuda = sorted((k for k in arrays if k.startswith(f"{name}.cuda")), key=lambda k: int(k[len(name) + 5:]))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.from_numpy(np.array(arrays[k])) for k in cuda])
        np.random.set_state(join_value(f"{name}.numpy", arrays))
        random.setstate(join_value(f"{name}.python", arrays))


class Held(Handler):
    """Arrays of an object this rank took over from a removed rank and has no object for yet:
    committed as they are until the program hands one over (``TorchState.bind``)."""

    def __init__(self, label: str, arrays: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self.label = label
        self.apply("", arrays)

    def capture(self, name: str) -> dict[str, np.ndarray]:
        return dict(self.value)

    def apply(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        self.value = {k: np.array(v) for k, v in arrays.items()}


def for_value(name: str, value: Any) -> Handler:
    """The handler for a value the program puts in a State (local).

    Raises:
        ConfigError: a value no handler takes, saying what to do.
    """
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return Stateful(value)
    if isinstance(value, (dict, list, tuple)):
        wire.split(value, f"state value {name!r}")  # refused here, when it is set, if it cannot be stored
        return Tree(value)
    return Plain(value, to_array(name, value)[1])


def adopted(label: str, name: str, arrays: Mapping[str, np.ndarray]) -> Handler:
    """The handler for values taken over from another rank, by the label it committed (local)."""
    if label.startswith("plain:"):
        kind = label.removeprefix("plain:")
        return Plain(from_array(arrays[name], kind), kind)
    if label == "tree":
        return Tree(join_value(name, arrays))
    return Held(label, arrays)  # an object only the program can make


def kind_of(name: str, value: Any) -> str:
    """'object', 'tree', or the array kind of a State value (local); see ``for_value``."""
    handler = for_value(name, value)
    return handler.kind if isinstance(handler, Plain) else "tree" if isinstance(handler, Tree) else "object"


def to_array(name: str, value: Any) -> tuple[np.ndarray, str]:
    """A number, numpy array or tensor as an array and the kind to give back on restore (local).

    Raises:
        ConfigError: the value is not a number, a numpy array or a torch tensor.
    """
    if isinstance(value, _PY_SCALARS) or isinstance(value, np.generic):
        return np.asarray(value), "python" if isinstance(value, _PY_SCALARS) else "numpy"
    if isinstance(value, np.ndarray) and value.dtype != object:
        return value, "numpy"
    if is_tensor(value):
        return tensor_array(value), torch_kind(value.dtype)
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


def tensor_array(tensor: Any) -> np.ndarray:
    """A CPU view of a tensor's bytes (no copy for contiguous CPU tensors; bfloat16 travels as int16).
    A GPU tensor is copied once, by DMA, into pinned host memory (torch's caching host allocator
    reuses it commit after commit), which the store then sends from: never through pageable memory."""
    import torch
    tensor = local(tensor).detach()
    if tensor.is_cuda:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)  # synchronous: the bytes are there when this returns
        tensor = host
    else:
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    array: np.ndarray = tensor.numpy()
    return array


def split_value(name: str, tree: Any) -> dict[str, np.ndarray]:
    """A nested value (a state_dict) as arrays: its structure as JSON under ``name.__structure__``,
    each tensor or array under ``name.<path>`` (local)."""
    doc, leaves = wire.split(tree, f"state value {name!r}")
    out = {f"{name}{STRUCTURE}": doc}
    for path, leaf in leaves.items():
        out[f"{name}.{path}"] = tensor_array(leaf) if is_tensor(leaf) else leaf
    return out


def join_value(name: str, arrays: Mapping[str, np.ndarray], current: Any = None) -> Any:
    """The inverse of ``split_value``: each tensor or array copied into ``current``'s at the same
    path where it still fits (an optimizer then keeps its own tensors), else new (local)."""
    have = wire.split(current, name)[1] if current is not None else {}

    def leaf(path: str, kind: str) -> Any:
        array, mine = arrays[f"{name}.{path}"], have.get(path)
        if kind.startswith("torch:") and mine is not None and is_tensor(mine) and \
                tuple(local(mine).shape) == array.shape and torch_kind(mine.dtype) == kind:
            copy_into(mine, array)
            return mine
        return from_array(array, kind)

    return wire.join(arrays[f"{name}{STRUCTURE}"], leaf)


def local(tensor: Any) -> Any:
    """A sharded tensor's (a ``DTensor``: FSDP2's parameters and their optimizer state) part on this
    rank, sharing its memory; any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def copy_into(tensor: Any, array: np.ndarray) -> None:
    """Copy a (read-only) array into a tensor's memory (a DTensor's local part), once: no
    intermediate copy."""
    import warnings

    import torch
    tensor = local(tensor)
    with warnings.catch_warnings():  # torch warns on read-only arrays; the array is only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(array)
    if tensor.dtype == torch.bfloat16:
        source = source.view(torch.bfloat16)
    if tensor.is_cuda:  # to the device by DMA from pinned memory: one host copy, into the staging buffer
        staging = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        staging.copy_(source)
        source = staging
    with torch.no_grad():
        tensor.copy_(source.reshape(tensor.shape))
