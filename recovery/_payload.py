"""A rank's committed state as bytes: a payload (a header naming the fields, then their bytes).

The header is a ``wire`` document (never pickle: payloads come back from peers), padded so that
the first field starts aligned; the fields follow in order, the ``unreplicated`` ones (values
every rank holds alike, kept in the own payload only) last, so that what peers copy is one
prefix. A payload is one byte array, or the same as a list of arrays (the header, then each field
where the caller keeps it: ``_backing.CallerArrays``). Local, no communication.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
from elastic.comm import ConfigError, wire

# A payload: one byte array (header, then the fields), or the same as a list of arrays (the header,
# then each field where the caller keeps it: ``CallerArrays``).
Payload = np.ndarray | list[np.ndarray]
_ALIGN = 64  # the header is padded so that the fields start aligned


@dataclasses.dataclass(frozen=True)
class Field:
    owner: int            # logical rank whose state this is
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int           # in the payload
    nbytes: int


def segments(contents: Mapping[int, Mapping[str, Any]], unreplicated: frozenset[str] = frozenset()
             ) -> tuple[list[np.ndarray], int]:
    """The payload as a list of byte arrays: the header (naming the fields), then each field where
    it lies, the ``unreplicated`` ones last; and the size of what is replicated (all before those)."""
    items = sorted(((owner, name, _as_array(contents[owner][name], name)) for owner in contents
                    for name in contents[owner]), key=lambda item: (item[1] in unreplicated, item[0], item[1]))
    fields, offset, replicated = [], 0, 0
    for owner, name, array in items:
        fields.append(Field(owner, name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
        offset += array.nbytes
        replicated += 0 if name in unreplicated else array.nbytes
    header = _header(fields)
    return [header] + [a.reshape(-1).view(np.uint8) for _, _, a in items], header.nbytes + replicated


def _header(fields: list[Field]) -> np.ndarray:
    """The fields framed as a wire message, padded so that the first field starts aligned."""
    message = wire.encode([[f.owner, f.name, f.dtype, list(f.shape), f.offset, f.nbytes] for f in fields],
                          "a payload's header")
    header = np.zeros(-(-message.nbytes // _ALIGN) * _ALIGN, np.uint8)
    header[:message.nbytes] = message
    return header


def read_header(payload: Payload) -> list[Field]:
    if isinstance(payload, list):
        payload = payload[0]
    if payload.nbytes < 8:
        return []
    fields, framed = wire.decode_prefix(payload)
    size = -(-framed // _ALIGN) * _ALIGN
    return [Field(int(o), str(n), str(d), tuple(int(x) for x in s), int(off) + size, int(nb))
            for o, n, d, s, off, nb in fields]


def fields_of(payload: Payload, owner: int) -> dict[str, np.ndarray]:
    """``owner``'s fields in ``payload``, by name (read-only views)."""
    out = {}
    for i, f in enumerate(read_header(payload)):
        if f.owner == owner and (isinstance(payload, list) or f.offset + f.nbytes <= payload.nbytes):
            # (a payload fetched from peers ends where its unreplicated fields begin)
            data = payload[i + 1] if isinstance(payload, list) else payload[f.offset:f.offset + f.nbytes]
            view = data.view(f.dtype).reshape(f.shape)
            view.flags.writeable = False
            out[f.name] = view
    return out


def _as_array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
        value = value.get()  # cupy: through host memory (ULFM's ob1 PML does not move GPU buffers)
    elif hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()  # torch
    array = np.asarray(value)
    if array.dtype == object:
        raise ConfigError(f"state entry {name!r} is a {type(value).__name__}, not an array: "
                          "commit numpy arrays, torch tensors or cupy arrays (numbers as np.asarray(x))")
    return np.ascontiguousarray(array)  # sent from where it lies: one block per array
