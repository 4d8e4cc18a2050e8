"""examples/train.py with a real bug in the user's code, for the fault tests.

    FAULT=raise|exit|diverge|config|late FAULT_RANK=1 FAULT_STEP=12 [FAULT_ALWAYS=1] \
        python tests/programs/faulty_train.py

Logical rank FAULT_RANK raises a ValueError (``raise``), calls ``sys.exit(3)``
(``exit``), perturbs its weights so that they differ from the other ranks'
(``diverge``) or asks the library for something it refuses (``config``: a batch
larger than the data set, a ``ConfigError``) when it computes step FAULT_STEP: only before the first recovery
(a transient fault), or every time with FAULT_ALWAYS=1 (a deterministic bug,
which a recovery replays). ``late``: every rank adds the same error to a weight at step FAULT_STEP,
once per process (equal everywhere and finite: it passes the integrity gate and is committed), and
the loss it reports is NaN from four steps later while that error is in the model: a corruption
found late, which only a version from before it undoes. ``pause``: logical rank FAULT_RANK spends
half a second more in step FAULT_STEP, once (a GC pause: not a straggler). ``reshape``: every rank
keeps a buffer ``counts`` in its model, and logical rank FAULT_RANK gives it another shape at step
FAULT_STEP (a program error the integrity gate must refuse, not fence).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torch  # noqa: E402
import train  # noqa: E402  (examples/train.py)

import elastic  # noqa: E402

KIND, RANK, STEP = os.environ["FAULT"], int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_STEP"])
ALWAYS = os.environ.get("FAULT_ALWAYS") == "1"
_local_loss = train.local_loss
_late = []  # FAULT=late: the step it fired at, once per process


def local_loss(world, model, x, y, batches, step, args):
    if KIND == "late":
        if step == STEP and not _late:
            _late.append(step)
            with torch.no_grad():
                model[0].weight[0, 0] += 1024.0
        loss, samples = _local_loss(world, model, x, y, batches, step, args)
        return (float("nan") if step >= STEP + 4 and abs(float(model[0].weight[0, 0])) > 100 else loss), samples
    if KIND == "reshape" and not hasattr(model, "counts"):
        model.register_buffer("counts", torch.zeros(4))  # a value every rank holds alike (in the State)
    if step == STEP and world.logical_rank == RANK and (ALWAYS or world.generation == 0):
        if KIND == "reshape":
            model.counts = torch.zeros(2, 2)
            return _local_loss(world, model, x, y, batches, step, args)
        if KIND == "raise":
            raise ValueError(f"a bug in the user's code at step {step}")
        if KIND == "exit":
            sys.exit(3)
        if KIND == "config":
            elastic.GlobalBatches(num_samples=8, batch_size=16)
        if KIND == "pause":
            time.sleep(0.5)
            return _local_loss(world, model, x, y, batches, step, args)
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
    return _local_loss(world, model, x, y, batches, step, args)


train.local_loss = local_loss
sys.exit(train.main())
