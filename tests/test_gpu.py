"""The GPU path: CUDA tensors in the State through pinned host memory, DDP on GPUs.

No GPU was available to this project's sessions so far: every test here skips where CUDA is
absent, saying so, and the README says what ran where. On a GPU machine they run as they are.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import elastic
from conftest import assert_bitwise, launch
from elastic._handlers import copy_into, tensor_array
from elastic.testing import SimJob

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA device on this machine: the GPU path (pinned copies, "
                               "CUDA RNG states, DDP on GPUs) is written but not run here")
DDP = ("examples/ddp.py", "--steps", "40")


@needs_gpu
def test_a_cuda_tensor_goes_to_the_store_through_pinned_memory_and_back():
    tensor = torch.randn(1000, 37, device="cuda")
    array = tensor_array(tensor)
    assert torch.from_numpy(array).is_pinned()  # DMA'd into page-locked memory, not a pageable copy
    assert np.array_equal(array, tensor.cpu().numpy())
    target = torch.zeros_like(tensor)
    copy_into(target, array)
    assert torch.equal(target, tensor)


@needs_gpu
def test_a_cuda_model_optimizer_and_rng_roll_back_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)).cuda()
    optimizer = torch.optim.Adam(model.parameters())

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 8, device="cuda")).sum().backward()
        optimizer.step()

    step()
    state = elastic.TorchState(SimJob(2).rank(0), model=model, optimizer=optimizer)
    saved = {k: np.array(v) for k, v in state._capture().arrays.items()}
    step()
    after = [p.detach().clone() for p in model.parameters()], torch.rand(3, device="cuda")
    step()
    state._values.apply(saved)
    step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), after[0]))  # weights, Adam, CUDA dropout
    assert torch.equal(torch.rand(3, device="cuda"), after[1])


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory):
    job = launch(tmp_path_factory.mktemp("gpu"), 2, program=DDP + ("--device", "cuda", "--backend", "gloo"))
    assert job.rc == 0, job.output
    return {"result": job.result}


@pytest.mark.fault
@needs_gpu
def test_ddp_on_a_gpu_with_a_spare_is_bitwise(tmp_path, gpu_reference):
    """Ranks share the GPU(s) here, so Gloo moves the CUDA gradients (NCCL wants a GPU per rank)."""
    job = launch(tmp_path, 2, "--spares", "1", "--inject", "1@c20",
                 program=DDP + ("--device", "cuda", "--backend", "gloo"))
    assert_bitwise(job, gpu_reference, "optimizer_sha256")


@pytest.mark.fault
@pytest.mark.skipif(GPUS < 3, reason=f"NCCL wants one GPU per rank: 2 ranks and a spare need 3, this machine has "
                    f"{GPUS}")
def test_ddp_over_nccl_with_a_spare_is_bitwise(tmp_path):
    program = DDP + ("--device", "cuda", "--backend", "nccl")
    ref = launch(tmp_path / "ref", 2, program=program)
    assert ref.rc == 0, ref.output
    job = launch(tmp_path / "job", 2, "--spares", "1", "--inject", "1@c20", program=program)
    assert_bitwise(job, {"result": ref.result}, "optimizer_sha256")
