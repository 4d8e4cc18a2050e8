"""A state_dict's structure as a checked JSON document: what travels between peers instead of pickle.

``split`` takes tensors and numpy arrays out of a nested value (a
``state_dict()``, an RNG state) and describes the rest as JSON; ``join`` puts
them back. A structure may hold None, bool, int, float (inf and nan too), str,
lists, tuples and dicts whose keys are str or int; anything else is refused,
naming where it is. ``join`` accepts only what ``split`` writes, so a document
that came back from a peer can build nothing but those types (no code runs).
"""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from elastic.comm import ConfigError

SCHEMA = 1
_LEAVES = (type(None), bool, int, float, str)


def split(value: Any, where: str) -> tuple[np.ndarray, dict[str, Any]]:
    """(the JSON document as bytes, the tensors and arrays by path) of ``value`` (local).

    Raises:
        ConfigError: ``value`` holds something else than the types above; names ``where`` and the path.
    """
    leaves: dict[str, Any] = {}
    doc = {"schema": SCHEMA, "value": _encode(value, "", leaves, where)}
    return np.frombuffer(json.dumps(doc, separators=(",", ":")).encode(), np.uint8), leaves


def join(document: np.ndarray, leaf: Callable[[str, str], Any]) -> Any:
    """The value ``split`` described: ``leaf(path, kind)`` gives each tensor or array back (local).

    Raises:
        ConfigError: the document is not one ``split`` wrote.
    """
    try:
        doc = json.loads(document.tobytes())
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r}, expected {SCHEMA}")
        return _decode(doc["value"], leaf)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"a stored structure is not one this version wrote ({exc}): was the job "
                          "started with another ulfm-elastic?") from None


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
    if isinstance(value, (list, tuple)):
        encoded = [_encode(v, f"{path}.{i}" if path else str(i), leaves, where) for i, v in enumerate(value)]
        return encoded if isinstance(value, list) else {"tuple": encoded}
    raise ConfigError(f"{where}: {path or 'the value'} is a {type(value).__name__}; a stored structure holds "
                      "None, bool, int, float, str, lists, tuples, dicts, numpy arrays and torch tensors")


def is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def torch_kind(dtype: Any) -> str:
    """'torch:float32' for torch.float32: how a tensor's type is named in a structure and a State."""
    return "torch:" + str(dtype).removeprefix("torch.")


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
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise ValueError(f"unexpected node {str(node)[:80]}")
    if "dict" in node:
        return {_key(k): _decode(v, leaf) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(_decode(v, leaf) for v in node["tuple"])
    if "array" in node:
        kind = str(node["kind"])
        if kind != "numpy" and not kind.startswith("torch:"):
            raise ValueError(f"unknown array kind {kind!r}")
        return leaf(str(node["array"]), kind)
    if "scalar" in node:
        dtype = np.dtype(str(node["scalar"]))
        if dtype.kind not in "biufc":
            raise ValueError(f"a scalar of dtype {dtype}")
        return dtype.type(node["v"])
    raise ValueError(f"unexpected node {str(node)[:80]}")


def _key(key: Any) -> str | int:
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise ValueError(f"a key of type {type(key).__name__}")
    return key
