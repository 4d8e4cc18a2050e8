"""examples/train.py, as a program that must not be forked from a warm process (one that initialises
CUDA as it imports, say) declares it: the line below makes the launcher start every rank cold."""
# elastic: cold-start
from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.argv[0] = str(Path(__file__).resolve().parents[2] / "examples" / "train.py")
sys.path.insert(0, str(Path(sys.argv[0]).parent))
runpy.run_path(sys.argv[0], run_name="__main__")
