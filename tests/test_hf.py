"""Hugging Face transformers and accelerate programs (examples/hf_gpt2.py, examples/hf_gpt2_accelerate.py)
with real kills under mpiexec --with-ft ulfm. They run where the ``hf`` extra is installed (CI installs it)."""
from __future__ import annotations

import pytest

from conftest import assert_bitwise, launch
from elastic.report import final_steps

pytest.importorskip("transformers", reason="the hf extra: pip install -c constraints.txt -e '.[hf]'")

GPT2 = ("examples/hf_gpt2.py",)
# Dropout off for the shrink: its loss is then comparable with the failure-free run's (the spare
# tests check that a replacement gets the lost rank's dropout stream back).
GPT2_NO_DROPOUT = ("examples/hf_gpt2.py", "--dropout", "0")
ACCELERATE = ("examples/hf_gpt2_accelerate.py",)


@pytest.mark.fault
@pytest.mark.parametrize("inject, point, step, micro", [("1@c20", "collective", 20, None), ("2@13.1", "step", 13, 1)])
def test_a_gpt2_with_a_spare_ends_bitwise_the_failure_free_run(tmp_path, reference, inject, point, step, micro):
    """1@c20: rank 1 dies inside step 20's all-reduce (the last micro-batch's backward), at a
    recovery point; 2@13.1: rank 2 dies at step 13's second micro-batch, after its first went
    through ``no_sync``, and the job redoes steps 11-13 from step 10's commit. The model, AdamW's
    state and the warm-up schedule end bit for bit those of the failure-free run."""
    job = launch(tmp_path, 4, "--spares", "1", "--inject", inject, program=GPT2)
    assert_bitwise(job, reference(GPT2), "optimizer_sha256", "scheduler_sha256")
    [kill] = job.of("inject")
    assert (kill["point"], kill["step"], kill.get("micro")) == (point, step, micro)
    assert [e["logical"] for e in job.of("promoted")] == [int(inject[0])]


@pytest.mark.fault
def test_a_gpt2_after_a_shrink_keeps_every_global_batch_and_the_schedule(tmp_path, reference):
    ref = reference(GPT2_NO_DROPOUT)
    job = launch(tmp_path, 4, "--inject", "1@20", program=GPT2_NO_DROPOUT)
    assert job.rc == 0, job.output
    assert job.result["size"] == 3 and job.result["steps"] == 30
    steps = final_steps(job.events)
    assert sorted(steps) == list(range(1, 31))
    for step, event in steps.items():  # 16 sequences a step on 4 ranks or 3, the same learning rate
        assert (event["sequences"], event["lr"]) == (16, ref["steps"][step]["lr"]), step
    # 1@20 fires as step 20 is recorded, before its commit: the 3 survivors go on from step 15's
    assert [steps[s]["size"] for s in sorted(steps)] == [4] * 15 + [3] * 15
    assert job.result["scheduler_sha256"] == ref["result"]["scheduler_sha256"]
    assert abs(job.result["final_loss"] - ref["result"]["final_loss"]) <= 1e-5 * abs(ref["result"]["final_loss"])


@pytest.mark.fault
def test_the_accelerate_program_with_a_spare_ends_bitwise_the_plain_programs_failure_free_run(
        tmp_path, reference):
    """accelerate's ``backward`` (the loss over the micro-batches), ``accumulate`` (``no_sync`` on
    the first) and ``clip_grad_norm_`` on the ulfm group: the same bits as examples/hf_gpt2.py
    with a kill after a ``no_sync`` micro-batch."""
    pytest.importorskip("accelerate", reason="the hf extra: pip install -c constraints.txt -e '.[hf]'")
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "2@13.1", program=ACCELERATE)
    assert_bitwise(job, reference(GPT2), "optimizer_sha256", "scheduler_sha256")
    assert [e["logical"] for e in job.of("promoted")] == [2]
