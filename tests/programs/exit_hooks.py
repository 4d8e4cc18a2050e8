"""examples/train.py with the program's own atexit handler, for the lifecycle tests.

The handler is registered after ``import elastic`` and before ``elastic.init()``
(where a program sets up its logger or tracker) and writes
``atexit-<pid>`` into the run directory: it must run on every process that
leaves normally, survivors of a failure included.
"""
from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train  # noqa: E402  (examples/train.py; imports elastic)

RUN_DIR = Path(os.environ["ELASTIC_RUN_DIR"])
atexit.register(lambda: (RUN_DIR / f"atexit-{os.getpid()}").write_text("ran"))
sys.exit(train.main())
