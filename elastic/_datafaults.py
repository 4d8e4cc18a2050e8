"""Injected data faults, a stage of the step's end: present only under a fault schedule.

``R@S:bitflip`` flips one bit of this rank's first shared floating array in the live value (a
silent corruption the integrity gate must find); ``R@S:slow=X`` makes the step's own work X times
longer (a straggler). ``R@S:nan`` lives where the gradients are reduced (``allreduce_gradients``).
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

import numpy as np

from elastic.comm import Group

from ._capture import is_local
from ._handlers import Handler


class DataFaults:
    def __init__(self, world: Group) -> None:
        self._world = world

    def step_ending(self, step: int, handlers: Mapping[str, Handler], local: frozenset[str],
                    own_work: Callable[[], float]) -> None:
        """Before the step's end is recorded (local)."""
        job = self._world.job
        if job.data_fault("bitflip"):
            self._flip_a_bit(step, handlers, local)
        slow = job.data_fault("slow")
        if slow:  # an injected straggler: X times this step's own work in all
            time.sleep((slow.factor - 1) * own_work())

    def _flip_a_bit(self, step: int, handlers: Mapping[str, Handler], local: frozenset[str]) -> None:
        """One bit of this rank's first shared floating array (a model's, where there is one)."""
        for name in sorted(handlers):
            handler = handlers[name]
            if is_local(name, local):  # the index is local too
                continue
            arrays = {k: np.array(a) for k, a in handler.capture(name).items()}
            floating = [k for k in sorted(arrays) if np.issubdtype(arrays[k].dtype, np.floating) and arrays[k].ndim]
            if not floating:
                continue
            bits = arrays[floating[0]].reshape(-1).view(np.uint8)
            bits[1] ^= 0x10  # a low mantissa bit of the first element: finite, small, silent
            handler.apply(name, arrays)
            self._world.events.emit("bitflip", value=floating[0], step=step)
            return


def data_faults(world: Group) -> DataFaults | None:
    """The stage when a fault schedule is set, else None."""
    return DataFaults(world) if world.job.settings.faults_scheduled else None
