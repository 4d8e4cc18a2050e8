"""A ``State``'s values by name, each through the handler of its kind: what a ``Capture`` is made
of, and what a roll-back's or another rank's arrays go back into (local, no communication).

Two kinds of names: the program's (``state[name]``, ``names()``) and the State's own (a
``TorchState``'s models, optimizers and RNGs). Each name's handler (``_handlers``) turns its
value into arrays under ``name`` and ``name.*`` and takes them back; the capture carries an index
of the handlers' labels, so a rank that takes values it has no handler for (a shrink's adopter)
makes the same kind.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from elastic.comm import ConfigError, wire

from ._capture import INDEX, Capture, is_local
from ._handlers import Handler, Held, adopted, for_value


class Values:
    """The handlers of one State (``owner``: its class's name, for the errors); ``local`` and
    ``twinned`` say which values may differ across ranks (the captures carry them)."""

    def __init__(self, owner: str, local: frozenset[str], twinned: frozenset[str]) -> None:
        self.owner = owner
        self.local, self.twinned = local | twinned | {INDEX}, twinned
        self.handlers: dict[str, Handler] = {}  # every value, the program's and the State's own
        self.public: set[str] = set()            # the program's: state[name], names()
        self.adopted: set[str] = set()           # values taken over from removed ranks (a shrink's)

    def set(self, name: str, value: Any) -> None:
        """The program's value ``name`` (``state[name] = value``)."""
        if name in self.handlers and name not in self.public:
            raise self._taken(name)
        self.handlers[name] = for_value(name, value)
        self.public.add(name)

    def own(self, name: str, handler: Handler) -> None:
        """A value the State keeps for itself (a model, the RNGs): committed, not in ``names()``."""
        if name in self.handlers:
            raise self._taken(name)
        self.handlers[name] = handler

    def _taken(self, name: str) -> ConfigError:
        return ConfigError(f"state value {name!r}: {self.owner} keeps its own values under that name; choose another")

    def is_local(self, name: str) -> bool:
        return is_local(name, self.local)

    def capture(self) -> Capture:
        """Every value as arrays, with the index of their handlers (views of the live values)."""
        labels = {name: handler.label for name, handler in self.handlers.items()}
        arrays = {INDEX: wire.split(labels, "the State's index")[0]}
        for name, handler in self.handlers.items():
            arrays.update(handler.capture(name))
        return Capture(arrays, self.local, self.twinned)

    def apply(self, arrays: Mapping[str, np.ndarray], adopting: bool = False) -> None:
        """Take the values in ``arrays`` (read-only views of the store), each through its handler;
        names without one get the handler their index names. ``adopting``: another rank's values,
        taken where this rank has none of that name or took that one over before (a roll-back
        of a value adopted since the last commit), never over a value of its own."""
        arrays = dict(arrays)
        index = arrays.pop(INDEX, None)
        labels: dict[str, str] = wire.join(index, lambda path, kind: None) if index is not None else {}
        for name, group in self._group(arrays, labels).items():
            handler = self.handlers.get(name)
            if handler is None:
                handler = self.handlers[name] = adopted(labels.get(name, "plain:numpy"), name, group)
                if not isinstance(handler, Held):
                    self.public.add(name)
                if adopting:
                    self.adopted.add(name)
            elif not adopting or name in self.adopted:
                handler.apply(name, group)

    def take_changed(self, changed: Mapping[str, np.ndarray]) -> None:
        """Arrays a stage of the step's end changed (a data fault's): each value they belong to takes
        its arrays again, with those."""
        for name, group in self._group(changed, {}).items():
            handler = self.handlers[name]
            handler.apply(name, {**handler.capture(name), **group})

    def _group(self, arrays: Mapping[str, np.ndarray], labels: Mapping[str, str]) -> dict[str, dict[str, np.ndarray]]:
        """The arrays by the value they belong to: the longest dotted prefix that names a value."""
        groups: dict[str, dict[str, np.ndarray]] = {}
        for key, array in arrays.items():
            name = key
            while name not in self.handlers and name not in labels and "." in name:
                name = name.rsplit(".", 1)[0]
            if name not in self.handlers and name not in labels:
                name = key  # no index (an old version's arrays): a plain array
            groups.setdefault(name, {})[key] = array
        return groups
