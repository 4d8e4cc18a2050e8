"""examples/train.py with a real bug in the user's code, for the fault tests.

    FAULT=raise|exit|diverge|config FAULT_RANK=1 FAULT_STEP=12 [FAULT_ALWAYS=1] python tests/programs/faulty_train.py

Logical rank FAULT_RANK raises a ValueError (``raise``), calls ``sys.exit(3)``
(``exit``), perturbs its weights so that they differ from the other ranks'
(``diverge``) or asks the library for something it refuses (``config``: a batch
larger than the data set, a ``ConfigError``) when it computes step FAULT_STEP: only before the first recovery
(a transient fault), or every time with FAULT_ALWAYS=1 (a deterministic bug,
which a recovery replays).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import torch  # noqa: E402
import train  # noqa: E402  (examples/train.py)

import elastic  # noqa: E402

KIND, RANK, STEP = os.environ["FAULT"], int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_STEP"])
ALWAYS = os.environ.get("FAULT_ALWAYS") == "1"
_local_loss = train.local_loss


def local_loss(world, model, x, y, batches, step, args):
    if step == STEP and world.logical_rank == RANK and (ALWAYS or world.generation == 0):
        if KIND == "raise":
            raise ValueError(f"a bug in the user's code at step {step}")
        if KIND == "exit":
            sys.exit(3)
        if KIND == "config":
            elastic.GlobalBatches(num_samples=8, batch_size=16)
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
    return _local_loss(world, model, x, y, batches, step, args)


train.local_loss = local_loss
sys.exit(train.main())
