"""What scripts/bench_recovery.py makes of its floor jobs: the floor of a kill at a size.

Fixed runs, no job: the floor is the raw shrink plus the lost bytes at the p2p rate, so it grows
with the bytes whatever one size's own p2p reading was (the floor the issue found read 0.039 s
at 10 MB and 0.021 s at 128 MB)."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_recovery", ROOT / "scripts" / "bench_recovery.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)

MB = 1 << 20


def test_the_floor_is_the_shrink_plus_the_bytes_at_the_p2p_rate():
    # three floor jobs at 10 MB: shrinks of 40, 45 and 50 ms; 10 MB in 5, 4 and 6 ms (2.0, 2.5, 1.67 GB/s)
    runs = [{"shrunk": 0.040, "p2p": 0.005, "bytes": 10 * MB}, {"shrunk": 0.045, "p2p": 0.004, "bytes": 10 * MB},
            {"shrunk": 0.050, "p2p": 0.006, "bytes": 10 * MB}]
    assert bench.floor_seconds(runs, 10 * MB) == pytest.approx(0.045 + 0.005)
    assert bench.floor_seconds(runs, 128 * MB) == pytest.approx(0.045 + 128 / 10 * 0.005)


def test_the_floor_grows_with_the_bytes_whatever_each_sizes_p2p_read():
    # a 128 MB job whose p2p reading was fast and a 10 MB one whose reading was slow (one spell each):
    # the same runs give a larger floor for more bytes, and the 128 MB floor covers 128 MB at their rate
    runs = [{"shrunk": 0.046, "p2p": 0.039, "bytes": 10 * MB}, {"shrunk": 0.048, "p2p": 0.021, "bytes": 128 * MB},
            {"shrunk": 0.045, "p2p": 0.030, "bytes": 64 * MB}]
    floors = [bench.floor_seconds(runs, mb * MB) for mb in (1, 10, 64, 128, 512)]
    assert floors == sorted(floors) and len(set(floors)) == len(floors)
    assert floors[3] - floors[0] == pytest.approx(127 * MB / (64 * MB / 0.030))
