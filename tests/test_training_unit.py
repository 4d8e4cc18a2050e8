"""One-process tests of the training layer: policy decisions, state values, batches, the report."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import elastic
from elastic.comm import wire
from elastic._handlers import from_array, kind_of, to_array
from elastic._handlers import join_value as _join_value
from elastic._handlers import split_value as _split_value
from elastic.comm import Outlook, RebuildContext
from elastic.comm.faults import InjectedFault
from elastic.recovery import Policy
from elastic.report import ettr, timeline, trace
from elastic.testing import SimJob


# ------------------------------------------------------------------ policy
def ask(policy: Policy, lost: int, spares: int, active: int, outlook: dict | None = None):
    """(modes, reason) of the policy's decision."""
    decision = policy.decide(RebuildContext(lost, spares, active, Outlook(**(outlook or {}))))
    return decision.modes, decision.reason


def test_spares_first_then_the_next_allowed_mode():
    policy = Policy(modes=("spare", "spawn", "shrink"))
    assert ask(policy, 1, spares=1, active=3)[0] == ("spare",)
    assert ask(policy, 2, spares=1, active=2)[0] == ("spare", "spawn")
    assert ask(Policy(modes=("spare", "shrink")), 2, spares=1, active=2)[0] == ("spare", "shrink")


def test_shrink_respects_min_size_and_divisibility():
    modes, reason = ask(Policy(modes=("shrink",), min_size=3), 2, spares=0, active=2)
    assert modes == () and "below min_size=3" in reason and "add spares" in reason
    modes, reason = ask(Policy(modes=("shrink", "spawn"), multiple_of=2), 1, spares=0, active=3)
    assert modes == ("spawn",) and "not a multiple of 2" in reason


def test_cost_model_compares_spawn_time_with_slower_steps():
    policy = Policy(modes=("shrink", "spawn"), cost_model=True, spawn_seconds=1.3)
    # 3 -> 2 ranks: each step 1.5x slower; 100 steps of 0.1 s lose 5 s, more than a 1.3 s spawn.
    assert ask(policy, 1, 0, 2, {"step_seconds": 0.1, "remaining_steps": 100})[0] == ("spawn",)
    assert ask(policy, 1, 0, 2, {"step_seconds": 0.1, "remaining_steps": 10})[0] == ("shrink",)
    assert ask(policy, 1, 0, 2, {})[0] == ("shrink",)  # no outlook yet: the order decides


def test_policy_rejects_bad_settings_with_what_to_do():
    with pytest.raises(elastic.ConfigError, match="ordered list"):
        Policy(modes=("spare", "teleport"))
    with pytest.raises(elastic.ConfigError, match="integers"):
        Policy.from_env({"ELASTIC_MIN_SIZE": "three"})
    policy = Policy.from_env({"ELASTIC_REBUILD": "spawn,shrink", "ELASTIC_COST_MODEL": "1",
                              "ELASTIC_MULTIPLE_OF": "2"})
    assert policy.modes == ("spawn", "shrink") and policy.cost_model and policy.multiple_of == 2


@settings(max_examples=200, deadline=None)
@given(lost=st.integers(1, 6), spares=st.integers(0, 4), active=st.integers(0, 8), min_size=st.integers(1, 4),
       multiple_of=st.integers(1, 3))
def test_policy_never_breaks_its_constraints(lost, spares, active, min_size, multiple_of):
    policy = Policy(modes=("spare", "shrink"), min_size=min_size, multiple_of=multiple_of)
    modes, reason = ask(policy, lost, spares, active)
    used = min(lost, spares)
    if "shrink" in modes:
        assert active + used >= min_size and (active + used) % multiple_of == 0
    if not modes:
        assert reason and used < lost
    assert modes[:1] in ((), ("spare",), ("shrink",))


# ------------------------------------------------------------------ state values
@pytest.mark.parametrize("value", [3, 2.5, True, np.float32(1.5), np.arange(6).reshape(2, 3),
                                   torch.arange(4, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)])
def test_state_values_round_trip_bit_for_bit(value):
    array, kind = to_array("x", value)
    back = from_array(array.copy(), kind)
    assert type(back) is type(value) or isinstance(value, np.generic)
    if isinstance(value, torch.Tensor):
        assert back.dtype == value.dtype and torch.equal(back, value)
    else:
        assert np.asarray(back).tobytes() == np.asarray(value).tobytes()


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, "text", object(), np.array([object()])])
def test_unsupported_state_values_say_what_to_do(value):
    with pytest.raises(elastic.ConfigError, match="holds numbers, numpy arrays and torch tensors"):
        to_array("bad", value)
    if not isinstance(value, (list, dict)):  # dicts and lists are stored as structures
        with pytest.raises(elastic.ConfigError, match="objects with state_dict"):
            kind_of("bad", value)


def test_optimizer_state_survives_the_tensor_split():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    arrays = {k: np.array(v) for k, v in _split_value("optim", opt.state_dict()).items()}
    rebuilt = _join_value("optim", arrays)
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(rebuilt)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh.state_dict()["state"][0][key], opt.state_dict()["state"][0][key])


def _stateful_objects(steps: int = 3):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    model(torch.ones(1, 3)).sum().backward()
    for _ in range(steps):
        opt.step()
        sched.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** steps)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}


@pytest.mark.parametrize("name", ["model", "optimizer", "scheduler", "scaler"])
def test_objects_with_a_state_dict_round_trip_through_json_and_arrays(name):
    original = _stateful_objects()[name]
    assert kind_of(name, original) == "object"
    arrays = {k: np.array(v) for k, v in _split_value(name, original.state_dict()).items()}
    fresh = _stateful_objects(steps=5)[name]  # differs in every value the restore must bring back
    assert _digest(fresh.state_dict()) != _digest(original.state_dict())
    fresh.load_state_dict(_join_value(name, arrays, fresh.state_dict()))
    assert _digest(fresh.state_dict()) == _digest(original.state_dict())


def _digest(tree) -> str:
    doc, leaves = wire.split(tree, "x")
    return doc.tobytes().hex() + "".join(np.asarray(v).tobytes().hex() for v in leaves.values())


def test_rng_states_and_plain_state_dicts_round_trip():
    for value in (np.random.get_state(), __import__("random").getstate(),
                  {"a": [1, 2.5, None, "x", (3, float("inf"))], 7: torch.arange(4), "n": np.float32(2.5)}):
        arrays = {k: np.array(v) for k, v in _split_value("v", value).items()}
        back = _join_value("v", arrays)
        assert _digest(back) == _digest(value)
        assert type(back) is type(value)


def test_a_structure_refuses_what_it_cannot_carry_naming_where():
    with pytest.raises(elastic.ConfigError, match=r"state value 'bad'.*a\.1 is a object"):
        kind_of("bad", {"a": [1, object()]})
    with pytest.raises(elastic.ConfigError, match="keys are str or int"):
        kind_of("bad", {(1, 2): 3})


@pytest.mark.parametrize("document", [b'{"schema":1,"value":{"call":"os.system"}}', b'{"schema":2,"value":1}',
                                      b"\x80\x04K\x01.", b'{"schema":1,"value":{"scalar":"|O","v":1}}'])
def test_a_foreign_structure_builds_nothing(document):
    with pytest.raises(elastic.ConfigError, match="not one this version wrote"):
        wire.join(np.frombuffer(document, np.uint8), lambda path, kind: None)


def test_no_restore_path_unpickles(monkeypatch):
    """Everything a peer sends back is JSON and arrays: restoring a TorchState with a model, an
    optimizer, a scheduler and RNG states never calls pickle."""
    import pickle


    objects = _stateful_objects()
    state = elastic.TorchState(SimJob(2).rank(0), model=objects["model"], optimizer=objects["optimizer"],
                               scheduler=objects["scheduler"], scaler=objects["scaler"], step=3)
    arrays = {k: np.array(v) for k, v in state._capture().arrays.items()}
    before = _digest({k: v for k, v in arrays.items()})
    objects["scheduler"].step()
    np.random.random()
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads in a restore path"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load in a restore path"))
    state._values.apply(arrays)
    assert _digest(state._capture().arrays) == before


def test_values_taken_over_after_a_shrink_get_the_handlers_their_owner_had():
    """A removed rank's values (a pipeline stage with its optimizer, a plain shard, a plain
    state_dict) come to a survivor as the same kinds: the plain ones at once, the stage held until
    ``bind`` loads it into the module and optimizer the survivor makes for it."""

    removed = _stateful_objects()
    owner = elastic.TorchState(SimJob(2).rank(0), modules={"s2": (removed["model"], removed["optimizer"])},
                               **{"adam.3.m": np.arange(4.0), "notes": {"epoch": 2, "w": torch.ones(2)}})
    arrays = {k: np.array(v) for k, v in owner._capture().arrays.items()}
    survivor = elastic.TorchState(SimJob(2).rank(0), model=torch.nn.Linear(3, 2), step=7)
    mine = _digest(survivor._capture().arrays)
    survivor._values.apply(arrays, adopting=True)
    assert survivor.unbound() == ["s2"]
    assert sorted(survivor.names()) == ["adam.3.m", "notes", "step"]
    assert np.array_equal(survivor["adam.3.m"], np.arange(4.0)) and survivor["notes"]["epoch"] == 2
    assert survivor.step == 7 and _digest(survivor._capture().arrays) != mine  # its own kept, the new ones added
    fresh = _stateful_objects(steps=5)
    survivor.bind("s2", fresh["model"], fresh["optimizer"])
    assert survivor.unbound() == []
    assert _digest(fresh["model"].state_dict()) == _digest(removed["model"].state_dict())
    assert _digest(fresh["optimizer"].state_dict()) == _digest(removed["optimizer"].state_dict())


def test_a_roll_back_leaves_no_gradient_of_the_step_it_cut_short():
    """A loop that zeroes gradients after optimizer.step() adds its next backward to what is there:
    after a restore nothing may be, or the replayed step differs from the failure-free one."""

    model = torch.nn.Linear(3, 2)
    state = elastic.TorchState(SimJob(2).rank(0), model=model)
    committed = {k: np.array(v) for k, v in state._capture().arrays.items()}
    model(torch.ones(1, 3)).sum().backward()  # the step the failure cut short
    with torch.no_grad():
        model.weight.add_(1.0)
    state._values.apply(committed)
    assert all(p.grad is None for p in model.parameters())
    assert _digest(state._capture().arrays) == _digest(committed)


def test_the_state_keeps_its_own_names():
    state = elastic.TorchState(SimJob(2).rank(0), model=torch.nn.Linear(3, 2))
    with pytest.raises(elastic.ConfigError, match="'rng'.*choose another"):
        state["rng"] = 1
    assert "model" not in state and list(state.names()) == []


# ------------------------------------------------------------------ batches
@settings(max_examples=50, deadline=None)
@given(samples=st.integers(10, 300), batch=st.integers(1, 10), step=st.integers(0, 200), size=st.integers(1, 7))
def test_global_batch_is_the_same_at_any_world_size(samples, batch, step, size):
    batches = elastic.GlobalBatches(samples, batch, seed=3)
    whole = batches.batch(step)
    assert len(whole) == batch
    job = SimJob(size)
    shards = [batches.shard(step, job.rank(r)) for r in range(size)]
    assert np.array_equal(np.concatenate(shards), whole)


def test_batches_walk_whole_epochs_across_batch_boundaries():
    batches = elastic.GlobalBatches(10, 4, seed=0)
    walk = np.concatenate([batches.batch(s) for s in range(5)])  # 20 samples: exactly two epochs
    assert sorted(walk[:10].tolist()) == sorted(walk[10:].tolist()) == list(range(10))
    assert not np.array_equal(walk[:10], walk[10:])  # each epoch in its own order
    with pytest.raises(elastic.ConfigError):
        elastic.GlobalBatches(4, 5)


def _sampler(rank: int, size: int, step: int = 0, inject: str = ""):
    from elastic.data import GlobalBatchSampler
    return GlobalBatchSampler(SimJob(size, inject=inject).rank(rank), 50, 8, step=lambda: step, seed=4)


def test_sampler_epochs_and_global_batches_at_any_world_size():
    ref = _sampler(0, 1)
    assert ref.steps_per_epoch == 6 and len(ref) == 6
    epoch0 = np.concatenate([ref.batch(s) for s in range(6)])
    epoch1 = np.concatenate([ref.batch(s) for s in range(6, 12)])
    assert len(set(epoch0.tolist())) == 48 and len(set(epoch1.tolist())) == 48  # no sample twice in an epoch
    assert not np.array_equal(epoch0, epoch1)  # reshuffled per epoch
    for size in (1, 3, 4, 5):
        for step in (0, 5, 7, 11):
            shares = [_sampler(r, size).shard(step) for r in range(size)]
            assert sum(shares, []) == ref.batch(step).tolist()


def test_sampler_resumes_mid_epoch_after_a_roll_back_and_reshards_after_a_shrink():
    # Four ranks ran steps 0-8, the commit was at step 7, then a rank died: three ranks go on from 7.
    before = {r: list(_sampler(r, 4, step=0)) for r in range(4)}
    after = {r: list(_sampler(r, 3, step=7)) for r in range(3)}
    assert all(len(a) == 12 - 7 for a in after.values())  # to the end of epoch 1 (steps 7-11)
    for i, step in enumerate(range(7, 12)):
        assert sum((after[r][i] for r in range(3)), []) == _sampler(0, 1).batch(step).tolist()
    for step in range(6):  # and the first epoch as four ranks saw it is the same global sequence
        assert sum((before[r][step] for r in range(4)), []) == _sampler(0, 1).batch(step).tolist()


def test_with_accumulation_the_sampler_cuts_each_step_and_its_fault_point_counts_optimizer_steps():
    """accumulation=2: each step's share in two micro-batches in a row, the same samples as without;
    the step's fault point once, at its first micro-batch: 1@2 fires at the fifth micro-batch, and
    1@2.1 (micro-batch 1 of step 2) at the sixth."""
    from elastic.data import GlobalBatchSampler
    plain = _sampler(1, 3)
    micro = GlobalBatchSampler(SimJob(3).rank(1), 50, 8, step=lambda: 0, seed=4, accumulation=2)
    pieces = list(micro)
    assert len(pieces) == len(micro) == 2 * len(plain) == 12
    assert [pieces[2 * i] + pieces[2 * i + 1] for i in range(6)] == list(plain)
    # 1@2: steps 0 and 1, two pieces each, then the fault at step 2's first; 1@2.1 (R@S.M): at the sixth
    for inject, before in (("1@2:raise", 4), ("1@2.1:raise", 5)):
        armed = GlobalBatchSampler(SimJob(3, inject=inject).rank(1), 50, 8, step=lambda: 0, seed=4, accumulation=2)
        drawn = []
        with pytest.raises(InjectedFault, match="step=2 on logical rank 1"):
            for piece in armed:
                drawn.append(piece)
        assert drawn == pieces[:before], inject
    with pytest.raises(elastic.ConfigError, match="accumulation=0"):
        GlobalBatchSampler(SimJob(1).rank(0), 50, 8, step=lambda: 0, accumulation=0)


def test_sampler_feeds_a_dataloader():
    dataset = torch.utils.data.TensorDataset(torch.arange(50))
    sampler = _sampler(1, 3, step=2)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    first = next(iter(loader))[0].tolist()
    assert first == sampler.shard(2) and len(loader) == 4


def test_a_dataloader_iterator_made_after_a_recovery_does_not_shift_the_random_numbers():
    # A failure-free run makes one iterator per epoch; a recovered one one more, mid-epoch, right
    # after the restore. Its worker-seed draw from the global generator must leave no trace.
    dataset = torch.utils.data.TensorDataset(torch.arange(50))
    sampler = _sampler(1, 3, step=2)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    batch = next(iter(loader))[0]
    assert torch.equal(torch.rand(4), expected)
    assert batch.tolist() == sampler.shard(2)
    armed = _sampler(1, 3, step=2, inject="1@2:raise")  # and the step is a fault point
    with pytest.raises(InjectedFault, match="step=2 on logical rank 1"):
        next(iter(torch.utils.data.DataLoader(dataset, batch_sampler=armed)))


def test_progress_lines_every_n_steps_or_seconds(caplog, monkeypatch):
    from elastic._clock import StepClock

    def lines(settings: dict, steps: int, clock_step: float = 0.0) -> list[int]:
        world = SimJob(4, **settings).rank(0)
        now = [0.0]
        monkeypatch.setattr("elastic._clock.time.monotonic", lambda: now[0])
        clock, shown = StepClock(world), []
        caplog.clear()
        with caplog.at_level("INFO", logger="elastic"):
            for s in range(1, steps + 1):
                now[0] += clock_step
                clock.step_done(s, 0.5, total=steps)
        shown = [int(r.getMessage().split()[2].split("/")[0]) for r in caplog.records]
        return shown

    assert lines({}, 25) == [10, 20, 25]
    assert lines({"progress_every": 0, "progress_seconds": 3.0}, 10, clock_step=1.0) == [3, 6, 9, 10]
    assert lines({"progress_every": 0}, 7) == [7]  # the last step only


def test_micro_batches_cover_the_share():
    parts = list(elastic.micro_batches(np.arange(10), 4))
    assert [len(p) for p in parts] == [4, 4, 2] and np.array_equal(np.concatenate(parts), np.arange(10))


def test_run_rejects_a_negative_failure_bound():
    with pytest.raises(elastic.ConfigError):
        elastic.run(lambda world, state: None, max_failures=-1)


# ------------------------------------------------------------------ report
def _events() -> list[dict]:
    ev = [{"event": "started", "t": 0.0, "gen": 0}]
    ev += [{"event": "step", "t": 1.0 + s, "gen": 0, "step": s, "seconds": 1.0, "loss": 1.0 / s} for s in (1, 2, 3)]
    ev += [{"event": "inject", "t": 4.0, "gen": 0, "action": "kill"},
           {"event": "failure_seen", "t": 4.5, "gen": 0},
           {"event": "decision", "t": 4.6, "gen": 0, "reason": "spare"},
           {"event": "rebuilt", "t": 4.8, "gen": 1, "failed": [1], "mode": "spare", "size": 4,
            "durations": {"agree": 0.1, "substitute": 0.1, "install": 0.1}},  # as a rebuild times them
           {"event": "state_restored", "t": 5.0, "gen": 1, "seconds": 0.2, "bytes_moved": 10}]
    # Rolled back to step 2: step 3 is redone, then step 4.
    ev += [{"event": "step", "t": 6.0 + i, "gen": 1, "step": s, "seconds": 1.0, "loss": 1.0 / s}
           for i, s in enumerate((3, 4))]
    ev += [{"event": "finished", "t": 8.0, "gen": 1}]
    return ev


def test_timeline_phases_and_ettr_from_events():
    (row,) = timeline(_events())
    assert row["detect"] == pytest.approx(500) and row["agree"] == pytest.approx(100)
    assert row["rebuild"] == pytest.approx(200) and row["restore"] == pytest.approx(200)
    assert row["resume"] == pytest.approx(1000) and row["down"] == pytest.approx(2000)
    assert row["redone"] == 1 and row["bytes"] == 10
    assert ettr(_events()) == pytest.approx(4 / 8)  # four steps that count, eight seconds in all


def test_report_writes_the_table_and_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot is the optional [plot] extra")
    import json
    from elastic import report
    for run in ("faults", "baseline"):
        (tmp_path / run).mkdir()
        events = _events() if run == "faults" else [e for e in _events() if e["gen"] == 0 and e["event"] != "inject"]
        if run == "baseline":
            events.append({"event": "finished", "t": 4.0, "gen": 0})
        (tmp_path / run / "events-h-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    out = tmp_path / "loss.png"
    assert report.main([str(tmp_path / "faults"), "--baseline", str(tmp_path / "baseline"), "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 failure(s), ETTR 0.500 (failure-free run: ETTR 0.750)" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_trace_is_chrome_trace_json_with_the_recovery_spans(tmp_path):
    events = [{**e, "pid": 10, "logical": 0} for e in _events()]
    events.insert(6, {"event": "agreed", "t": 4.6, "gen": 0, "pid": 10, "logical": 0, "failed": [1]})
    events.append({"event": "resumed", "t": 5.1, "gen": 1, "pid": 10, "logical": 0})
    events.sort(key=lambda e: e["t"])
    doc = json.loads(json.dumps(trace(events)))  # what the file holds
    assert doc["displayTimeUnit"] == "ms"
    for e in doc["traceEvents"]:  # the Trace Event Format's fields, by phase
        assert e["ph"] in ("X", "i", "M") and isinstance(e["name"], str) and e["pid"] == 10
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    spans = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"step 1", "step 4", "detect", "agree", "rebuild", "restore", "resume"} <= set(spans)
    assert spans["detect"]["ts"] == pytest.approx(4e6) and spans["detect"]["dur"] == pytest.approx(5e5)
    assert spans["restore"]["dur"] == pytest.approx(2e5)
    names = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in names] == ["logical rank 0 (pid 10)"]



# ------------------------------------------------------------------ DDP re-wrap
def test_a_rewrap_unhooks_the_ddp_whose_backward_a_failure_cut_short():
    """torch's DDP object sits in a reference cycle: only the cyclic GC frees it. Until then a
    reducer whose backward a failure cut short keeps its hooks on the parameters and they fire in
    the next backward (torch raises 'marked ready twice'): the 1-in-13 DDP recovery that differed.
    The old wrapper is kept alive here, as a GC that has not come yet keeps it."""
    import torch.distributed as dist

    from elastic.distributed import DistributedDataParallel

    class Rebuilt:  # a one-rank Gloo group that the test says belongs to an old generation
        generation, made = 0, -1

        @property
        def stale(self):
            return self.made != self.generation

        @property
        def group(self):
            self.made = self.generation
            return dist.group.WORLD

    calls = []

    def dies(state, bucket):  # the program's comm hook: its first backward's peer is lost
        calls.append(bucket.index())
        if len(calls) == 1:
            raise RuntimeError("Connection closed by peer")
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        return default_hooks.allreduce_hook(dist.group.WORLD, bucket)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        groups, x = Rebuilt(), torch.randn(3, 4)
        ddp = DistributedDataParallel(SimJob(1).rank(0), model, process_group=groups)
        ddp.register_comm_hook(None, dies)  # torch DDP's own method, kept across re-wraps by the wrapper
        with pytest.raises(RuntimeError, match="closed by peer"):
            ddp(x).sum().backward()
        cut_short = ddp.ddp
        groups.generation = 1
        model.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        assert ddp.ddp is not cut_short
        assert len(calls) > 1  # the new wrapper runs the program's hook too
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        plain.load_state_dict(model.state_dict())
        plain(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    finally:
        dist.destroy_process_group()


def test_a_dcp_checkpoints_metadata_goes_to_the_store_as_json_and_comes_back_whole():
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    from elastic._dcp import _decode, _encode

    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 8])),
              ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 8]))]
    metadata = Metadata({"app.model.0.weight": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                                     torch.Size([5, 8]), chunks),
                         "app.optim.param_groups.0.lr": BytesStorageMetadata()},
                        planner_data={"app.model.0.weight": ("app", "model", "0.weight"),
                                      "app.optim.param_groups.0.lr": ("app", "optim", "param_groups", 0, "lr")},
                        version="1.0.0")
    storage = {MetadataIndex("app.model.0.weight", torch.Size([0, 0])): "dcp.0.0",
               MetadataIndex("app.model.0.weight", torch.Size([3, 0])): "dcp.1.0",
               MetadataIndex("app.optim.param_groups.0.lr"): "dcp.0.1"}
    doc = _encode(metadata, storage)
    assert doc.dtype == np.uint8 and json.loads(doc.tobytes())["version"] == "1.0.0"  # data, never a pickle
    back, shapes = _decode(doc)
    assert back.state_dict_metadata == metadata.state_dict_metadata and back.version == "1.0.0"
    assert back.storage_data == storage  # MetadataIndex compares by name and offset
    assert [tuple(p) for p in back.planner_data.values()] == list(metadata.planner_data.values())
    assert shapes == {"dcp.0.0": (torch.bfloat16, [3, 8]), "dcp.1.0": (torch.bfloat16, [2, 8])}


def test_a_dcp_storage_in_peer_memory_wants_its_values_per_rank():
    from elastic.comm import ConfigError
    from elastic.distributed import PeerMemory

    with pytest.raises(ConfigError, match=r"local=\('dcp',\)"):
        PeerMemory(elastic.State(SimJob(2).rank(0), step=0))
    assert PeerMemory(elastic.State(SimJob(2).rank(0), local=("dcp",), step=0)).name == "dcp"


def test_an_unknown_process_group_backend_is_refused_naming_the_ones_there_are():
    from elastic.comm import ConfigError
    from elastic.distributed import ProcessGroup

    with pytest.raises(ConfigError, match="use 'ulfm'.*'gloo', or 'nccl'"):
        ProcessGroup(SimJob(1).rank(0), backend="mpi")


# ------------------------------------------------- examples/llama3d.py: bad input, before the first step


def _llama3d():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama3d
    return llama3d


def _llama3d_args(**changes) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _llama3d().add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **changes})


@pytest.mark.parametrize("changes, size, says", [
    ({}, 6, "launch with -n 4"),
    ({"layers": 3}, 4, "give --layers a multiple of 2"),
    ({"layers": 6, "schedule": "interleaved"}, 4, "give --layers a multiple of 4"),
    ({"tp": 3}, 12, "--tp 3 must divide --heads 4"),
    ({"batch": 12}, 4, "give a multiple of 8"),
    ({"batch": 36, "dp": 3, "pp": 1}, 3, "give a multiple of 24"),  # 3 replicas fit, 2 (after a shrink) do not
])
def test_a_mesh_that_does_not_fit_is_a_clear_error_before_the_first_step(changes, size, says):
    with pytest.raises(SystemExit, match=re.escape(says)):
        _llama3d().check(_llama3d_args(**changes), size)


def test_a_schedule_torch_does_not_have_is_refused_by_name(capsys):
    parser = argparse.ArgumentParser()
    _llama3d().add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule", "zerobubble"])
    assert "invalid choice: 'zerobubble'" in capsys.readouterr().err
