"""Injected data faults, a stage of the step's end: present only under a fault schedule.

``R@S:bitflip`` flips one bit of this rank's first shared floating array (a silent corruption the
integrity gate must find); ``R@S:slow=X`` makes the step's own work X times longer (a straggler).
The stage changes nothing itself: it returns the step's record with the changed values, which the
State takes into its live ones, and with the longer own work. ``R@S:nan`` lives where the
gradients are reduced (``allreduce_gradients``).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from elastic.comm import Group

from ._capture import StepEnd


class DataFaults:
    def __init__(self, world: Group) -> None:
        self._world = world

    def step_ended(self, end: StepEnd) -> StepEnd | None:
        """The step ``end`` as this rank's armed data faults change it, or None (local)."""
        job, changed = self._world.job, end
        if job.data_fault("bitflip"):
            changed = self._flip_a_bit(changed)
        slow = job.data_fault("slow")
        if slow:  # an injected straggler: X times this step's own work in all
            time.sleep((slow.factor - 1) * end.own_work)
            changed = dataclasses.replace(changed, own_work=end.own_work * slow.factor)
        return None if changed is end else changed

    def _flip_a_bit(self, end: StepEnd) -> StepEnd:
        """One bit of this rank's first shared floating array (by name: a model's, where there is one)."""
        shared = end.capture.shared
        floating = [k for k in sorted(shared) if np.issubdtype(shared[k].dtype, np.floating) and shared[k].ndim]
        if not floating:
            return end
        flipped = np.array(shared[floating[0]])
        flipped.reshape(-1).view(np.uint8)[1] ^= 0x10  # a low mantissa bit of the first element: finite, small, silent
        self._world.events.emit("bitflip", value=floating[0], step=end.step)
        return dataclasses.replace(end, changed={**end.changed, floating[0]: flipped})
