"""examples/train.py with step DROP_STEP dropped as the integrity gate drops one (``on_nonfinite="skip"``),
in a run without any fault: the reference a skipped step must equal bitwise.

    DROP_STEP=21 python tests/programs/drop_step.py --steps 40
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train  # noqa: E402  (examples/train.py)

import elastic  # noqa: E402

DROP = int(os.environ["DROP_STEP"])
_dropped = elastic.State.dropped
elastic.State.dropped = lambda self, step: step == DROP or _dropped(self, step)  # type: ignore[method-assign]
sys.exit(train.main())
