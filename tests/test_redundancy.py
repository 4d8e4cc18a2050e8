"""Parity instead of copies (``--redundancy xor:K`` / ``rs:K+M``), with real kills under mpiexec --with-ft ulfm.

The program is examples/cg.py on 8 ranks (two groups of 4 on one host): each strip is rank-unique
state, every iteration a recovery point, and the iterate is bitwise the failure-free run's after a
spare or a shrink. The group and decode logic without MPI: tests/test_parity.py and test_sim.py.
"""
from __future__ import annotations

import pytest

from conftest import launch

pytestmark = pytest.mark.fault
CG = ("examples/cg.py", "--n", "64")


@pytest.fixture(scope="module")
def cg8(tmp_path_factory) -> dict:
    job = launch(tmp_path_factory.mktemp("reference"), 8, program=CG)
    assert job.rc == 0, job.output
    return job.result


@pytest.mark.parametrize("redundancy, args, inject", [
    ("xor:4", ("--spares", "2"), "1@20,6@20"),      # one member of each group at once
    ("rs:4+2", ("--spares", "2"), "1@20,2@20"),     # two of one group: Reed-Solomon's second parity
    ("xor:4", ("--rebuild", "shrink"), "5@20"),     # the adopter decodes the lost strips
    ("xor:4", ("--spares", "1"), "2@commit20"),     # inside the encode: the last version stands
])
def test_a_strip_kept_by_parity_comes_back_bitwise(tmp_path, cg8, redundancy, args, inject):
    job = launch(tmp_path, 8, *args, "--redundancy", redundancy, "--inject", inject, program=CG)
    assert job.rc == 0, job.output
    assert (job.result["x_sha256"], job.result["steps"]) == (cg8["x_sha256"], cg8["steps"])
    dead = sorted(int(entry.split("@")[0]) for entry in inject.split(","))
    recovered = job.of("store_recovered")
    assert recovered and all(e["dead"] == dead for e in recovered), recovered
    assert all(e["came_back"] == {str(d): "parity" for d in dead} for e in recovered), recovered
    committed = [e for e in job.of("committed") if e["gen"] == 0]
    assert committed and all(e["bytes_out"] > 0 for e in committed)  # the parity's traffic: no copies were made


def test_two_lost_members_of_an_xor_group_are_data_lost_naming_the_group_on_every_rank(tmp_path):
    job = launch(tmp_path, 8, "--spares", "2", "--redundancy", "xor:4", "--inject", "1@20,2@20", program=CG)
    assert job.rc == 1, job.output
    errors = [o for o in job.outcomes if o["status"] == "error"]
    assert len(errors) == 8 and {o["kind"] for o in errors} == {"DataLost"}, job.outcomes
    assert {o["message"] for o in errors} == {
        "state lost, more members of a parity group died than it survives (parity group [0, 1, 2, 3] (xor:4) lost "
        "logical ranks [1, 2]); choose rs:K+M with a larger M, copies:R, or spread ranks over more failure domains"}
    assert not job.has_result


def test_a_redundancy_that_cannot_be_read_is_refused_before_anything_starts(tmp_path):
    job = launch(tmp_path, 4, "--redundancy", "xor:1", program=CG)
    assert job.rc == 2 and "a parity group needs K > M >= 1" in job.output, job.output
