"""Silent corruption and slow ranks (issue 29): the integrity gate at every commit, the roll-back
or the fence it leads to, and straggler eviction.

The gate's logic and the detector are tested in process; the rest under ``mpiexec --with-ft ulfm``
with injected data faults (``R@S:nan``, ``R@S:bitflip``, ``R@S:slow=X``): the recovered run is held
to the failure-free run bit for bit (with ``skip``, to a failure-free run that drops the same step).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_bitwise, fault, launch
from elastic._integrity import Stragglers, digest, my_share, nonfinite_values, verdict
from elastic.report import format_report

TRAIN = ("examples/train.py",)
FAULTY = ("tests/programs/faulty_train.py",)
DROP = ("tests/programs/drop_step.py",)


# ------------------------------------------------------------------ in process
def _doc(sums: dict[str, str], seen=None, values=()) -> dict:
    return {"digest": digest(sums), "sums": sums, "seen": seen, "values": list(values)}


def test_the_gate_fences_the_rank_that_differs_from_a_strict_majority():
    good, bad = {"w": "f4:[3]:1", "b": "f4:[1]:2"}, {"w": "f4:[3]:9", "b": "f4:[1]:2"}
    found = verdict([_doc(good), _doc(good), _doc(bad), _doc(good)], [0, 1, 2, 3])
    assert found.fenced == (2,) and dict(found.differ) == {2: ("w",)} and not found.nonfinite
    # The majority need not include rank 0.
    found = verdict([_doc({"w": "f4:[3]:7", "b": "f4:[1]:8"}), _doc(good), _doc(good)], [0, 1, 2])
    assert found.fenced == (0,) and dict(found.differ) == {0: ("b", "w")}
    assert verdict([_doc(good)] * 4, [0, 1, 2, 3]).good


def test_a_value_whose_name_dtype_or_shape_differs_is_a_program_error_not_a_corruption():
    """Bits flip, shapes do not: one rank reshaping a shared value, changing its dtype or missing it
    is refused (nobody fenced), whatever the majority, with the ranks of each structure named."""
    good = {"w": "<f4:[3, 4]:1", "b": "<f4:[1]:2"}
    reshaped = {"w": "<f4:[12]:1", "b": "<f4:[1]:2"}
    found = verdict([_doc(good), _doc(good), _doc(reshaped), _doc(good)], [0, 1, 2, 3])
    assert not found.fenced and not found.good
    assert {n: dict(k) for n, k in found.structure.items()} == {"w": {"<f4:[3, 4]": (0, 1, 3), "<f4:[12]": (2,)}}
    missing = verdict([_doc(good), _doc({"w": good["w"]}), _doc(good)], [0, 1, 2])
    assert {n: dict(k) for n, k in missing.structure.items()} == {"b": {"<f4:[1]": (0, 2), "missing": (1,)}}
    recast = verdict([_doc(good), _doc({**good, "b": "<f8:[1]:2"})], [0, 1])  # two ranks: still named, not a tie
    assert set(recast.structure) == {"b"} and not recast.no_majority


@pytest.mark.parametrize("docs", [
    [{"w": "1"}, {"w": "2"}],                             # two ranks: nobody can tell
    [{"w": "1"}, {"w": "1"}, {"w": "2"}, {"w": "2"}],     # a tie
    [{"w": "1"}, {"w": "2"}, {"w": "3"}],                 # all different
])
def test_the_gate_stops_where_no_strict_majority_agrees(docs):
    found = verdict([_doc(d) for d in docs], list(range(len(docs))))
    assert found.no_majority == ("w",) and not found.fenced and not found.good


def test_a_non_finite_step_or_value_wins_over_fingerprints_and_names_the_first_step():
    docs = [_doc({"w": "1"}, seen=[23, "loss"]), _doc({"w": "2"}, seen=[21, "grad_norm"]), _doc({"w": "1"}),
            _doc({"w": "1"}, values=["model.0.weight"])]
    found = verdict(docs, [0, 1, 2, 3])
    assert (found.nonfinite_step, found.nonfinite_what) == (21, "grad_norm")
    assert found.nonfinite_values == ("model.0.weight",)
    assert not found.fenced  # every rank took the same update: not one rank's fault


def test_the_non_finite_scan_names_values_and_is_not_fooled_by_an_overflowing_sum():
    big = np.full(1000, 1e30, np.float32)  # its dot product with itself overflows to inf: finite all the same
    arrays = {"ok": np.ones(10, np.float32), "big": big, "nan": np.array([1.0, np.nan]), "inf": np.array([-np.inf]),
              "half": np.array([np.inf], np.float16), "ints": np.arange(3), "loss": np.array(np.nan)}
    assert sorted(nonfinite_values(arrays)) == ["half", "inf", "nan"]  # a 0-d NaN is "none yet", not looked at


def test_each_value_every_rank_holds_alike_is_scanned_once_in_the_job_and_own_values_by_their_rank():
    arrays = {f"model.{i}": np.zeros(1000 * (i + 1), np.float32) for i in range(10)}
    arrays["rng.torch"] = np.zeros(5000, np.uint8)  # a rank's own value
    shared = [n for n in arrays if n.startswith("model.")]
    shares = [my_share(arrays, shared, rank, 4) for rank in range(4)]
    scanned = [n for share in shares for n in share if n in shared]
    assert sorted(scanned) == sorted(shared)                      # each once
    assert all("rng.torch" in share for share in shares)          # its own, on every rank
    sizes = [sum(a.nbytes for n, a in share.items() if n in shared) for share in shares]
    assert max(sizes) <= 1.2 * min(sizes), sizes                  # largest first, to the least loaded


def test_one_slow_step_is_never_a_straggler_a_streak_is():
    detector = Stragglers(factor=2.5, steps=3)
    fast = [1.0, 1.1, 0.9, 1.0]
    assert detector.observe(0, [0, 1, 2, 3], [1.0, 1.0, 9.0, 1.0]) is None  # a GC pause
    assert detector.observe(0, [0, 1, 2, 3], fast) is None                  # streak over
    for _ in range(2):
        assert detector.observe(0, [0, 1, 2, 3], [1.0, 1.0, 3.0, 1.0]) is None
    rank, ratio, median = detector.observe(0, [0, 1, 2, 3], [1.0, 1.0, 3.0, 1.0])
    assert (rank, round(ratio, 6), median) == (2, 3.0, 1.0)
    # A new generation (the rank was replaced) starts every streak again.
    assert detector.observe(1, [0, 1, 2, 3], [1.0, 1.0, 3.0, 1.0]) is None


# ------------------------------------------------------------------ real processes
def _verdicts(job) -> set[tuple]:
    return {(e["verdict"], e.get("step"), tuple(e.get("ranks", ()))) for e in job.of("integrity")}


@pytest.mark.fault
def test_a_nan_is_never_committed_and_a_rollback_runs_the_step_again_bitwise(tmp_path, reference):
    # A NaN in logical rank 1's gradients of step 21: after the all-reduce every rank's are NaN.
    job = launch(tmp_path, 4, "--inject", "1@20:nan", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    assert _verdicts(job) == {("nonfinite", 21, ())}
    back = job.of("rolled_back")
    assert len(back) == 4 and {(e["version"], e["step"], e["dropped"]) for e in back} == {(4, 21, False)}
    committed = {e["version"] for e in job.of("committed")}
    assert len([e for e in job.of("committed") if e["version"] == 5]) == 4 and max(committed) == 13
    assert job.statuses() == ["finished"] * 4 and not job.of("rebuilt")  # nothing died, nothing rebuilt
    report = format_report(job.run_dir)
    assert "version 5 not committed: a non-finite grad_norm at step 21" in report
    assert "rolled back to version 4, step 21 to run again" in report


@pytest.mark.fault
def test_a_nan_with_skip_drops_exactly_that_step_bitwise(tmp_path):
    ref = launch(tmp_path / "ref", 4, program=DROP, env={"DROP_STEP": "21"})
    assert ref.rc == 0, ref.output
    job = launch(tmp_path / "job", 4, "--inject", "1@20:nan", program=TRAIN, env={"ELASTIC_ON_NONFINITE": "skip"})
    assert_bitwise(job, {"result": ref.result}, "optimizer_sha256")
    assert {(e["version"], e["step"], e["dropped"]) for e in job.of("rolled_back")} == {(4, 21, True)}
    back = min(e["t"] for e in job.of("rolled_back"))
    again = {e["step"] for e in job.of("step") if e["t"] > back}  # rank 0's steps after the roll-back
    assert 21 not in again and {22, 23} <= again  # back to version 4 (step 20), step 21 not run


@pytest.mark.fault
def test_a_corruption_found_late_falls_back_to_the_kept_version_before_it_bitwise(tmp_path, reference):
    # Every rank corrupts a weight alike at step 12 (finite, equal: committed at step 15); the loss
    # is NaN from step 16. Back to step 15's version: NaN again; back to step 10's: clean.
    job = launch(tmp_path, 4, program=FAULTY, env={**fault("late", step=11), "ELASTIC_KEEP_VERSIONS": "2"})
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    back = [(e["version"], e["step"], e["fallback"]) for e in job.of("rolled_back")]
    assert len(back) == 8 and sorted(set(back), reverse=True) == [(3, 16, False), (2, 16, True)]
    assert job.statuses() == ["finished"] * 4 and not job.of("rebuilt")
    assert "rolled back to version 2 (one further back: the last one did not help)" in format_report(job.run_dir)


@pytest.mark.fault
def test_a_bit_flip_on_one_of_four_ranks_is_fenced_and_the_spare_makes_it_bitwise(tmp_path, reference):
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "2@12:bitflip", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    (flip,) = job.of("bitflip")
    assert flip["logical"] == 2 and flip["value"].startswith("model.")
    assert _verdicts(job) == {("fenced", None, (2,))}
    assert {tuple(v) for e in job.of("integrity") for v in e["values"].values()} == {(flip["value"],)}
    (rebuilt,) = {(e["mode"], tuple(e["failed"])) for e in job.of("rebuilt")}
    assert rebuilt == ("spare", (2,))
    (fenced,) = [o for o in job.outcomes if o["status"] == "failed"]
    assert fenced["logical"] == 2 and fenced["kind"] == "integrity" and flip["value"] in fenced["message"]
    assert f"fenced, differing from the majority (logical rank 2: {flip['value']})" in format_report(job.run_dir)


@pytest.mark.fault
def test_a_bit_flip_with_two_ranks_stops_every_process_naming_the_value(tmp_path):
    """No majority to take the value from: the commit is refused with one message on every rank,
    the parked spare is released, nobody is killed."""
    job = launch(tmp_path, 2, "--spares", "1", "--inject", "1@12:bitflip", program=TRAIN)
    assert job.rc == 1, job.output
    assert job.statuses() == ["error"] * 2 + ["spare-unused"]
    assert not any(f["end"] != "exited" for f in job.fates)  # nobody was killed: they left together
    (message,) = {o["message"] for o in job.outcomes if o["status"] == "error"}
    (flip,) = job.of("bitflip")
    assert f"'{flip['value']}' on logical ranks [1] differs" in message and "last version is kept" in message
    assert "no majority of the 2 ranks" in message and not job.has_result


@pytest.mark.fault
def test_one_rank_reshaping_a_shared_value_stops_every_rank_naming_it_and_fences_nobody(tmp_path):
    """A shape cannot flip: logical rank 1 giving a buffer of its model another shape is the
    program's error, refused at the next commit on every rank with the value and the ranks named;
    nobody is fenced, the spare is not spent, exit 1."""
    job = launch(tmp_path, 4, "--spares", "1", program=FAULTY, env=fault("reshape"))
    assert job.rc == 1, job.output
    assert job.statuses() == ["error"] * 4 + ["spare-unused"] and not job.of("rebuilt")
    (message,) = {o["message"] for o in job.outcomes if o["status"] == "error"}
    assert "'model.counts'" in message and "[2, 2]" in message and "logical ranks [1]" in message, message
    assert "nothing was fenced" in message and "version 3 not committed" in message
    assert _verdicts(job) == {("structure", None, ())}


# A rank's own work per step is measured on a machine with three processes a core: one descheduled
# for a few ms looks twice as slow as it is (medians of 4-11 ms seen for the same ~5 ms of work). So
# the steps carry more work than the default model's (~2.5 ms), and the slow rank is 10x slower, so
# that noise never takes it under the factor of 3 (with 6x on the default model it was evicted a
# step late once, under load).
WORK = ("--hidden", "512")


@pytest.mark.fault
def test_a_slow_rank_is_evicted_to_the_spare_within_its_window_a_paused_one_is_not_bitwise(tmp_path, reference):
    # Logical 2 runs 10 times slower from step 10; evicted after 3 steps at >= 3x the median. Logical 1
    # spends half a second more in step 6 only (~100x the median once): never a straggler.
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "2@10:slow=10", "--straggler", "3:3",
                 program=FAULTY + WORK, env=fault("pause", rank=1, step=5))
    assert_bitwise(job, reference(TRAIN + WORK), "optimizer_sha256")
    assert job.of("straggler") and {e["rank"] for e in job.of("straggler")} == {2}
    evicted = [e for e in job.of("straggler") if e["evicted"]]
    assert {(e["rank"], e["step"]) for e in evicted} == {(2, 13)}, job.of("straggler")
    assert len(evicted) == 4 and all(e["ratio"] >= 3 for e in evicted)
    (rebuilt,) = {(e["mode"], tuple(e["failed"])) for e in job.of("rebuilt")}
    assert rebuilt == ("spare", (2,))
    (gone,) = [o for o in job.outcomes if o["status"] == "failed"]
    assert gone["logical"] == 2 and gone["kind"] == "straggler" and "evicted" in gone["message"]
    assert "step 13: logical rank 2 a straggler" in format_report(job.run_dir)


@pytest.mark.fault
def test_a_straggler_whose_place_the_jobs_policy_cannot_fill_is_kept_and_it_is_said_once(tmp_path, reference):
    """Shrink only, and the job must stay a multiple of 2: evicting the slow rank of 4 would leave
    3, which the rebuild refuses. The eviction asks the job's own policy first: the rank is kept,
    the job ends on every rank, bitwise, and the warning is said once (before: evicted at step 13,
    then every rank stopped with ``Unrecoverable``)."""
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "2@10:slow=10", "--straggler", "3:3",
                 program=TRAIN + WORK, env={"ELASTIC_MULTIPLE_OF": "2"})
    assert_bitwise(job, reference(TRAIN + WORK))
    assert job.statuses() == ["finished"] * 4 and not job.of("rebuilt")
    found = job.of("straggler")
    assert found and {e["rank"] for e in found} == {2} and not any(e["evicted"] for e in found)
    said = [line for line in job.output.splitlines() if "not evicted" in line]
    assert len(said) == 1 and "not a multiple of 2" in said[0], said
