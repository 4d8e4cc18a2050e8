"""A short seeded chaos campaign (scripts/chaos.py): randomized real failures, no hang, no mismatch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.fault
RUNS, SEED = 10, 11


@pytest.mark.timeout(RUNS * 200)
def test_a_short_seeded_campaign_has_no_hang_and_no_mismatch():
    proc = subprocess.run([sys.executable, "scripts/chaos.py", "--runs", str(RUNS), "--seed", str(SEED)],
                          cwd=ROOT, capture_output=True, text=True, timeout=RUNS * 200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    header, values = proc.stdout.strip().splitlines()[-2:]
    totals = dict(zip(header.split(" | "), values.split(" | ")))
    assert totals["runs"] == str(RUNS) and totals["hang"] == "0" and totals["mismatch"] == "0", proc.stdout
    assert int(totals["finished correct"]) + int(totals["clear error"]) == RUNS
