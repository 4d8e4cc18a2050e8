"""examples/train.py for the benchmarks that build its job outside its launcher (bench_ddp.py's
Gloo floor, bench_peers.py's peers' workers): imported without starting MPI (the module imports
mpi4py), with its default options."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def train_and_defaults() -> tuple[ModuleType, argparse.Namespace]:
    """examples/train.py's module and its options as given no arguments."""
    import mpi4py
    mpi4py.rc.initialize = False
    sys.path.insert(0, str(ROOT / "examples"))
    import train
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return train, parser.parse_args([])
