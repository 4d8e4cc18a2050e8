"""One-process tests: parsing, validation, error translation, the launcher's decisions."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from elastic import launch
from elastic.comm import Config, ConfigError, CurrentRank, LogicalRank, ProcessFailure, Unrecoverable
from elastic.comm.faults import FaultInjector, Injection, parse_schedule
from elastic.comm import _rebuild
from elastic.comm._errors import translate


def test_compact_schedule():
    assert parse_schedule("1@3, 2@c5:hang, 3@rebuild/g1, 0@agree:raise, 1@g7/g2, 2@u8") == (
        Injection(1, 3, "step", "kill", 0),
        Injection(2, 5, "collective", "hang", 0),
        Injection(3, None, "rebuild", "kill", 1),
        Injection(0, None, "agree", "raise", 0),
        Injection(1, 7, "gather", "kill", 2),
        Injection(2, 8, "update", "kill", 0),
    )


def test_a_point_to_point_entry_names_the_transfer_of_its_step():
    assert parse_schedule("3@p12, 1@p6.4:hang") == (
        Injection(3, 12, "p2p", "kill", 0, micro=0),   # the first transfer of step 12
        Injection(1, 6, "p2p", "hang", 0, micro=4),    # the fifth
    )
    fired = []
    injector = FaultInjector(parse_schedule("1@p6.4"), lambda entry: None, act=lambda entry, where: fired.append(where))
    for index in range(6):
        injector.point("p2p", 1, 0, 6, micro=index)
    injector.point("p2p", 1, 0, 7, micro=4)
    assert len(fired) == 1 and "p2p step=6" in fired[0]
    with pytest.raises(ConfigError, match="point-to-point transfer"):
        Injection(1, 6, "collective", micro=2)


def test_json_schedule_inline_and_file(tmp_path):
    text = json.dumps([{"rank": 2, "step": 4, "action": "hang", "gen": 2}])
    assert parse_schedule(text) == (Injection(2, 4, "step", "hang", 2),)
    path = tmp_path / "faults.json"
    path.write_text(text)
    assert parse_schedule(str(path)) == parse_schedule(text)
    assert parse_schedule("") == () and parse_schedule(None) == ()


@pytest.mark.parametrize("bad", ["1@x", "one@3", "1@3:explode", '[{"rank": 1, "point": "step"}]', "[{}]"])
def test_bad_schedule_says_how_to_write_one(bad):
    with pytest.raises(ConfigError, match="use one of|needs a step|write e.g."):
        parse_schedule(bad)


def test_rebuild_modes_are_validated():
    assert Config.from_env({"ELASTIC_REBUILD": "spare, shrink"}).rebuild == ("spare", "shrink")
    assert Config(rebuild=("spawn",)).rebuild == ("spawn",)
    with pytest.raises(ConfigError, match="drawn from"):
        Config.from_env({"ELASTIC_REBUILD": "spare,restart"})
    with pytest.raises(ConfigError):
        Config.from_env({"ELASTIC_REBUILD": ""})


def test_rank_kinds_are_distinct_types():
    logical, current = LogicalRank(3), CurrentRank(3)
    assert type(logical) is not type(current)
    assert repr(logical) == "LogicalRank(3)" and repr(current) == "CurrentRank(3)"
    assert str(logical) == str(current) == f"{current}" == "3"  # RANK=3 in the environment, never CurrentRank(3)


def test_mpi_errors_translate_by_recovery_kind():
    assert isinstance(translate(MPI.Exception(MPI.ERR_PROC_FAILED)), ProcessFailure)
    assert isinstance(translate(MPI.Exception(MPI.ERR_REVOKED)), ProcessFailure)
    assert isinstance(translate(MPI.Exception(MPI.ERR_PROC_FAILED_PENDING)), ProcessFailure)
    assert isinstance(translate(MPI.Exception(MPI.ERR_TRUNCATE)), Unrecoverable)


def test_launcher_command_for_this_machine(tmp_path):
    args = launch.parse_args(["-n", "4", "--spares", "2", "--detector", "--inject", "1@3",
                              "--run-dir", str(tmp_path), "--", "python", "x.py"])
    cmd = launch.build_command(args, 6)
    assert cmd[1:5] == ["--with-ft", "ulfm", "-n", "6"]
    assert "--oversubscribe" in cmd  # 6 processes on this 2-core machine
    assert cmd[cmd.index("mpi_ft_detector") + 1] == "true"
    assert cmd[-2:] == ["python", "x.py"] and "ELASTIC_INJECT" in cmd
    assert cmd[cmd.index("btl") + 1] == "^ofi"  # one machine: no fabric to probe at every MPI_Init
    args = launch.parse_args(["-n", "4", "--mca", "btl", "self,tcp", "--", "python", "x.py"])
    assert launch.build_command(args, 4).count("btl") == 1  # the user's choice stands alone


def test_the_launcher_sizes_each_processs_thread_pools_as_torchrun_does(tmp_path, monkeypatch):
    """OMP_NUM_THREADS: this host's cores over its processes (spares too), at least 1, passed to
    every process (through -x); one the user set is left alone."""
    from elastic._mpiexec import omp_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = launch.parse_args(["-n", "4", "--spares", "1", "--run-dir", str(tmp_path), "--", "python", "x.py"])
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert omp_threads(args) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert omp_threads(args) == 12 and "OMP_NUM_THREADS" in launch.build_command(args, 5)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert omp_threads(args) is None and "OMP_NUM_THREADS" not in launch.build_command(args, 5)


def test_ranks_yield_their_core_where_a_machine_has_more_processes_than_cores(tmp_path, monkeypatch):
    """mpi_yield_when_idle where this machine's processes outnumber its cores: every simulated
    node on it counts, a real host by its own share; the user's --mca wins (it comes last)."""
    def yields(argv: list[str], nprocs: int) -> bool:
        cmd = launch.build_command(launch.parse_args([*argv, "--run-dir", str(tmp_path), "--", "python", "x.py"]),
                                   nprocs)
        at = [i for i, x in enumerate(cmd) if x == "mpi_yield_when_idle"]
        return bool(at) and cmd[at[-1] + 1] == "1"

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert not yields(["-n", "4"], 4) and yields(["-n", "4", "--spares", "1"], 5)
    assert yields(["-n", "4", "--simulate-nodes", "2"], 4) is False  # 2 + 2 on 4 cores
    assert yields(["-n", "6", "--simulate-nodes", "3"], 6)  # 3 nodes of 2 each, all on this machine
    assert not yields(["-n", "6", "--simulate-nodes", "3", "--mca", "mpi_yield_when_idle", "0"], 6)


def _write(run_dir: Path, pid: int, status: str | None, **fields) -> None:
    (run_dir / f"events-h-{pid}.jsonl").write_text(json.dumps({"event": "started", "t": 0.0, "pid": pid}) + "\n")
    if status:
        (run_dir / f"outcome-h-{pid}.json").write_text(json.dumps({"pid": pid, "status": status, **fields}))


def test_launcher_decides_from_outcomes_not_exit_status(tmp_path):
    # As with mpirun / torchrun: the job succeeded when the training finished, whatever died on the way.
    _write(tmp_path, 1, "finished")
    _write(tmp_path, 2, "injected-kill", injection={"action": "kill", "step": 3})
    _write(tmp_path, 3, "spare-unused")
    _write(tmp_path, 4, None)  # died without a word: listed, but the training finished
    summary = launch.summarize(tmp_path)
    assert summary.finished is True
    assert {d["pid"]: d["how"] for d in summary.deaths} == {
        2: "injected kill at step 3", 4: "died with its sentinel, without a word (no outcome, no sentinel record: "
                                         "a SIGKILL to the sentinel, or its host lost)"}
    _write(tmp_path, 5, "error", kind="DataLost", message="state lost")  # the job stopped on every rank
    summary = launch.summarize(tmp_path)
    assert summary.finished is False and summary.stopped_by == {"kind": "DataLost", "message": "state lost"}


def test_launcher_counts_a_failure_after_finishing(tmp_path):
    _write(tmp_path, 1, "finished")
    _write(tmp_path, 2, "failed", kind="OSError", message="disk full", step=None, after_finish=True)
    summary = launch.summarize(tmp_path)
    assert summary.finished is False
    assert summary.deaths[0]["how"] == "failed after finishing: OSError: disk full"


def test_a_stopped_job_lists_its_processes_as_stopped_on_request(tmp_path):
    _write(tmp_path, 1, None)  # killed with the rest: no word of its own
    _write(tmp_path, 2, "failed", kind="KeyboardInterrupt", message="", step=4)  # Ctrl-C reached it
    _write(tmp_path, 3, "failed", kind="ValueError", message="a bug", step=4)  # its own failure, said as such
    summary = launch.summarize(tmp_path, stopped="SIGINT")
    assert {d["pid"]: d["how"] for d in summary.deaths} == {
        1: "stopped on request (SIGINT)", 2: "stopped on request (SIGINT)",
        3: "failed at step 4: ValueError: a bug"}
    assert summary.counts == {"stopped on request": 2, "failed": 1}


def test_an_injection_the_loop_passed_without_firing_is_told_apart_from_one_never_reached():
    """1@c40 in a job that reached step 41 with logical rank 1 there: its step points missed it (the
    job fails, unless --allow-unfired); 2@1000 was never reached, 3@5/g1's generation resumed past
    step 5, 1@20/g1 targets a rank a shrink removed, 0@41's generation ended at its record: warnings."""
    from elastic._supervise import unfired_but_reached
    from elastic.comm.faults import parse_schedule
    events = [{"event": "started", "gen": 0, "logical": r} for r in range(4)]
    events += [{"event": "step", "gen": 0, "logical": 0, "step": s} for s in range(1, 42)]
    events += [{"event": "rebuilt", "gen": 1, "logical": r} for r in (0, 2, 3)]  # logical 1 shrunk away
    events += [{"event": "step", "gen": 1, "logical": 0, "step": s} for s in range(30, 60)]
    entries = list(parse_schedule("1@c40,2@1000,3@5/g1,1@20/g1,2@c41,0@41"))
    assert [i.to_dict() for i in unfired_but_reached(entries, events)] == [
        {"rank": 1, "step": 40, "point": "collective", "action": "kill", "gen": 0}]
    # 0@41: step 41 recorded, then the generation ended (a straggler evicted at that record, say)


def test_the_sentinels_of_ranks_that_said_their_end_are_known_to_the_launcher(tmp_path):
    """A stopped sentinel whose rank has ended is killed at once (nobody else can free mpiexec of it),
    not after twice the hang bound: the launcher knows it by the rank's outcome."""
    from elastic._supervise import sentinels_of_ended_ranks
    for pid, sentinel, status in ((11, 101, "finished"), (12, 102, None), (13, 103, "spare-unused")):
        (tmp_path / f"events-h-{pid}.jsonl").write_text(json.dumps(
            {"event": "started", "t": 0.0, "pid": pid, "sentinel_pid": sentinel}) + "\n")
        if status:
            (tmp_path / f"outcome-h-{pid}.json").write_text(json.dumps({"pid": pid, "status": status}))
    assert sentinels_of_ended_ranks(tmp_path) == {101, 103}


def test_a_sigkill_before_the_stop_keeps_its_own_cause_one_after_it_is_the_stops(tmp_path):
    """After --timeout: a rank killed from outside before the stop began died of that kill; one
    its sentinel saw killed after the stop (the grace ran out) was stopped on request."""
    for pid, t in ((1, 100.0), (2, 205.0)):
        _write(tmp_path, pid, None)
        (tmp_path / f"fate-h-{pid}.json").write_text(json.dumps(
            {"end": "died", "pid": pid, "host": "h", "t": t, "step": 7, "signal": "SIGKILL"}))
    summary = launch.summarize(tmp_path, stopped="timeout", since=200.0)
    how = {d["pid"]: d["how"] for d in summary.deaths}
    assert how[2] == "stopped on request (timeout)" and "stopped on request" not in how[1], how
    assert "SIGKILL" in how[1]


def test_a_host_is_lost_when_every_process_on_it_died_and_another_host_lives():
    procs = [("a", 1), ("a", 2), ("b", 3), ("b", 4), None]
    assert _rebuild.hosts_lost(procs, [2, 3]) == ["b"]
    assert _rebuild.hosts_lost(procs, [1, 2]) == []  # one process of each: no host gone
    assert _rebuild.hosts_lost(procs, [0, 1, 2, 3]) == []  # nobody left to wait for anything


def test_launcher_rejects_missing_program():
    with pytest.raises(SystemExit):
        launch.parse_args(["-n", "2"])


def test_launcher_checks_its_timeouts_order_and_builds_settings_from_their_rows(capsys):
    """The job's timeout must leave the ranks their grace; the options the settings' rows make
    reach both records (comm's Config, the training layer's) and their variables."""
    with pytest.raises(SystemExit):
        launch.parse_args(["-n", "2", "--timeout", "5", "--grace", "10", "--", sys.executable])
    assert "--timeout 5 must exceed --grace 10" in capsys.readouterr().err
    plan = launch.parse_args(["-n", "2", "--rebuild", "spawn", "--keep-versions", "3", "--on-nonfinite", "skip",
                              "--straggler", "4:2", "--", sys.executable])
    assert plan.config.rebuild == ("spawn",) and plan.training.keep_versions == 3
    assert plan.training.on_nonfinite.value == "skip" and plan.training.straggler_steps == 2
    env = launch.job_env(plan.config, plan.training)
    assert env["ELASTIC_REBUILD"] == "spawn" and env["ELASTIC_KEEP_VERSIONS"] == "3"
    assert env["ELASTIC_ON_NONFINITE"] == "skip" and env["ELASTIC_STRAGGLER_FACTOR"] == "4"


def test_the_launchers_help_says_every_default_and_the_whole_injection_grammar():
    from elastic._plan import _parser
    parser = _parser()
    for action in parser._actions:
        if action.option_strings and action.help and action.default not in (None, False, [], "==SUPPRESS=="):
            assert "default" in action.help, f"{action.option_strings[0]} does not say its default"
        if action.option_strings and action.option_strings[-1] != "--help":
            assert action.help, f"{action.option_strings[-1]} has no help"
    (inject,) = [a for a in parser._actions if "--inject" in a.option_strings]
    from elastic.comm.faults import ACTIONS, POINTS
    assert all(word in inject.help for word in ACTIONS + tuple(p for p in POINTS if p not in ("step", "collective")))


@pytest.mark.timeout(30)
def test_the_sentinel_learns_of_its_childs_end_from_the_kernel_not_from_its_next_poll():
    """The watch waits on the child's pidfd: the end wakes it at once (a timer would sleep the whole
    60 s here, and the test's bound would fail it); the page's checks keep their own period."""
    import subprocess

    from elastic.comm import _sentinel
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    wait = _sentinel._end_of(child)
    assert wait(0.01) is False  # still running: the period passes
    assert wait(60) is True
    assert child.wait(5) == 0


def test_with_no_progress_timeout_given_a_stall_is_bounded_by_the_jobs_own_steps():
    """The default progress bound: 20 x the slowest step seen, at least 120 s, once 3 steps were
    seen (none before: the start is no step); 0 turns it off, a value sets it."""
    from elastic.comm import _sentinel
    assert Config().progress_timeout is None
    assert Config.from_env({"ELASTIC_PROGRESS_TIMEOUT": "0"}).progress_timeout == 0.0
    assert Config.from_env({"ELASTIC_PROGRESS_TIMEOUT": ""}).progress_timeout is None
    assert _sentinel.auto_bound(0.5, 2) == 0.0
    assert _sentinel.auto_bound(0.5, 3) == 120.0 and _sentinel.auto_bound(9.0, 40) == 180.0
    watch = _sentinel.Sentinel(["true"], Config())
    watch.slowest, watch.steps_seen = 2.0, 5
    assert watch.progress_bound() == 120.0
    assert _sentinel.Sentinel(["true"], Config(progress_timeout=0.0)).progress_bound() == 0.0
    assert _sentinel.Sentinel(["true"], Config(progress_timeout=7.0)).progress_bound() == 7.0


def test_a_rank_that_waited_out_a_stuck_peer_gets_the_progress_bound_afresh_once_its_wait_ends():
    """A survivor waits in MPI for a stalled peer (twice the bound), the peer is killed at the bound,
    and the survivor's wait ends; until its recovery marks progress it has made none since its last
    step, the bound's length ago. It is the victim: its own time starts when the wait ends (it was
    killed with the stalled peer under load, a chaos run's second death)."""
    from elastic.comm import _sentinel
    watch = _sentinel.Sentinel(["true"], Config(progress_timeout=5.0))
    page = dict(watch.seen, armed=1, progress=1, waiting=0)
    t0 = watch.last_progress
    watch._saw(t0, page)                                          # the last step
    waiting = dict(page, waiting=1)
    watch._saw(t0 + 0.1, waiting)
    assert watch._verdict(t0 + 9.0, waiting) is None              # waiting: twice the bound
    done = dict(page, waiting=0)
    watch._saw(t0 + 5.2, done)                                    # the stuck peer died: the wait ended
    assert watch._verdict(t0 + 5.3, done) is None
    assert watch._verdict(t0 + 10.3, done) == "no-progress"       # then stuck itself: its own bound
    stuck = _sentinel.Sentinel(["true"], Config(progress_timeout=5.0))
    stuck._saw(t0, page)
    assert stuck._verdict(t0 + 5.3, page) == "no-progress"        # never waiting: the bound from its step


def test_slurm_allocation_becomes_hosts_and_slots(tmp_path):
    assert launch.slurm_slots("2(x3),1", ["a", "b", "c", "d"]) == [("a", 2), ("b", 2), ("c", 2), ("d", 1)]
    with pytest.raises(SystemExit, match="does not match"):
        launch.slurm_slots("4", ["a", "b"])
    args = launch.parse_args(["-n", "6", "--run-dir", str(tmp_path), "--", "python", "x.py"])
    args = dataclasses.replace(args, hosts=(("a", 4), ("b", 4)))
    cmd = launch.build_command(args, 7)
    assert cmd[cmd.index("--host") + 1] == "a:4,b:4" and "--oversubscribe" not in cmd
    assert "--oversubscribe" in launch.build_command(args, 9)  # more processes than allocated slots


def test_slurm_option_outside_an_allocation_says_so(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(SystemExit, match="outside a Slurm allocation"):
        launch.parse_args(["--slurm", "--", "python", "x.py"])


# ------------------------------------------------------------------ what peers send each other
def test_control_messages_round_trip_through_the_wire_format():
    import numpy as np
    import torch

    from elastic.comm import Config, Decision, wire
    from elastic.comm._rebuild import Summary
    from elastic.recovery._placement import Layout

    summary = Summary(failed={1, 3}, pending={3}, replaced={1}, modes=["spare"], causes=[{"pid": 7, "how": "kill"}],
                      committed=True)
    config = Config(spares=1, rebuild=("spare", "spawn"), inject=(Injection(2, 25, gen=1),), domains=("a", "b"))
    value = {"summary": summary, "config": config, "decision": Decision(("shrink",), "why"),
             "layout": Layout.of({0: "a", 1: "a", 2: "b"}), "procs": [("host", 12), None],
             "history": {("ValueError", 3)}, 5: (np.float32(2.5), float("inf")),
             "arrays": {"x": np.arange(6, dtype=np.int16).reshape(2, 3), "t": torch.arange(4, dtype=torch.bfloat16)}}
    back = wire.decode(wire.encode(value))
    assert back["summary"] == summary and back["config"] == config and back["layout"] == value["layout"]
    assert back["decision"] == value["decision"] and back["procs"] == value["procs"]
    assert back["history"] == value["history"] and back[5] == value[5] and type(back[5][0]) is np.float32
    assert back["arrays"]["x"].dtype == np.int16 and np.array_equal(back["arrays"]["x"], value["arrays"]["x"])
    assert back["arrays"]["t"].dtype == torch.bfloat16 and torch.equal(back["arrays"]["t"], value["arrays"]["t"])
    assert wire.decode(wire.encode(None)) is None and wire.encode(None).nbytes == 0
    framed = wire.encode(value)  # a message at the head of a longer buffer (a payload's header): its size
    head, size = wire.decode_prefix(np.concatenate([framed, np.ones(100, np.uint8)]))
    assert size == framed.nbytes and head["summary"] == summary


@pytest.mark.parametrize("forged", [
    b"\x80\x04\x95\x00",                                           # a pickle
    b'{"schema":1,"value":{"message":"Popen","fields":{"dict":[]}},"arrays":[]}',  # no such message type
    b'{"schema":1,"value":{"array":"x","kind":"numpy"},"arrays":[["x","numpy:|O",[1],0,8]]}',  # objects
    b'{"schema":1,"value":{"array":"x","kind":"numpy"},"arrays":[["x","numpy:<f8",[9],0,72]]}',  # outside
])
def test_a_forged_message_builds_nothing(forged):
    import numpy as np

    from elastic.comm import ConfigError, wire
    framed = np.frombuffer(len(forged).to_bytes(8, "little") + forged if forged[:1] == b"{" else forged, np.uint8)
    with pytest.raises(ConfigError, match="not one this version wrote"):
        wire.decode(framed.copy())


def test_the_layers_meet_only_through_public_modules_and_no_package_has_an_import_circle():
    """elastic uses recovery uses comm, never upwards, never through another package's private
    module; inside each package no module imports one that imports it (TYPE_CHECKING imports and
    imports inside functions counted: a lazy import is still a dependency)."""
    import ast

    import networkx as nx
    root = Path(__file__).resolve().parents[1]
    package = {"elastic": "elastic", "recovery": "elastic.recovery", "comm": "elastic.comm"}
    below = {"elastic": {"elastic.recovery", "elastic.comm"}, "recovery": {"elastic.comm"}, "comm": set()}
    wrong, circles = [], {folder: nx.DiGraph() for folder in package}
    for folder, name in package.items():
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                        node.module.startswith("elastic"):
                    top = next((p for p in ("elastic.recovery", "elastic.comm") if node.module.startswith(p)),
                               "elastic")
                    private = node.module.removeprefix(top).lstrip(".").startswith("_")
                    if top != name and (top not in below[folder] or private):
                        wrong.append(f"{folder}/{path.name}: from {node.module} import ...")
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    for target in [node.module] if node.module else [a.name for a in node.names]:
                        if (root / folder / f"{target.split('.')[0]}.py").exists():
                            circles[folder].add_edge(path.stem, target.split(".")[0])
    assert not wrong
    assert {folder: list(nx.simple_cycles(graph)) for folder, graph in circles.items()} == \
        {folder: [] for folder in package}


def test_no_function_in_the_recovery_layer_is_over_60_lines():
    """A function past 60 lines does two jobs (the store's commit, recovery and fetch each were, and
    became a plan, a chain and an exchange of their own)."""
    import ast
    root = Path(__file__).resolve().parents[1]
    long = [f"recovery/{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((root / "recovery").glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long


def test_every_setting_is_declared_once_and_the_training_layers_live_above_comm():
    """A setting is one row (name, variable, parser, check, option) of one table: its variable is
    written nowhere else in the library, its name is no other table's, and comm knows nothing of
    the training layer's settings (``grep keep_versions comm`` finds nothing)."""
    import ast

    from elastic._settings import ROWS as TRAINING_ROWS
    from elastic.comm.runtime import CONFIG_ROWS
    root = Path(__file__).resolve().parents[1]
    rows = [*CONFIG_ROWS, *TRAINING_ROWS]
    assert len({r.name for r in rows}) == len(rows) and len({r.env for r in rows}) == len(rows)
    literals: dict[str, list[str]] = {}
    for folder in ("comm", "recovery", "elastic"):
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        node.value.startswith("ELASTIC_") and node.value.isupper():
                    literals.setdefault(node.value, []).append(f"{folder}/{path.name}:{node.lineno}")
    twice = {env: where for env, where in literals.items() if env in {r.env for r in rows} and len(where) > 1}
    assert not twice, f"a setting's variable written in two places: {twice}"
    comm_text = "\n".join(p.read_text() for p in sorted((root / "comm").glob("*.py")))
    assert [r.name for r in TRAINING_ROWS if r.name in comm_text] == []


def test_the_world_is_its_contract_and_mpi():
    """World's public surface: the Recoverable contract (the Group, plus recover, finish, interrupt
    and fail) and ``mpi``; everything else is comm's own (a new public name is a decision: it goes
    into the contract, with the simulated rank, or it stays private)."""
    import ast

    from elastic.comm import Recoverable
    tree = ast.parse((Path(__file__).resolve().parents[1] / "comm" / "_world.py").read_text())
    (world,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "World"]
    names = {n.name for n in world.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    names |= {t.attr for n in ast.walk(world) if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
              and not t.attr.startswith("_")}
    contract = {n for cls in Recoverable.__mro__ if cls.__module__ == "elastic.comm._group"
                for n in vars(cls) if not n.startswith("_")}
    assert names == contract | {"mpi"} and len(names) <= 23, sorted(names)


def test_the_product_never_unpickles_or_calls_mpi4py_object_methods():
    """pickle is not imported, and no communicator's lowercase (pickling) method is called: every
    value between processes goes through ``wire`` (the fault test checks the same at run time)."""
    import re
    root = Path(__file__).resolve().parents[1]
    calls = re.compile(r"\b(comm|universe|merged|inter|parent|members\.comm)\.(bcast|allgather|alltoall|gather|"
                       r"scatter|send|recv|isend|irecv|sendrecv|reduce|allreduce|scan)\(")
    found = []
    for path in [p for d in ("elastic", "comm", "recovery") for p in sorted((root / d).rglob("*.py"))]:
        text = path.read_text()
        found += [f"{path.name}: import pickle" for _ in re.finditer(r"^\s*(import|from) pickle\b", text, re.M)]
        found += [f"{path.name}: {m.group(0)}" for m in calls.finditer(text)]
    assert not found


def test_every_event_written_or_read_is_in_the_schema():
    """The library writes exactly the events ``elastic.comm.events.EVENTS`` lists, and the report,
    the launcher, the scripts and the tests read no other name (a typo on either side fails here,
    not as an empty timeline). Programs' own events (the examples') are allowed to readers."""
    import re
    from elastic.comm.events import EVENTS
    root = Path(__file__).resolve().parents[1]

    def found(dirs: tuple[str, ...], pattern: str) -> set[str]:
        paths = [p for d in dirs for p in sorted((root / d).rglob("*.py"))]
        return {m.group(1) for p in paths for m in re.finditer(pattern, p.read_text())}

    emits = r'emit\(\s*"([a-z_]+)"'
    assert found(("elastic", "comm", "recovery"), emits) == set(EVENTS)
    programs = found(("examples", "tests/programs", "scripts"), emits)
    reads = found(("elastic", "scripts", "tests"), r'"event"\]\s*==\s*"([a-z_]+)"')
    reads |= found(("elastic",), r'\bkind\s*==\s*"([a-z_]+)"') - {"numpy", "python"}  # the report's; handlers' kinds
    reads |= found(("tests",), r'\.of\("([a-z_]+)"\)')
    assert reads and reads <= set(EVENTS) | programs, sorted(reads - set(EVENTS) - programs)


def test_every_event_field_the_report_and_the_launcher_read_is_written_somewhere():
    """A field the readers take from an event (``e["x"]``, ``e.get("x")``) is one some ``emit`` call
    writes, or one every event carries: a reader of a field nothing writes shows '-' for ever (the
    report once summed a rebuild phase, ``shrink``, that no rebuild timed)."""
    import ast
    import dataclasses

    from elastic.comm.events import _CONTEXT, REBUILD_PHASES
    from elastic.comm.faults import Injection
    root = Path(__file__).resolve().parents[1]
    written = set(_CONTEXT) | {f.name for f in dataclasses.fields(Injection)} | {"began", "mpi_start", "mpi_init"}
    written |= {"after_finish", "kind", "message", "step", "grad_norm"}  # the error's fields dict; step metrics
    for folder in ("comm", "recovery", "elastic"):
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit":
                    written |= {k.arg for k in node.keywords if k.arg}
    read: dict[str, list[str]] = {}
    events = {"e", "x", "first_after", "last"}  # what the readers call an event
    for name in ("elastic/report.py", "elastic/_supervise.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in events:
                key = node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in events and node.args:
                key = node.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                read.setdefault(key.value, []).append(f"{name}:{node.lineno}")
    assert read and not {k: v for k, v in read.items() if k not in written}
    assert "shrink" not in REBUILD_PHASES and "agree" in REBUILD_PHASES


def test_the_errors_kinds_say_what_to_do_next_and_are_all_programming_errors():
    """A refused commit, a restore before any commit and a foreign message are kinds of ConfigError (old
    handlers still catch them), and one rank dying of any of them stops the job as a programming error."""
    from elastic.comm.events import PROGRAMMING_ERRORS, describe_end
    from elastic.comm.wire import ProtocolError
    from elastic.recovery import CommitRejected, NothingCommitted
    for kind in (CommitRejected, NothingCommitted, ProtocolError):
        assert issubclass(kind, ConfigError)
        end = describe_end({"status": "failed", "kind": kind.__name__, "message": "m", "step": 3}, None)
        assert end is not None and end["programming"], kind
    assert set(PROGRAMMING_ERRORS) == {"ConfigError", "CommitRejected", "NothingCommitted", "ProtocolError"}


def test_a_node_kill_ends_with_the_killers_own_sentinel():
    """The rank that kills its node dies with its sentinel (the parent-death signal): every other
    process of the node must be killed before it, its ancestors last, whatever order the walk found."""
    from elastic.comm.faults import _kill_order
    node = [10, 30, 31, 20, 21]  # the daemon, then sentinels and their ranks as the walk met them
    assert _kill_order(node, me=31, ancestors=[30, 10, 1]) == [20, 21, 10, 30]
    assert _kill_order(node, me=21, ancestors=[20, 10, 1]) == [30, 31, 10, 20]


def test_a_commit_in_process_memory_receives_into_the_buffer_the_retired_version_held():
    """A fresh buffer is first touched inside the commit's exchange (the kernel zeroing every page:
    most of a 128 MB exchange's time over a same-size Sendrecv); the retired version's is reused."""
    import numpy as np

    from elastic.recovery._backing import ProcessMemory

    memory = ProcessMemory()
    first = memory.receive_buffer(4096, 1)
    own = memory.keep(1, [np.arange(8, dtype=np.uint8)], 8, None, None, list)
    second = memory.receive_buffer(4096, 2)
    assert second is not first  # version 1's copies are still current while version 2 comes in
    memory.keep(2, [np.arange(8, dtype=np.uint8) + 1], 8, own, first, list)  # version 1 retired
    assert memory.receive_buffer(4096, 3) is first
    memory.keep(3, [np.arange(8, dtype=np.uint8)], 8, None, second, list)
    assert memory.receive_buffer(2048, 4) is not second  # another size: a buffer of its own


def test_open_mpi_s_notices_of_interrupted_collectives_are_hidden_and_counted_nothing_else():
    import io

    from elastic._supervise import _Output

    class Sink:
        buffer = io.BytesIO()

        def flush(self):
            pass

    text = (b"step 3\nNBC_Progress: an error 75 occurred\n\nError in NBC_Start_round() (-1)\n"
            b"Error in my program\n")
    out = _Output(io.BytesIO(text), Sink())
    out.run()
    assert Sink.buffer.getvalue() == b"step 3\nError in my program\n" and out.hidden == 2


def test_a_program_file_that_does_not_exist_is_refused_before_anything_starts(capsys, tmp_path):
    from elastic._plan import missing_program, parse_args

    assert launch.main(["-n", "2", "--run-dir", str(tmp_path), "--", sys.executable, "-u", "no/such/train.py"]) == 2
    assert "the Python program 'no/such/train.py' does not exist" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
    assert missing_program(parse_args(["-n", "2", "--", sys.executable, "-m", "elastic.nothing"])) is None
    assert missing_program(parse_args(["-n", "2", "--", sys.executable, "examples/train.py"])) is None
    assert missing_program(parse_args(["--host", "a:2", "-n", "2", "--", "python", "x.py"])) is None  # its path there


def test_the_launcher_says_what_to_do_about_an_operation_the_group_lacks_and_a_missing_torch():
    from elastic._supervise import Summary, why_failed

    def failed(message, logical):
        return {"status": "failed", "kind": "RuntimeError", "message": message, "logical": logical, "gen": 0,
                "t": float(logical),
                "traceback": ["  File \"train.py\", line 3, in <module>", f"RuntimeError: {message}"]}

    def summary(*outcomes):
        return Summary(False, len(outcomes), {}, [], None, [], [], list(outcomes), [])

    lines = why_failed(summary(failed("No backend type associated with device type cpu", 1),
                               failed("No backend type associated with device type cpu", 0)))
    assert lines[0] == "the first failure's traceback (logical rank 0, generation 0):"
    assert any("failed the same way" in line for line in lines)
    assert any("backend='gloo'" in line for line in lines)
    lines = why_failed(summary(failed("No module named 'torch'", 0), failed("something else", 1)))
    assert not any("same way" in line for line in lines) and any("pip install" in line for line in lines)
    assert why_failed(summary()) == []


@pytest.mark.parametrize("module", ["elastic.distributed", "elastic.data"])
def test_a_part_that_needs_torch_says_what_to_install_where_torch_cannot_be_imported(module):
    """torch blocked as a broken install blocks it: the project's sentence, on import, not torch's
    ``import of torch halted``; the parts that need no torch import as before."""
    import subprocess

    code = f"import sys; sys.modules['torch'] = None; import elastic, elastic.mesh; elastic.TorchState; import {module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ModuleNotFoundError: {module} needs torch, which this Python cannot import")
    assert "pip install -c constraints.txt -e '.[torch]'" in last


def test_a_job_uses_a_warm_process_shared_by_jobs_only_where_it_serves_and_the_job_needs_none_of_its_own(
        tmp_path, monkeypatch):
    import socket

    from elastic.launch import WARM_SERVER_ENV, _shared_warm
    from elastic._plan import parse_args

    path = str(tmp_path / "warm.sock")
    plan = parse_args(["-n", "2", "--", sys.executable, "examples/train.py"])
    monkeypatch.delenv(WARM_SERVER_ENV, raising=False)
    assert _shared_warm(plan) is None  # not set: the job starts its own
    monkeypatch.setenv(WARM_SERVER_ENV, path)
    assert _shared_warm(plan) is None  # nothing listens there
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(4)
        assert _shared_warm(plan) == (path, os.getpid())  # its pid from the socket's peer credentials
        for own in (["--cold"], ["--simulate-nodes", "2"], ["--host", "a:2,b:2"]):
            assert _shared_warm(parse_args(["-n", "2", *own, "--", sys.executable, "examples/train.py"])) is None, own
        cold = tmp_path / "cold.py"
        cold.write_text("# elastic: cold-start\n")
        assert _shared_warm(parse_args(["-n", "2", "--", sys.executable, str(cold)])) is None
