"""examples/train.py with unpickling forbidden, for the test that no peer data is unpickled.

``pickle.loads`` (and mpi4py's, which every lowercase method such as
``comm.bcast`` uses on what a peer sent) writes ``pickle-<pid>`` into the run
directory and raises: the test asserts that no process wrote one. Spawned
replacements run this file again, so they are watched too.
"""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

RUN_DIR = Path(os.environ["ELASTIC_RUN_DIR"])


def _forbidden(*args: object, **kwargs: object) -> object:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    (RUN_DIR / f"pickle-{os.getpid()}").write_text("pickle.loads was called")
    raise RuntimeError("pickle.loads on data from a peer")


pickle.loads = _forbidden  # type: ignore[assignment]
from mpi4py import MPI  # noqa: E402  (mpi4py keeps its own reference to the loader)

MPI.pickle.__init__(pickle.dumps, _forbidden)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train  # noqa: E402

sys.exit(train.main())
