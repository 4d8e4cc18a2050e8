"""Short seeded campaigns: randomized real failures from inside (scripts/chaos.py) and real signals from
outside (scripts/punish.py); no hang, no mismatch, no wrong result, nothing left behind."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.fault
RUNS, SEED = 5, 11


@pytest.mark.timeout(RUNS * 200)
@pytest.mark.parametrize("program, seed, runs", [("train", SEED, RUNS), ("zero1", 42, 3)])
def test_a_short_seeded_campaign_has_no_hang_and_no_mismatch(program, seed, runs):
    """``train``: the data-parallel example, commits every 5 steps; ``zero1``: ZeRO-1 whose shards
    are kept by twins, every step a recovery point (its runs take twice train's: three of them)."""
    proc = subprocess.run([sys.executable, "scripts/chaos.py", "--runs", str(runs), "--seed", str(seed),
                           "--program", program], cwd=ROOT, capture_output=True, text=True, timeout=runs * 200)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    header, values = proc.stdout.strip().splitlines()[-2:]
    totals = dict(zip(header.split(" | "), values.split(" | ")))
    assert totals["runs"] == str(runs) and totals["hang"] == "0" and totals["mismatch"] == "0", proc.stdout
    assert int(totals["finished correct"]) + int(totals["clear error"]) == runs


PUNISH_RUNS, PUNISH_SEED = 4, 6


@pytest.mark.timeout(PUNISH_RUNS * 200)
def test_a_short_seeded_external_campaign_has_no_hang_no_wrong_result_and_no_leftover():
    proc = subprocess.run([sys.executable, "scripts/punish.py", "--runs", str(PUNISH_RUNS), "--seed",
                           str(PUNISH_SEED)], cwd=ROOT, capture_output=True, text=True, timeout=PUNISH_RUNS * 200,
                          env={**os.environ, "ELASTIC_WARM_SERVER": ""})  # it signals each job's own warm process
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    header, values = proc.stdout.strip().splitlines()[-2:]
    totals = dict(zip(header.split(" | "), values.split(" | ")))
    assert totals["runs"] == str(PUNISH_RUNS) and totals["hang"] == "0" and totals["wrong"] == "0", proc.stdout
    assert int(totals["correct"]) + int(totals["clean stop"]) >= PUNISH_RUNS // 2, proc.stdout  # most signals hit


HALO_RUNS, HALO_SEED = 3, 12


@pytest.mark.timeout(HALO_RUNS * 120 + 120)
def test_a_halo_written_with_sendrecv_survives_neighbours_killed_at_random_steps():
    """``world.mpi.comm.Sendrecv`` posts the pair non-blocking: a neighbour killed while its peers
    are in the exchange ends theirs with a ProcessFailure (Open MPI's blocking Sendrecv has crashed
    survivors), and each run is bitwise the failure-free rod (scripts/halo_campaign.py, longer)."""
    proc = subprocess.run([sys.executable, "scripts/halo_campaign.py", "--runs", str(HALO_RUNS), "--seed",
                           str(HALO_SEED)], cwd=ROOT, capture_output=True, text=True, timeout=HALO_RUNS * 120 + 100)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"{HALO_RUNS} runs: {HALO_RUNS} correct, 0 crashes, 0 hangs, 0 wrong"
