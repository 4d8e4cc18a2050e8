"""torch.distributed on the World's communicator (elastic.distributed): DDP and FSDP2 on the ``ulfm``
process group, DDP over Gloo, DCP into peers' memory, with real kills under mpiexec --with-ft ulfm
(examples/ddp.py, examples/fsdp.py)."""
from __future__ import annotations

from typing import Any, Callable

import pytest

from conftest import JOB_TIMEOUT, assert_bitwise, launch
from elastic.report import final_steps, timeline
from elastic.comm import ConfigError

DDP = ("examples/ddp.py", "--steps", "40")
# Over Gloo a group timeout of 3 s: the bound were a rank left waiting in DDP's all-reduce for a peer
# that went to the recovery (Gloo has no abort; the library shuts the group's connections down).
DDP_GLOO = ("examples/ddp.py", "--steps", "40", "--backend", "gloo", "--group-timeout", "3")
# Dropout off: the shrink's loss is then comparable with the failure-free run's (the DDP tests
# check that a replacement gets the lost rank's dropout stream back), and one reference serves all.
FSDP = ("examples/fsdp.py", "--steps", "30", "--dropout", "0")


def _assert_shrunk_on_the_same_batches(job, ref: dict, steps: int) -> None:
    """Finished on 3 ranks, every step on the failure-free run's samples, the loss within 1e-5."""
    assert job.rc == 0, job.output
    assert job.result["size"] == 3 and job.result["steps"] == steps
    for step, event in final_steps(job.events).items():
        assert event["samples"] == ref["steps"][step]["samples"], step
    assert abs(job.result["final_loss"] - ref["result"]["final_loss"]) <= 1e-5 * abs(ref["result"]["final_loss"])


def _groups(job) -> dict[int, list[int]]:
    """Generations of the process groups each logical rank made."""
    out: dict[int, list[int]] = {}
    for e in job.of("process_group"):
        out.setdefault(e["logical"], []).append(e["generation"])
    return out


@pytest.mark.fault
def test_a_kill_inside_ddps_all_reduce_with_a_spare_is_bitwise(tmp_path, reference):
    # 1@c20: rank 1 dies in the middle of step 20's backward, inside DDP's all-reduce.
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@c20", program=DDP)
    assert_bitwise(job, reference(DDP), "optimizer_sha256")
    assert [(e["point"], e["step"]) for e in job.of("inject")] == [("collective", 20)]
    assert [e["logical"] for e in job.of("promoted")] == [1]
    groups = _groups(job)  # DDP wrapped again in the new generation on every rank, the promoted spare too
    assert {r: g[-1] for r, g in groups.items()} == {0: 1, 1: 1, 2: 1, 3: 1}
    assert all(g == [0, 1] for r, g in groups.items() if r != 1)
    # ... over the same group on the survivors: a substitution keeps the shape, the communicator is swapped
    kept = {e["logical"]: e["kept"] for e in job.of("process_group") if e["generation"] == 1}
    assert kept == {0: True, 1: False, 2: True, 3: True}
    assert {e["backend"] for e in job.of("process_group")} == {"ulfm"}
    # The report counts what the recovery moved: the model and optimizer the spare got from the survivors
    (row,) = timeline(job.events)
    (copied,) = {e["bytes"] for e in job.of("shared_copied")}
    assert copied > 0 and row["bytes"] >= copied


@pytest.mark.fault
def test_ddp_over_gloo_with_a_spare_is_bitwise(tmp_path, reference):
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@20", program=DDP_GLOO)
    assert_bitwise(job, reference(DDP_GLOO), "optimizer_sha256")
    assert {e["backend"] for e in job.of("process_group")} == {"gloo"}


@pytest.mark.fault
def test_a_kill_inside_the_gloo_all_reduce_is_bitwise_and_nobody_waits_out_the_timeout(tmp_path, reference):
    """Over Gloo too the gradients go in one all-reduce laid out by parameter: rank 2 killed inside
    step 13's, the survivors leave it at once, not at the group's timeout (Gloo has no abort: the
    first to see the death shut their connections down, which ends the others' wait), and the
    spare's run ends bitwise."""
    timeout = 3 * JOB_TIMEOUT  # a survivor waiting it out would be seen, the job would not finish
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "2@c13",
                 program=DDP_GLOO[:-1] + (str(timeout),))
    assert_bitwise(job, reference(DDP_GLOO), "optimizer_sha256")  # the timeout changes no bit
    [kill] = job.of("inject")
    assert (kill["point"], kill["step"]) == ("collective", 13)
    seen = {e["logical"]: e["t"] - kill["t"] for e in job.of("failure_seen") if e["logical"] != 2}
    assert sorted(seen) == [0, 1, 3] and max(seen.values()) < timeout / 10, seen


@pytest.mark.fault
def test_a_kill_inside_ddps_all_reduce_with_find_unused_parameters_is_bitwise(tmp_path, reference):
    # The sums do not depend on DDP's buckets: find_unused_parameters gives the same bits too.
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "2@c13", program=DDP + ("--find-unused-parameters",))
    assert_bitwise(job, reference(DDP), "optimizer_sha256")
    assert [(e["point"], e["step"]) for e in job.of("inject")] == [("collective", 13)]


@pytest.mark.fault
def test_ddp_per_step_survives_a_spare_then_a_spawned_process_bitwise_redoing_nothing(tmp_path, reference):
    job = launch(tmp_path, 4, "--spares", "1", "--rebuild", "spare,spawn", "--inject", "1@12,2@27/g1",
                 program=DDP + ("--per-step",))
    assert_bitwise(job, reference(DDP), "optimizer_sha256")  # the failure-free run commits every 5 steps
    assert [row["redone"] for row in timeline(job.events)] == [0, 0]
    assert [e["logical"] for e in job.of("promoted")] == [1] and len(job.of("spawned")) == 1
    assert [e["mode"] for e in job.of("rebuilt") if e["logical"] == 0] == ["spare", "spawn"]
    assert sorted({e["generation"] for e in job.of("process_group")}) == [0, 1, 2]


@pytest.mark.fault
def test_ddp_after_a_shrink_keeps_the_global_batches(tmp_path, reference):
    program = DDP + ("--dropout", "0")
    ref = reference(program)
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "3@20", program=program)
    _assert_shrunk_on_the_same_batches(job, ref, steps=40)


@pytest.mark.fault
def test_fsdp_with_a_spare_gets_the_lost_shards_back_bitwise(tmp_path, reference):
    # examples/fsdp.py: the MLP of train.py sharded (its root unit owns no parameters), killed at a step
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@12", program=FSDP)
    assert_bitwise(job, reference(FSDP), "optimizer_sha256")
    assert [e["version"] for e in job.of("resumed") if e["logical"] == 1] == [2]  # the commit of step 10


# The official FSDP2 example's program: a transformer whose root unit owns the embeddings, final norm
# and head; DCP into peer memory every 5 steps. Dropout off: the shrink's loss is comparable with
# the failure-free run's, and one reference serves all.
TRANSFORMER = ("examples/fsdp_transformer.py", "--steps", "20", "--dropout", "0")


@pytest.mark.fault
@pytest.mark.parametrize("inject, options", [("1@g12", ()), ("1@c12", ()), ("2@u12", ("--tie", "--mixed-precision"))])
def test_fsdp2_transformer_survives_a_kill_in_its_forward_backward_or_optimizer_step_bitwise(
        tmp_path, reference, inject, options):
    """Logical rank 1 dies inside step 12's first all-gather (the forward's, the root unit's) or its
    first reduce-scatter (the backward's), or logical rank 2 inside step 12's optimizer step (bf16
    parameters, the head tied to the embedding); the spare, which rehearsed its first step before it
    parked, takes the lost rank's shards from the DCP checkpoint in peer memory, and the run ends
    bitwise the failure-free one. The program calls nothing FSDP2-specific after the failure: the
    library ends the cut iteration (a backward cut short leaves the root's unsharded gradients)."""
    program = TRANSFORMER + options
    job = launch(tmp_path, 4, "--spares", "1", "--inject", inject, program=program)
    assert_bitwise(job, reference(program), "optimizer_sha256")
    point = {"g": "gather", "c": "collective", "u": "update"}[inject[2]]
    assert [(e["point"], e["step"]) for e in job.of("inject")] == [(point, 12)]
    lost = int(inject[0])
    assert [e["logical"] for e in job.of("promoted")] == [lost]
    assert [e["ok"] for e in job.of("rehearsed")] == [True]  # the one spare, before it parked
    # Back to step 10's commit: steps 10 and 11 again, and step 12 too where the survivors finished it
    assert [row["redone"] for row in timeline(job.events)] == [3 if point == "update" else 2]
    # init_process_group() made the World's group; the survivors kept theirs, the spare made its own
    assert {(e["logical"], e["generation"], e["backend"]) for e in job.of("process_group")} == \
        {(0, 0, "ulfm"), (1, 0, "ulfm"), (2, 0, "ulfm"), (3, 0, "ulfm"), (lost, 1, "ulfm")}


PORT = ("examples/fsdp_port.py", "--steps", "20")  # the official example as ports are written


@pytest.mark.fault
@pytest.mark.parametrize("options, rehearsed", [((), []), (("--rehearse",), [True])])
def test_an_fsdp2_port_as_users_write_it_gets_the_lost_shards_back_bitwise(tmp_path, reference, options, rehearsed):
    """examples/fsdp_port.py: the model made on the meta device after init, sharded, materialised
    and initialised there (reset_parameters on DTensors), dropout on; without a rehearsal, and with
    ``elastic.init(rehearse=True)`` (the spare runs the program file again before it parks, as rank
    0, to its first step). Logical rank 1 dies inside step 12's first reduce-scatter; the spare
    makes the model and loads its shards from the DCP checkpoint in peer memory: bitwise, so the
    rehearsal changed nothing of the run (not the spare's generators either)."""
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@c12", program=PORT + options)
    assert_bitwise(job, reference(PORT), "optimizer_sha256")
    assert [e["logical"] for e in job.of("promoted")] == [1]
    assert [e["ok"] for e in job.of("rehearsed")] == rehearsed
    assert [row["redone"] for row in timeline(job.events)] == [2]  # back to step 10's commit


@pytest.mark.fault
def test_fsdp2_transformer_after_a_shrink_reshards_the_checkpoint_over_the_survivors(tmp_path, reference):
    ref = reference(TRANSFORMER)
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "3@c12", program=TRANSFORMER)
    assert job.rc == 0, job.output
    assert job.result["size"] == 3 and job.result["steps"] == 20
    assert abs(job.result["final_loss"] - ref["result"]["final_loss"]) <= 1e-5 * abs(ref["result"]["final_loss"])
    # A 3-rank group and mesh (init_process_group again): the 4-rank checkpoint was loaded onto 3 ranks.
    assert {e["size"] for e in job.of("process_group") if e["generation"] == 1} == {3}


@pytest.mark.fault
def test_fsdp2_transformer_survives_a_second_death_during_its_recovery_bitwise(tmp_path, reference):
    # Rank 1 dies at step 12; rank 2, which holds a copy of rank 1's shards, dies while the recovery
    # moves them (generation 1's restore): the third copy (replication 3) brings them back (the
    # copies' count does not change the model: the reference is the replication-2 run).
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@12,2@restore/g1",
                 program=TRANSFORMER + ("--replication", "3"))
    assert_bitwise(job, reference(TRANSFORMER), "optimizer_sha256")
    assert sorted(e["logical"] for e in job.of("promoted")) == [1, 2]
    assert [e["point"] for e in job.of("inject")] == ["step", "restore"]


@pytest.mark.fault
def test_fsdp2_transformer_with_a_peer_stopped_inside_a_reduce_scatter_recovers_bitwise(tmp_path, reference):
    # SIGSTOP in the middle of step 12's first reduce-scatter (the backward's): the others wait in
    # it until the sentinel kills the stopped rank (no heartbeat for 3 s), not for a group timeout.
    job = launch(tmp_path, 4, "--spares", "1", "--hang-timeout", "3", "--inject", "1@c12:hang", program=TRANSFORMER)
    assert_bitwise(job, reference(TRANSFORMER), "optimizer_sha256")
    assert [(e["point"], e["step"]) for e in job.of("inject")] == [("collective", 12)]
    assert "then hung (no heartbeat for 3.0 s), killed by its sentinel" in job.output


HSDP = FSDP + ("--replicas", "2")  # 2 x 2 (replicate, shard): each shard on two twins, every step a point


@pytest.mark.fault
def test_a_spare_that_rehearsed_on_a_2d_mesh_takes_its_place_bitwise(tmp_path, reference):
    """HSDP with a rehearsal (``elastic.init(rehearse=...)`` on a 2 x 2 mesh): its meshes cannot be
    given the spare's place (their sub-groups are rank 0's; their coordinate needs the job's group,
    which a promoted spare does not have yet), so its DTensor caches are emptied: the promotion
    neither fails nor differs."""
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@c13", program=HSDP + ("--rehearse",))
    assert_bitwise(job, reference(HSDP), "optimizer_sha256")
    assert [e["ok"] for e in job.of("rehearsed")] == [True]
    assert [e["logical"] for e in job.of("promoted")] == [1]


@pytest.mark.fault
@pytest.mark.parametrize("inject, root", [("1@c13", True), ("1@13", True), ("2@u13", False)])
def test_fsdp2_hsdp_twins_give_a_replacement_its_shards_bitwise(tmp_path, reference, inject, root):
    """HSDP on the ulfm group's 2-D mesh: logical rank 1 dies inside step 13's reduce-scatter or at
    its start (its twins then still run the backward), or logical rank 2 inside step 13's optimizer
    update (past its point, its twin finished it); the spare takes the parameter and optimizer
    shards from its twin and the run ends bitwise the failure-free one, no step done twice, no DCP
    checkpoint and no shard byte in the store. ``root``: the head stays in the root unit, whose
    unsharded gradients a cut backward leaves behind (TorchState clears them on recovery; the
    program calls nothing FSDP2-specific)."""
    program = HSDP + (("--root-params",) if root else ())
    job = launch(tmp_path, 4, "--spares", "1", "--inject", inject, program=program)
    assert_bitwise(job, reference(HSDP), "optimizer_sha256")
    lost = int(inject[0])
    row = timeline(job.events)[0]
    assert row["failed"] == [lost] and row["redone"] == 0
    assert [(e["logical"], e["senders"]) for e in job.of("twin_copied")] == [(lost, [(lost + 2) % 4])]
    assert all(e["replicated_bytes"] == e["payload_bytes"] < 32768 for e in job.of("committed"))


@pytest.mark.fault
def test_fsdp2_hsdp_shrink_takes_the_instance_out_and_its_survivor_stays_a_twin(tmp_path, reference):
    """Logical rank 1 dies without a spare: instance 0 goes out of use, instance 1 gets a mesh of its
    own and carries the global batch (the loss within 1e-5 of the failure-free run, the same samples
    every step); logical rank 0 computes nothing but takes each step's gradient shard from its twin,
    and the twins compare their shards every step (--twin-check-every 1) without a difference."""
    ref = reference(HSDP)
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--twin-check-every", "1", "--inject", "1@13", program=HSDP)
    _assert_shrunk_on_the_same_batches(job, ref, steps=30)
    assert [(e["mode"], e["removed"]) for e in job.of("rebuilt")][:1] == [("shrink", [1])]
    assert not job.of("integrity")


def test_a_dead_peer_in_a_gloo_collective_is_a_process_failure():
    from elastic.distributed import is_peer_failure
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]")
    assert is_peer_failure(gloo)
    # Gloo's own timeout reaching a rank that waits for a stopped peer (seen in a CI run, through
    # DDP's comm hook callback): the same failure, not this rank's bug.
    assert is_peer_failure(RuntimeError("Got the following error when running the callback: RuntimeError: "
                                        "Application timeout caused pair closure"))
    assert not is_peer_failure(RuntimeError("shape mismatch")) and not is_peer_failure(ValueError("gloo"))


def test_a_spares_rehearsal_warms_fsdp2_without_leaving_rank_0s_place_in_torchs_caches():
    """A spare rehearses as rank 0 of 4 (``elastic.init(rehearse=...)``); promoted, it is rank 1 of
    the same shape. Torch caches DTensor results under meshes that compare equal whatever this
    rank's place in them: the promoted spare's step finds the rehearsal's (warm), and what they
    left must not give rank 1 rank 0's place (``take_place``, which init() calls on promotion)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from elastic import _rehearsal
    from elastic._rehearsal import installed, rehearse

    def shard_and_step() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
        fully_shard(model[1])
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.arange(4)).sum().backward()
        optimizer.step()
        return model, optimizer

    rehearsed = []
    rehearse(4, lambda: rehearsed.append(dist.get_rank()))
    rehearse(4, shard_and_step)
    assert rehearsed == [0] and not dist.is_initialized()
    rehearsals = {id(ref()) for ref in _rehearsal._MESHES}
    _rehearsal.take_place(1)
    with installed(4, rank=1):
        model, optimizer = shard_and_step()
        moments = [v for p in model.parameters() for v in optimizer.state[p].values() if v.dim()]
        assert {id(v.device_mesh) for v in moments} <= rehearsals  # made from the rehearsal's cache entries
        assert all(v.device_mesh.get_group() is dist.group.WORLD for v in moments)  # found by name: this one
        for p in model.parameters():  # this rank's rows, and Adam's moments beside them
            assert p.device_mesh.get_coordinate() == (1,)
            assert p.to_local().shape[0] == p.shape[0] // 4
            assert all(v.device_mesh.get_coordinate() == (1,) for v in optimizer.state[p].values() if v.dim())
    with pytest.raises(ZeroDivisionError):  # what the rehearsal raised, in the caller's thread
        rehearse(4, lambda: 1 / 0)
    assert not dist.is_initialized()


def test_a_sharded_models_load_is_decided_once_its_optimizer_has_stepped(monkeypatch):
    """A recovery's first load into an FSDP2 model (``load_state_dict``'s copy into each parameter;
    DCP's ``set_state_dict`` into a promoted spare's new model and optimizer) makes no DTensor
    sharding decision off the cache once a model of its shapes has stepped its optimizer:
    ``init()`` installs the hook that decides them then (``warm_loads_after_steps``). The control,
    a model of other shapes whose optimizer never stepped, decides off the cache: the count sees
    a miss."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from elastic._rehearsal import installed, warm_loads_after_steps

    def sharded(width: int) -> torch.nn.Module:  # shapes no other test decided
        model = torch.nn.Sequential(torch.nn.Linear(width, 3 * width), torch.nn.Linear(3 * width, 8))
        fully_shard(model[0])
        return fully_shard(model)

    propagator = DTensor._op_dispatcher.sharding_propagator
    decisions: list[str] = []
    decide = propagator.propagate_op_sharding_non_cached  # what a miss of torch's native cache calls

    def counted(schema: Any) -> Any:
        decisions.append(str(schema.op))
        return decide(schema)

    monkeypatch.setattr(propagator, "propagate_op_sharding_non_cached", counted)

    def decided_off_cache(load: Callable[[], object]) -> list[str]:
        decisions.clear()
        load()
        return [op for op in decisions if "detach" not in op]  # state_dict()'s own, not the load's

    warm_loads_after_steps()
    with installed(4):
        model = sharded(44)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 44)).sum().backward()
        optimizer.step()  # the hook decides this model's loads
        saved = model.state_dict()
        assert decided_off_cache(lambda: model.load_state_dict(saved)) == []
        promoted = sharded(44)  # a promoted spare's model and its optimizer without state: DCP steps it first
        fresh = torch.optim.Adam(promoted.parameters())
        model_state, optim_state = get_state_dict(model, optimizer)
        assert decided_off_cache(lambda: set_state_dict(promoted, fresh, model_state_dict=model_state,
                                                        optim_state_dict=optim_state)) == []
        control = sharded(52)
        assert "aten.copy_.default" in decided_off_cache(lambda: control.load_state_dict(control.state_dict()))


def test_init_process_group_under_elastic_makes_the_worlds_group_or_says_what_to_call(monkeypatch):
    """A bare init_process_group() (FSDP2's when it finds no default group, torchrun-style programs)
    is served from the World; a backend the World cannot serve is refused saying what to call, and
    a call with a rendezvous of its own is torch's (no MASTER_ADDR: torch's own error)."""
    import torch.distributed as dist

    import elastic._torchrun as ed

    monkeypatch.setattr(ed, "_SERVED", [object()])
    with pytest.raises(ConfigError, match=r"elastic.distributed.ProcessGroup\(world, backend=...\)"):
        ed._init_process_group(backend="mpi")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        ed._init_process_group(backend="gloo", init_method="env://", world_size=2, rank=0)
    assert not dist.is_initialized()
