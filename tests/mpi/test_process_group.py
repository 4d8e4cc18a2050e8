"""The ``ulfm`` process group (torch.distributed over the World's communicator) without failures:
each collective torch's DDP, FSDP2 and DCP use gives what the definition says, on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic.distributed import ProcessGroup


@pytest.fixture(scope="module")
def group(world):
    made = ProcessGroup(world)  # the default group from here on, before anything reads .group
    assert dist.is_initialized() and dist.get_rank() == world.rank and dist.get_world_size() == world.size
    group = made.group
    assert group.getBackendName() == "ulfm" and group is dist.group.WORLD
    return group


def _ranks(world, dtype=torch.float32):
    return torch.arange(world.size, dtype=dtype)


@pytest.mark.mpi(min_size=2)
def test_all_reduce_sums_averages_and_takes_the_max_in_every_dtype(world, group):
    n, r = world.size, world.rank
    t = torch.full((5,), float(r + 1))
    dist.all_reduce(t)
    assert (t == n * (n + 1) / 2).all()
    t = torch.full((3,), float(r))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.full((3,), (n - 1) / 2))
    m = torch.tensor([r, -r], dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    assert m.tolist() == [n - 1, 0]
    half = torch.full((4,), 0.5 * (r + 1), dtype=torch.bfloat16)  # reduced in float32, written back
    dist.all_reduce(half)
    assert half.dtype == torch.bfloat16 and (half.float() == 0.5 * n * (n + 1) / 2).all()
    strided = torch.ones(4, 6)[:, ::2]  # not contiguous: reduced in a copy, written back in place
    dist.all_reduce(strided)
    assert (strided == n).all()


@pytest.mark.mpi(min_size=2)
def test_gathers_scatters_and_broadcasts_move_each_rank_s_part(world, group):
    n, r = world.size, world.rank
    whole = torch.empty(n * 2)
    dist.all_gather_single(whole, torch.tensor([r, 10.0 * r]))
    assert whole.view(n, 2)[:, 0].tolist() == list(range(n))
    parts = [torch.empty(2, dtype=torch.bfloat16) for _ in range(n)]
    dist.all_gather(parts, torch.full((2,), float(r), dtype=torch.bfloat16))
    assert [p[0].item() for p in parts] == list(range(n))
    mine = torch.empty(3)
    dist.reduce_scatter_single(mine, torch.arange(n * 3, dtype=torch.float32))
    assert mine.tolist() == [n * (3 * r + k) for k in range(3)]
    b = torch.full((4,), float(r))
    dist.broadcast(b, src=n - 1)
    assert (b == n - 1).all()
    out = torch.empty(sum(range(1, n + 1)))  # uneven all-to-all: rank j sends j+1 elements to each
    send = torch.full(((r + 1) * n,), float(r))
    dist.all_to_all_single(out, send, output_split_sizes=[j + 1 for j in range(n)],
                           input_split_sizes=[r + 1] * n)
    assert out.tolist() == [float(j) for j in range(n) for _ in range(j + 1)]
    dist.barrier()


@pytest.mark.mpi(min_size=2)
def test_object_collectives_dcp_relies_on(world, group):
    n, r = world.size, world.rank
    everyone = [None] * n
    dist.all_gather_object(everyone, {"rank": r, "name": "x" * r})
    assert everyone == [{"rank": j, "name": "x" * j} for j in range(n)]
    gathered = [None] * n if r == 0 else None
    dist.gather_object(("r", r), gathered, dst=0)
    if r == 0:
        assert gathered == [("r", j) for j in range(n)]
    got = [None]
    dist.scatter_object_list(got, [j * j for j in range(n)] if r == 0 else None, src=0)
    assert got == [r * r]
    box = [{"plan": r}]
    dist.broadcast_object_list(box, src=0)
    assert box == [{"plan": 0}]


@pytest.mark.mpi(min_size=2)
def test_ddp_averages_the_gradients_as_a_hand_made_mean(world, group):
    from elastic.distributed import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(world.size, 3, 4)  # every rank has every rank's data: the mean is computable here
    expected = []
    for k in range(world.size):
        model.zero_grad()
        model(x[k]).sum().backward()
        expected.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    ddp = DistributedDataParallel(world, model)
    ddp(x[world.rank]).sum().backward()
    for i, p in enumerate(model.parameters()):
        assert torch.equal(p.detach(), reference[i])
        assert torch.allclose(p.grad, sum(e[i] for e in expected) / world.size, atol=1e-6)
    # no_sync (torch DDP's, through the wrapper): the first micro-batch stays local, the second
    # all-reduces the accumulated gradients.
    model.zero_grad()
    with ddp.no_sync():
        ddp(x[world.rank]).sum().backward()
    ddp(x[world.rank]).sum().backward()
    for i, p in enumerate(model.parameters()):
        assert torch.allclose(p.grad, 2 * sum(e[i] for e in expected) / world.size, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_a_mis_sized_output_is_a_clear_error_on_every_rank(world, group):
    with pytest.raises(ValueError, match="size it group size x chunk"):
        dist.all_gather_single(torch.empty(world.size * 2 + 1), torch.ones(2))
    dist.barrier()  # nothing was left in flight: the group goes on


@pytest.mark.mpi(min_size=2)
def test_point_to_point_moves_tensors_in_a_ring_in_any_order_of_the_batch(world, group):
    n, r = world.size, world.rank
    right, left = (r + 1) % n, (r - 1) % n
    got, half = torch.empty(3), torch.empty(2, dtype=torch.bfloat16)
    # every rank sends before it receives: posted at once, waited for in the Works (no deadlock)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(r)), right),
                                    dist.P2POp(dist.isend, torch.full((2,), r + 0.5, dtype=torch.bfloat16), right),
                                    dist.P2POp(dist.irecv, got, left), dist.P2POp(dist.irecv, half, left)])
    for work in works:
        work.wait()
    assert got.tolist() == [float(left)] * 3 and half.tolist() == [left + 0.5] * 2
    strided = torch.zeros(4, 6)[:, ::2]  # received into a copy, written back into the view
    if r == 0:
        dist.send(torch.arange(12.0).view(4, 3), dst=1, tag=5)
    elif r == 1:
        dist.recv(strided, src=0, tag=5)
        assert strided.reshape(-1).tolist() == list(range(12))
    with pytest.raises(ValueError, match="from a named rank"):
        dist.irecv(torch.empty(1))
    dist.barrier()
