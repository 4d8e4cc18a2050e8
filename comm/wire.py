"""What peers send each other: a checked JSON document with the arrays beside it, never pickle.

``split`` takes tensors and numpy arrays out of a nested value (a
``state_dict()``, an RNG state, a control message) and describes the rest as
JSON; ``join`` puts them back. ``encode`` / ``decode`` frame both into one
byte buffer: what the World's ``allgather``, ``bcast`` and ``alltoall`` and
every control message of a rebuild send (mpi4py's lowercase methods would
``pickle.loads`` what a peer sent).

A document may hold None, bool, int, float (inf and nan too), str, lists,
tuples, sets, dicts whose keys are str or int, numpy scalars, numpy arrays
and torch tensors, and the dataclasses registered with ``message`` (comm's
own control messages); anything else is refused, naming where it is.
``join`` and ``decode`` accept only what ``split`` and ``encode`` write, so a
document from a peer builds nothing but those types: no code runs. Pure: no
MPI, and torch is imported only to give back a tensor a peer sent.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ._errors import ConfigError, ProtocolError

if TYPE_CHECKING:
    import numpy as np
else:
    class _Numpy:
        """numpy, imported on first use: the sentinel, which must start fast (it starts every spawned
        replacement), reads its configuration through this module and never sends an array."""

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("numpy"), name)
    np = _Numpy()

SCHEMA = 1
_LEAVES = (type(None), bool, int, float, str)
_ALIGN = 16  # each array of a message starts at a multiple of this: views of any dtype are aligned
_MESSAGES: dict[str, type] = {}
T = TypeVar("T")


def message(cls: T) -> T:
    """Register a dataclass as something a document may hold: built again from its fields, by name."""
    assert dataclasses.is_dataclass(cls) and isinstance(cls, type)
    _MESSAGES[cls.__name__] = cls
    return cls


def split(value: Any, where: str) -> tuple[np.ndarray, dict[str, Any]]:
    """(the JSON document as bytes, the tensors and arrays by path) of ``value`` (local).

    Raises:
        ConfigError: ``value`` holds something else than the types above; names ``where`` and the path.
    """
    leaves: dict[str, Any] = {}
    doc = {"schema": SCHEMA, "value": _encode(value, "", leaves, where)}
    return np.frombuffer(_dumps(doc), np.uint8), leaves


def join(document: np.ndarray, leaf: Callable[[str, str], Any]) -> Any:
    """The value ``split`` described: ``leaf(path, kind)`` gives each tensor or array back (local).

    Raises:
        ConfigError: the document is not one ``split`` wrote.
    """
    try:
        doc = json.loads(document.tobytes())
        _check_schema(doc)
        return _decode(doc["value"], leaf)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _foreign("a stored structure", exc) from None


def encode(value: Any, where: str = "a message") -> np.ndarray:
    """``value`` as one byte buffer: 8 bytes of header length, the header (the document and where
    each array lies), then the arrays' bytes, each aligned. None is the empty buffer (local)."""
    if value is None:
        return np.empty(0, np.uint8)
    leaves: dict[str, Any] = {}
    body = _encode(value, "", leaves, where)
    table, blocks, offset = [], [], 0
    for path, array in leaves.items():
        kind, data = _raw(array)
        offset = -(-offset // _ALIGN) * _ALIGN
        table.append([path, kind, list(array.shape), offset, data.nbytes])
        blocks.append((offset, data))
        offset += data.nbytes
    text = _dumps({"schema": SCHEMA, "value": body, "arrays": table})
    start = -(-(8 + len(text)) // _ALIGN) * _ALIGN
    out = np.zeros(start + offset, np.uint8)
    out[:8] = np.frombuffer(len(text).to_bytes(8, "little"), np.uint8)
    out[8:8 + len(text)] = np.frombuffer(text, np.uint8)
    for at, data in blocks:
        out[start + at:start + at + data.nbytes] = data
    return out


def decode(buffer: np.ndarray) -> Any:
    """The value ``encode`` framed; its numpy arrays are views of ``buffer`` (local).

    Raises:
        ConfigError: the buffer is not one ``encode`` wrote.
    """
    if buffer.nbytes == 0:
        return None
    return decode_prefix(buffer)[0]


def decode_prefix(buffer: np.ndarray) -> tuple[Any, int]:
    """(the value, the bytes its message takes) of the message ``encode`` wrote at the start of
    ``buffer``, whatever follows it (local): a payload's header, say.

    Raises:
        ConfigError: the buffer does not start with one.
    """
    try:
        length = int.from_bytes(buffer[:8].tobytes(), "little")
        doc = json.loads(buffer[8:8 + length].tobytes())
        _check_schema(doc)
        start = -(-(8 + length) // _ALIGN) * _ALIGN
        arrays, end = {}, start
        for path, kind, shape, offset, nbytes in doc["arrays"]:
            if offset < 0 or start + offset + nbytes > buffer.nbytes:
                raise ValueError(f"array {path!r} lies outside the message")
            arrays[str(path)] = _from_raw(buffer[start + offset:start + offset + nbytes], str(kind),
                                          tuple(int(s) for s in shape))
            end = max(end, start + offset + nbytes)
        return _decode(doc["value"], lambda path, kind: arrays[path]), end
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _foreign("a message from a peer", exc) from None


def is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def torch_kind(dtype: Any) -> str:
    """'torch:float32' for torch.float32: how a tensor's type is named in a structure and a State."""
    return "torch:" + str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ the document
def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _check_schema(doc: Any) -> None:
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema {doc.get('schema')!r}, expected {SCHEMA}")


def _foreign(what: str, exc: Exception) -> ProtocolError:
    return ProtocolError(f"{what} is not one this version wrote ({exc}): was the job started with another "
                       "ulfm-elastic?")


def _encode(value: Any, path: str, leaves: dict[str, Any], where: str) -> Any:
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, np.generic):
        return {"scalar": value.dtype.str, "v": value.item()}
    if isinstance(value, np.ndarray) and value.dtype != object:
        return {"array": _leaf(path, value, leaves, where), "kind": "numpy"}
    if is_tensor(value):
        return {"array": _leaf(path, value, leaves, where), "kind": torch_kind(value.dtype)}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ConfigError(f"{where}: key {k!r} at {path or 'the top'} is a {type(k).__name__}; "
                                  "a stored structure's keys are str or int")
            items.append([k, _encode(v, f"{path}.{k}" if path else str(k), leaves, where)])
        return {"dict": items}
    if isinstance(value, (list, tuple, set, frozenset)):
        encoded = [_encode(v, f"{path}.{i}" if path else str(i), leaves, where) for i, v in enumerate(value)]
        return encoded if isinstance(value, list) else {"tuple" if isinstance(value, tuple) else "set": encoded}
    if type(value) in _MESSAGES.values():
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"message": type(value).__name__, "fields": _encode(fields, path, leaves, where)}
    raise ConfigError(f"{where}: {path or 'the value'} is a {type(value).__name__}; a stored structure holds "
                      "None, bool, int, float, str, lists, tuples, sets, dicts, numpy arrays and torch tensors")


def _leaf(path: str, value: Any, leaves: dict[str, Any], where: str) -> str:
    if path in leaves:  # keys 1 and "1" in one dict
        raise ConfigError(f"{where}: two entries at {path!r}; a stored structure's keys must differ as text")
    leaves[path] = value
    return path


def _decode(node: Any, leaf: Callable[[str, str], Any]) -> Any:
    if isinstance(node, _LEAVES):
        return node
    if isinstance(node, list):
        return [_decode(v, leaf) for v in node]
    if isinstance(node, dict) and len(node) in (1, 2):
        for kind, decode in _NODES.items():
            if kind in node:
                return decode(node, leaf)
    raise ValueError(f"unexpected node {str(node)[:80]}")


def _array(node: dict[str, Any], leaf: Callable[[str, str], Any]) -> Any:
    kind = str(node["kind"])
    if kind != "numpy" and not kind.startswith("torch:"):
        raise ValueError(f"unknown array kind {kind!r}")
    return leaf(str(node["array"]), kind)


def _scalar(node: dict[str, Any], leaf: Callable[[str, str], Any]) -> Any:
    dtype = np.dtype(str(node["scalar"]))
    if dtype.kind not in "biufc":
        raise ValueError(f"a scalar of dtype {dtype}")
    return dtype.type(node["v"])


def _message(node: dict[str, Any], leaf: Callable[[str, str], Any]) -> Any:
    cls = _MESSAGES.get(str(node["message"]))
    if cls is None:
        raise ValueError(f"unknown message type {node['message']!r}")
    return cls(**_decode(node["fields"], leaf))


# A structured node's kind (its first key) -> how it is built; nothing else is ever built.
_NODES: dict[str, Callable[[dict[str, Any], Callable[[str, str], Any]], Any]] = {
    "dict": lambda node, leaf: {_key(k): _decode(v, leaf) for k, v in node["dict"]},
    "tuple": lambda node, leaf: tuple(_decode(v, leaf) for v in node["tuple"]),
    "set": lambda node, leaf: {_decode(v, leaf) for v in node["set"]},  # an unhashable element: TypeError
    "array": _array,
    "scalar": _scalar,
    "message": _message,
}


def _key(key: Any) -> str | int:
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise ValueError(f"a key of type {type(key).__name__}")
    return key


# ------------------------------------------------------------------ arrays in a message
def _raw(value: Any) -> tuple[str, np.ndarray]:
    """(the kind with its dtype, the bytes) of an array or tensor leaf."""
    if is_tensor(value):
        flat = value.detach().cpu().contiguous().reshape(-1)
        import torch
        return torch_kind(value.dtype), flat.view(torch.uint8).numpy()
    array = np.ascontiguousarray(value)
    return "numpy:" + array.dtype.str, array.reshape(-1).view(np.uint8)


def _from_raw(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> Any:
    if kind.startswith("numpy:"):
        dtype = np.dtype(kind.removeprefix("numpy:"))
        if dtype.kind not in "biufc":
            raise ValueError(f"an array of dtype {dtype}")
        return data.view(dtype).reshape(shape)
    if kind.startswith("torch:"):
        torch = sys.modules.get("torch") or __import__("torch")
        tensor_type = getattr(torch, kind.removeprefix("torch:"), None)
        if not isinstance(tensor_type, torch.dtype):
            raise ValueError(f"unknown tensor type {kind!r}")
        return torch.from_numpy(data.copy()).view(tensor_type).reshape(shape)
    raise ValueError(f"unknown array kind {kind!r}")
