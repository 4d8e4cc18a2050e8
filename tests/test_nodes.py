"""Several nodes: the simulated-node test bed (fake nodes on this machine), process failures across
nodes (tier 1), and the loss of a whole node (tier 2: a relaunch from the other nodes' memory).

The fake nodes need root (``unshare --uts --mount``, a bind mount per node): elsewhere these tests
skip, saying so. Each runs real processes under ``mpiexec --with-ft ulfm`` with a timeout.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_bitwise, launch
from elastic import _nodes, launch as launcher
from elastic.comm import Config, ConfigError
from elastic.comm._config import Relaunch
from elastic.recovery._placement import Layout, pieces
from elastic.report import format_report, start_up, timeline

TRAIN = ("examples/train.py",)


def _why_no_fake_nodes() -> str | None:
    try:
        _nodes.check_can_simulate()
    except ConfigError as exc:
        return str(exc)
    return None


WHY_NOT = _why_no_fake_nodes()
needs_fake_nodes = pytest.mark.skipif(WHY_NOT is not None, reason=f"no simulated nodes here: {WHY_NOT}")


@pytest.mark.fault
@needs_fake_nodes
def test_a_spare_on_another_node_replaces_a_killed_rank_bitwise(tmp_path, reference):
    # 2 nodes x 3 slots: ranks 0-2 on node0, rank 3 and the spare on node1 (TCP between them).
    job = launch(tmp_path, 4, "--simulate-nodes", "2", "--spares", "1", "--inject", "1@13", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")  # the same bits as on one node
    hosts = {o["logical"]: o["host"] for o in job.outcomes if o["status"] == "finished"}
    assert hosts == {0: "node0", 1: "node1", 2: "node0", 3: "node1"}, job.outcomes
    assert [o["host"] for o in job.outcomes if o["status"] == "injected-kill"] == ["node0"]
    assert "--mca coll ^han" in job.output  # the flat collectives: coll/han crashes after a failure
    assert job.summary["relaunches"] == 0 and not job.of("store_attached")  # tier 1 did it, in process


@pytest.mark.fault
@needs_fake_nodes
def test_hosts_reached_through_the_users_agent_fork_their_ranks_from_their_own_warm_process(tmp_path, reference):
    """Hosts given as mpirun takes them (``--host``) and the agent that reaches them
    (``plm_rsh_agent``, here one that starts fake nodes as ssh would: its own process in between):
    each host gets its warm process through that agent, every rank (the spare on node1 that takes
    logical 3's place too) is forked by its own host's, never by the launcher's or another host's,
    and the run is bitwise. At the end each warm process has ended on its closed input, though the
    launcher killed only the agent's process, as it can only kill the ssh that carries a remote one."""
    node_agent = _nodes.write_agent(tmp_path, tmp_path / "memory")
    agent = tmp_path / "ssh.sh"
    agent.write_text(f'#!/bin/sh\n"{node_agent}" "$@"\n')  # not exec: like ssh, a process of its own in between
    agent.chmod(0o700)
    job = launch(tmp_path, 4, "--host", "node0:2,node1:3", "--mca", "plm_rsh_agent", str(agent), "--spares", "1",
                 "--inject", "3@13", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    hosts = {o["logical"]: o["host"] for o in job.outcomes if o["status"] == "finished"}
    assert hosts == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}, job.outcomes
    assert [o["host"] for o in job.outcomes if o["status"] == "injected-kill"] == ["node1"]
    host_of = {o["pid"]: o["host"] for o in job.outcomes}
    forked = [(host_of[e["pid"]], e["warm"], e["warm_host"]) for e in job.of("started")]
    assert sorted(forked) == [("node0", True, "node0")] * 2 + [("node1", True, "node1")] * 3, forked
    socket_path = f"/dev/shm/{job.summary['job']}.warm".encode()
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and socket_path in _cmdline(p)]
    assert not left, [_cmdline(p) for p in left]
    assert "left behind by the job" not in job.output  # none was killed as a leftover of mpiexec's runs either


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.fault
@needs_fake_nodes
def test_a_spawned_process_replaces_a_killed_rank_across_nodes_bitwise(tmp_path, reference):
    """Spawn needs a free slot: PRRTE keeps a dead process's, so with every slot taken Spawn failed
    (MPI_ERR_UNKNOWN) until the launcher allowed oversubscription for jobs that may spawn."""
    job = launch(tmp_path, 4, "--simulate-nodes", "2", "--rebuild", "spawn", "--inject", "1@13", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    assert [e["host"] for e in job.outcomes if e["role"] == "recovered" and e["status"] == "finished"] == ["node0"]
    assert "--oversubscribe" in job.output and not job.of("spawn_failed")


@pytest.mark.fault
@needs_fake_nodes
def test_shrink_across_nodes_keeps_the_global_batches(tmp_path, reference):
    program = TRAIN + ("--dropout", "0")
    job = launch(tmp_path, 4, "--simulate-nodes", "2", "--rebuild", "shrink", "--inject", "3@13", program=program)
    assert job.rc == 0, job.output
    ref = reference(program)
    assert job.result["size"] == 3 and job.result["steps"] == ref["result"]["steps"]
    assert abs(job.result["final_loss"] - ref["result"]["final_loss"]) <= 1e-5 * abs(ref["result"]["final_loss"])


@pytest.mark.fault
@needs_fake_nodes
def test_losing_a_node_ends_the_job_naming_it(tmp_path):
    """node1@20 kills node 1's daemon, every process on it and its memory: Open MPI 5.0 then ends
    every rank everywhere. The launcher says which node, how each process ended, and exits 1."""
    job = launch(tmp_path, 4, "--simulate-nodes", "2", "--spares", "1", "--inject", "node1@20", "--relaunches", "0",
                 program=TRAIN)
    assert job.rc == 1, job.output
    assert "node(s) node1 lost with every process on them" in job.output
    killer = [o for o in job.outcomes if o["status"] == "injected-node"]
    assert [(o["logical"], o["host"], o["step"]) for o in killer] == [(3, "node1", 20)]
    assert not [o for o in job.outcomes if o["status"] == "finished"]
    assert "killed its node (node1) by injection at step 20" in job.output


# ---------------------------------------------------------------------------- tier 2
THREE_NODES = ("--simulate-nodes", "3")  # 2 ranks each: logical 0-1 on node0, 2-3 on node1, 4-5 on node2
STEPS = ("--steps", "40")


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """Failure-free runs on 3 fake nodes x 2 ranks, by program arguments, computed once each."""
    cache: dict[tuple[str, ...], dict] = {}

    def get(program: tuple[str, ...]) -> dict:
        if program not in cache:
            job = launch(tmp_path_factory.mktemp("six"), 6, *THREE_NODES, program=program)
            assert job.rc == 0, job.output
            cache[program] = {"result": job.result}
        return cache[program]
    return get


def _relaunched(job) -> list[dict]:
    """The store_attached events of the relaunches: which versions each rank found, which was chosen."""
    return job.of("store_attached")


@pytest.mark.fault
@needs_fake_nodes
def test_a_lost_node_without_a_spare_node_shrinks_to_the_others(tmp_path, six):
    program = TRAIN + STEPS + ("--dropout", "0")
    job = launch(tmp_path, 6, *THREE_NODES, "--inject", "node1@20", program=program)
    assert job.rc == 0, job.output
    ref = six(program)["result"]
    assert job.result["size"] == 4 and job.result["steps"] == ref["steps"]
    assert abs(job.result["final_loss"] - ref["final_loss"]) <= 1e-5 * abs(ref["final_loss"])
    assert "logical ranks [2, 3] removed (shrink)" in job.output
    finished = sorted(o["logical"] for o in job.outcomes if o["status"] == "finished")
    assert finished == [0, 1, 4, 5]


@pytest.mark.fault
def test_a_killed_runtime_is_relaunched_on_the_same_host_from_its_memory(tmp_path, reference):
    """prterun killed at step 20 (no node lost): every process is ended; the relaunch on the
    same host takes version 4 (step 20's) back from the files its ranks left in /dev/shm."""
    program = TRAIN + STEPS
    job = launch(tmp_path, 4, "--relaunches", "1", "--inject", "2@20:runtime", program=program)
    assert_bitwise(job, reference(program), "optimizer_sha256")
    assert job.summary["relaunches"] == 1 and job.summary["lost_nodes"] == []
    assert "the runtime ended unfinished: relaunch 1 of 1" in job.output
    attached = _relaunched(job)
    assert len(attached) == 4 and {a["chosen"] for a in attached} == {4}
    assert all(e["dead"] == [] and e["bytes_moved"] == 0 for e in job.of("store_recovered"))  # all local
    assert not (Path("/dev/shm") / job.summary["job"]).exists()  # the node memory is freed at the end


def _domains_that_keep_a_chunk_on_node1() -> str:
    """ELASTIC_DOMAINS (round robin over the logical ranks) under which some chunk of logical rank 2
    or 3 has its only copy on the other one: both on node1. train.py's state is one chunk per rank."""
    for names in ("a,b", "a,b,c", "a,a,b,c,a,a", "a,b,a,b,c,c", "a,b,c,c,a,b"):
        domain = names.split(",")
        layout = Layout.of({r: domain[r % len(domain)] for r in range(6)})
        holders = {p.owner: p.holder for owner in (2, 3) for p in pieces(layout, owner, 1, 2)}
        if holders == {2: 3, 3: 2} or holders.get(2) == 3 or holders.get(3) == 2:
            return names
    raise AssertionError("no arrangement of domains puts a copy of node1's state on node1")


@pytest.mark.fault
@needs_fake_nodes
def test_a_lost_node_that_held_every_copy_of_a_chunk_is_data_lost(tmp_path):
    domains = _domains_that_keep_a_chunk_on_node1()
    job = launch(tmp_path, 6, *THREE_NODES, "--spare-nodes", "1", "--inject", "node1@20", program=TRAIN + STEPS,
                 env={"ELASTIC_DOMAINS": domains})
    assert job.rc == 1, job.output
    assert job.summary["relaunches"] == 1
    assert job.summary["stopped_by"]["kind"] == "DataLost", job.summary["stopped_by"]
    lost = {int(o) for e in job.of("data_lost") for o in e["lost"]}
    assert lost and lost <= {2, 3}, job.of("data_lost")
    assert "DataLost" in job.output and not [o for o in job.outcomes if o["status"] == "finished"]


@pytest.mark.fault
@needs_fake_nodes
def test_a_node_lost_in_a_commit_rolls_back_to_the_last_agreed_version(tmp_path, six):
    """Killed in version 4's transfer: no node sealed it, so the relaunch resumes from version 3."""
    program = TRAIN + STEPS
    job = launch(tmp_path, 6, *THREE_NODES, "--spare-nodes", "1", "--inject", "node1@commit4", program=program)
    assert_bitwise(job, six(program), "optimizer_sha256")
    assert {a["chosen"] for a in _relaunched(job)} == {3}
    assert max(v for a in _relaunched(job) for v in a["versions"]) == 3


@pytest.mark.fault
@needs_fake_nodes
def test_two_nodes_lost_one_after_the_other_the_second_a_spare_node_fast_steps(tmp_path, reference):
    """2 nodes x 2 ranks + 2 spare nodes, steps of a few ms. node1 dies at step 12: the survivors on
    node0 see a whole host's processes gone and wait for the runtime's end instead of shrinking in
    the ~0.1 s before it (which let a fast run finish on 2 ranks, rc 0, another model); the relaunch
    puts ranks 2, 3 on spare node2, which then dies at step 25 (its injection waited for a launch
    that uses it): a second relaunch onto node3, bitwise the failure-free run."""
    program = TRAIN + STEPS
    job = launch(tmp_path, 4, "--simulate-nodes", "2", "--spare-nodes", "2", "--inject", "node1@12,node2@25",
                 program=program)
    assert_bitwise(job, reference(program), "optimizer_sha256")
    assert job.summary["relaunches"] == 2 and job.summary["lost_nodes"] == ["node1", "node2"]
    hosts = {o["logical"]: o["host"] for o in job.outcomes if o["status"] == "finished"}
    assert hosts == {0: "node0", 1: "node0", 2: "node3", 3: "node3"}, job.outcomes
    assert not [e for e in job.of("rebuilt") if e["mode"] != "relaunch"]  # no tier-1 shrink slipped in
    killers = [(o["host"], o["step"]) for o in job.outcomes if o["status"] == "injected-node"]
    assert killers == [("node1", 12), ("node2", 25)], killers
    # The first relaunch: every rank takes the last agreed version; node1's memory died with it, so
    # its ranks found nothing and fetched their state from node0's copies.
    first = min(a["gen"] for a in _relaunched(job))
    attached = [a for a in _relaunched(job) if a["gen"] == first]
    committed = max(e["version"] for e in job.of("committed") if e["t"] < min(a["t"] for a in attached))
    assert {(a["logical"], a["chosen"]) for a in attached} == {(r, committed) for r in range(4)}
    found = {a["logical"]: a["versions"] for a in attached}
    assert found[2] == found[3] == [] and found[0] == found[1] == [committed]
    recovered = [e for e in job.of("store_recovered") if e["gen"] == first]
    assert recovered and all(e["dead"] == [2, 3] for e in recovered)
    assert "relaunch 1 of 2 on node0, node2" in job.output and "relaunch 2 of 2 on node0, node3" in job.output
    rows = [r for r in timeline(job.events) if r["mode"] == "relaunch"]  # the report shows each as a recovery
    assert len(rows) == 2 and all(r["failed"] == [2, 3] and r["down"] > 0 and r["restore"] > 0 for r in rows)
    # Every rank, on a surviving node and on the spare ones, forked from its own node's warm process
    # (one per node, spare nodes too, started through the node agent): none from another host's;
    # the report names each relaunch's phases and the slowest.
    assert [e["warm"] for e in job.of("started")] == [True] * 12
    by_launch = {n: {e["logical"]: e["warm_host"] for e in job.of("started") if e.get("relaunch", 0) == n}
                 for n in range(3)}
    assert by_launch == {0: {0: "node0", 1: "node0", 2: "node1", 3: "node1"},
                         1: {0: "node0", 1: "node0", 2: "node2", 3: "node2"}, 2: hosts}, by_launch
    phases = [start_up(job.events, r["gen"], r["t_failure"], job.run_dir) for r in rows]
    assert all(list(p) == ["teardown", "runtime", "process", "mpi_init", "join", "attach", "fetch", "resume"]
               and all(v >= 0 for v in p.values()) for p in phases), phases
    assert format_report(job.run_dir).count("the relaunch by phase (s): teardown") == 2


@pytest.mark.fault
@needs_fake_nodes
def test_a_node_lost_during_the_relaunch(tmp_path, six):
    """node2 dies while the first relaunch fetches node1's state from it (``restore``: what has not
    fired fires in the relaunch, its generations counted from there); with three copies of every
    chunk (one per node) node0 still holds everything, and a second relaunch finishes the run."""
    program = TRAIN + STEPS + ("--replication", "3")
    job = launch(tmp_path, 6, *THREE_NODES, "--spare-nodes", "2", "--inject", "node1@20,node2@restore",
                 program=program)
    assert_bitwise(job, six(TRAIN + STEPS), "optimizer_sha256")  # the copies do not change the training
    assert job.summary["relaunches"] == 2 and job.summary["lost_nodes"] == ["node1", "node2"]
    killers = [(o["host"], o["injection"]["point"]) for o in job.outcomes if o["status"] == "injected-node"]
    assert killers == [("node1", "step"), ("node2", "restore")], killers


CG = ("examples/cg.py", "--n", "96", "--commit-every", "5")  # strips: rank-unique, what parity covers


@pytest.mark.fault
@needs_fake_nodes
@pytest.mark.parametrize("redundancy", ["xor:3", "rs:3+2"])
def test_a_lost_node_comes_back_from_the_parity_in_the_other_nodes_memory_bitwise(tmp_path, six, redundancy):
    """Groups of 3, one member per node ({0, 2, 4}, {1, 3, 5}): node1 lost at step 20 costs each
    group one member; the relaunch attaches node0's and node2's payloads and parity from their
    memory and decodes ranks 2, 3 on the spare node, bitwise the failure-free run."""
    job = launch(tmp_path, 6, *THREE_NODES, "--spare-nodes", "1", "--redundancy", redundancy,
                 "--inject", "node1@20", program=CG)
    assert job.rc == 0, job.output
    assert (job.result["x_sha256"], job.result["steps"]) == (six(CG)["result"]["x_sha256"], six(CG)["result"]["steps"])
    assert job.summary["relaunches"] == 1 and job.summary["lost_nodes"] == ["node1"]
    attached = _relaunched(job)
    chosen = {a["chosen"] for a in attached}
    assert len(attached) == 6 and len(chosen) == 1, attached
    found = {a["logical"]: a["versions"] for a in attached}
    assert found[2] == found[3] == [] and all(found[r] == sorted(chosen) for r in (0, 1, 4, 5)), found
    recovered = [e for e in job.of("store_recovered") if e["gen"] == min(a["gen"] for a in attached)]
    assert len(recovered) == 6 and all(e["dead"] == [2, 3] for e in recovered), recovered
    assert all(e["came_back"] == {"2": "parity", "3": "parity"} for e in recovered), recovered
    hosts = {o["logical"]: o["host"] for o in job.outcomes if o["status"] == "finished"}
    assert hosts == {0: "node0", 1: "node0", 2: "node3", 3: "node3", 4: "node2", 5: "node2"}, job.outcomes


def test_the_relaunch_takes_the_newest_version_whose_groups_lost_no_more_than_their_parity_survives():
    from elastic.recovery._backing import newest_whole as _newest_whole
    from elastic.recovery._parity import Redundancy
    from elastic.recovery._paritystore import group_and_code, parity_recoverable
    layout = Layout.of({r: f"node{r // 2}" for r in range(6)})
    assert {group_and_code(layout, r, Redundancy.parse("xor:3"))[0] for r in range(6)} == {(0, 2, 4), (1, 3, 5)}
    sizes = {r: 100 for r in range(6)}
    whole = (sizes, True, True)
    # node1's ranks 2, 3 are new (spare node): each group lost one member. Version 5: rank 4 sealed its
    # payload but not its parity, so group (0, 2, 4) lacks two: not whole; version 4 is.
    offers = [{5: whole, 4: whole}, {5: whole, 4: whole}, {}, {}, {5: (sizes, True, False), 4: whole},
              {5: whole, 4: whole}]
    xor = parity_recoverable(Redundancy.parse("xor:3"))
    assert _newest_whole(offers, list(range(6)), lambda v: layout, xor) == 4
    assert _newest_whole(offers, list(range(6)), lambda v: layout, parity_recoverable(Redundancy.parse("rs:3+2"))) == 5
    lost_two = [whole, {}, {}, {}, whole, whole]  # ranks 1-3: group (1, 3, 5) lost two of three
    assert not xor(layout, [1, 2, 3], {0, 4, 5}, sizes) and _newest_whole(
        [{4: o} if o else {} for o in lost_two], list(range(6)), lambda v: layout, xor) == 4  # none whole: the newest


def test_node_injections_name_the_first_rank_of_the_node():
    hosts = _nodes.simulated_hosts(3, 7)  # 3 slots per node: ranks 0-2, 3-5, 6
    assert hosts == [("node0", 3), ("node1", 3), ("node2", 3)]
    ranks_on = _nodes.Placement.first(hosts, 7, 0).ranks_on()
    assert _nodes.node_injections("node1@20,2@5/g1,node2@c7/g1", ranks_on) == "3@20:node,2@5/g1,6@c7:node/g1"
    with pytest.raises(ConfigError, match="node3 holds no active rank"):
        _nodes.node_injections("node3@2", ranks_on)
    with pytest.raises(ConfigError, match="node2 holds no active rank"):
        _nodes.node_injections("node2@2", _nodes.Placement.first(hosts, 6, 1).ranks_on())  # only the spare
    # A spare node holds ranks only after a relaunch: its entries wait for the launch that uses it.
    assert _nodes.node_injections("node1@12,node3@25", ranks_on, later=["node3"]) == "3@12:node"


def test_a_node_kill_without_simulated_nodes_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        launcher.parse_args(["-n", "4", "--inject", "1@3:node", "--", "python", "x.py"])
    assert "only simulated nodes" in capsys.readouterr().err


# ---------------------------------------------------------------------------- tier 2's logic, no MPI
def _three_nodes() -> _nodes.Placement:
    return _nodes.Placement.first(_nodes.simulated_hosts(3, 6), 6, 0)


def test_a_lost_nodes_ranks_go_to_a_spare_node_in_the_same_order():
    before = _three_nodes()
    live_on = {0: "node0", 1: "node0", 2: "node1", 3: "node1", 4: "node2", 5: "node2"}
    placement, relaunch, left = _nodes.replan(before, live_on, {"node1"}, ["node3", "node4"], Config(), 1, 3, 6, True)
    assert placement.hosts == [("node0", [0, 1]), ("node2", [4, 5]), ("node3", [2, 3])]
    assert relaunch.table == (0, 1, 4, 5, 2, 3) and left == ["node4"]
    assert (relaunch.failed, relaunch.replaced, relaunch.removed) == ((2, 3), (2, 3), ())
    assert (relaunch.count, relaunch.generation, relaunch.lost_nodes, relaunch.committed) == (1, 3, ("node1",), True)


def test_without_a_spare_node_the_lost_ranks_are_removed_or_the_launcher_gives_up():
    before = _three_nodes()
    live_on = {r: f"node{r // 2}" for r in range(6)}
    placement, relaunch, _ = _nodes.replan(before, live_on, {"node2"}, [], Config(spares=1), 1, 1, 6, True)
    assert relaunch.removed == (4, 5) and relaunch.replaced == ()
    assert placement.hosts == [("node0", [0, 1, _nodes.SPARE]), ("node1", [2, 3])]  # the parked spare too
    with pytest.raises(_nodes.GiveUp, match="no spare node is left.*does not shrink"):
        _nodes.replan(before, live_on, {"node2"}, [], Config(rebuild=("spare",)), 1, 1, 6, True)
    with pytest.raises(_nodes.GiveUp, match="only 4 active ranks are left; the job needs at least 5"):
        _nodes.replan(before, live_on, {"node2"}, [], Config(min_size=5), 1, 1, 6, True)


def test_ranks_are_placed_where_the_last_agreed_commit_had_them(tmp_path):
    """A rebuild the runtime's end cut short (generation 1, ranks 2-3 gone) does not count: the
    relaunch resumes from version 4, whose payloads lie on the hosts of its commit."""
    def events(host: str, pid: int, *records: dict) -> None:
        lines = [json.dumps({"event": e, "t": t, "pid": pid, "logical": r, "gen": g, "role": "initial", **more})
                 for e, t, r, g, more in records]
        (tmp_path / f"events-{host}-{pid}.jsonl").write_text("\n".join(lines) + "\n")
    for logical, host, pid in ((0, "node0", 10), (1, "node0", 11), (2, "node1", 12), (3, "node1", 13)):
        events(host, pid, ("committed", 1.0, logical, 0, {"version": 3}),
               *([("committed", 2.0, logical, 0, {"version": 4})] if logical != 3 else []),  # 3: frozen first
               *([("rebuilt", 3.0, logical, 1, {})] if host == "node0" else []))
    events("node5", 99, ("committed", 1.0, 0, 0, {"version": 9}))  # another launch's process
    generation, owners, host_of = _nodes.where_ranks_live(tmp_path, {10, 11, 12, 13})
    assert generation == 1 and owners == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    assert host_of == {10: "node0", 11: "node0", 12: "node1", 13: "node1"}


def test_a_relaunch_owes_only_the_injections_that_did_not_fire():
    fired = [{"pid": 7, "rank": 2, "step": 20, "point": "step", "action": "node", "gen": 0},
             {"pid": 8, "rank": 1, "step": 5, "point": "step", "action": "kill", "gen": 0}]
    text = "node1@20,1@5,1@30,node2@25,node3@restore"
    left = _nodes.pending_injections(text, fired, {"node3"}, {7: "node1", 8: "node0"})
    assert left == "1@30,node2@25"  # node1's fired, 1@5 fired, node3 is lost
    assert _nodes.pending_injections("node1@20", fired, set(), {7: "node1"}) is None


def test_the_plan_and_the_relaunch_planner_work_without_starting_anything(tmp_path):
    """The launcher's plan is decided from the command line alone, and the next launch after a lost
    host from the run's files and a probe: no MPI, no process of the job."""
    from elastic import _relaunch
    agent = tmp_path / "agent.sh"  # like ssh: AGENT HOST COMMAND; host "c" does not answer
    agent.write_text('#!/bin/sh\ncase "$1" in c) exit 255;; esac\nshift\nexec "$@"\n')
    agent.chmod(0o755)
    plan = launcher.parse_args(["--host", "a:2,b:2,c:2,d:2", "--spare-nodes", "2", "-n", "4",
                                "--inject", "1@5,3@9,0@30", "--mca", "plm_rsh_agent", str(agent),
                                "--run-dir", str(tmp_path), "--", "python", "x.py"])
    assert (plan.hosts, plan.spare_hosts, plan.relaunches) == ((("a", 2), ("b", 2)), ("c", "d"), 2)
    assert plan.placement.hosts == [("a", [0, 1]), ("b", [2, 3])] and plan.config.node_store == f"/dev/shm/{plan.job}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nprocs = 5  # type: ignore[misc]
    # The first launch: ranks 0-1 on a, 2-3 on b; version 1 committed; 1@5 fired; host b is lost.
    for logical, host, pid in ((0, "a", 10), (1, "a", 11), (2, "b", 12), (3, "b", 13)):
        records = [{"event": "committed", "t": 1.0, "version": 1}] + \
            ([{"event": "inject", "t": 2.0, "rank": 1, "step": 5, "point": "step", "action": "kill", "gen": 0}]
             if logical == 1 else [])
        (tmp_path / f"events-{host}-{pid}.jsonl").write_text("".join(
            json.dumps({"pid": pid, "logical": logical, "gen": 0, "role": "initial", **r}) + "\n" for r in records))
    nxt = _relaunch.next_launch(plan, plan.placement, plan.config, plan.spare_hosts, {10, 11, 12, 13}, {"b"}, set(), 1)
    # c does not answer the probe: b's ranks go to d, the next spare node, in the same order.
    assert nxt.placement.hosts == [("a", [0, 1]), ("d", [2, 3])] and nxt.probed == {"c"} and nxt.spare_hosts == ()
    assert (nxt.relaunch.failed, nxt.relaunch.replaced, nxt.relaunch.committed) == ((2, 3), (2, 3), True)
    # What did not fire is owed, its generations counted from the relaunch's first.
    assert [(e.rank, e.step, e.gen) for e in nxt.config.inject] == [(3, 9, 1), (0, 30, 1)]
    assert nxt.config.relaunch == nxt.relaunch and nxt.config.node_store == plan.config.node_store
    assert nxt.describe(plan, {"b"}) == ("node(s) b lost: relaunch 1 of 2 on a, d from the nodes' memory; "
                                         "logical ranks [2, 3] on spare node(s)")


def test_the_relaunch_takes_the_newest_version_the_live_ranks_hold_whole():
    from elastic.recovery._backing import copies_recoverable, newest_whole as _newest_whole
    layout = Layout.of({0: "a", 1: "a", 2: "b", 3: "b"})
    asked: list[int] = []

    def layout_of(version: int) -> Layout:
        asked.append(version)
        return layout
    sizes = {0: 100, 1: 100, 2: 100, 3: 100}
    # Ranks 0, 1 (node0) hold versions 4 and 5; ranks 2, 3 (new, on a spare node) hold nothing.
    # Version 5: rank 0 sealed it but its copies are not there (held=False): not whole.
    offers = [{5: (sizes, True, False), 4: (sizes, True, True)}, {5: (sizes, True, True), 4: (sizes, True, True)},
              {}, {}]
    assert _newest_whole(offers, [0, 1, 2, 3], layout_of, copies_recoverable(64, 2)) == 4 and asked == [5, 4]
    assert _newest_whole([{4: (sizes, True, False)}, {}, {}, {}], [0, 1, 2, 3], layout_of,
                         copies_recoverable(64, 2)) == 4  # none whole
    assert _newest_whole([{}, {}], [0, 1], layout_of, copies_recoverable(64, 2)) is None


def test_node_files_are_private_and_only_this_jobs_are_read(tmp_path):
    from elastic.recovery._nodestore import NodeFiles
    files = NodeFiles(str(tmp_path / "elastic-job1"), 3)
    data = files.create(7, "own", 16)
    data[:] = 5
    files.seal(7, {"owner": 3})
    assert oct(files.dir.stat().st_mode & 0o777) == "0o700"
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files.dir.iterdir()} == \
        {"v7.own": "0o600", "v7.json": "0o600"}
    assert [m["version"] for m in files.manifests()] == [7]
    assert files.open(7, "own", 16).tolist() == [5] * 16 and files.open(7, "own", 15) is None
    (files.dir / "v9.json").write_text(json.dumps({"job": "elastic-other", "version": 9}))  # a stale job's
    (files.dir / "v8.json").write_text("{half-written")
    assert [m["version"] for m in files.manifests()] == [7]
    files.retire(7)
    assert sorted(p.name for p in files.dir.iterdir()) == ["v7.json", "v7.own"]
    other = NodeFiles(str(tmp_path / "elastic-job1"), 5)  # a rank whose process died on this node
    files.prune({3})
    assert files.dir.exists() and not other.dir.exists()
    files.remove()
    assert not (tmp_path / "elastic-job1").exists()


def test_the_node_backing_keeps_only_voted_versions_and_finds_them_again(tmp_path):
    """Tier 2's part of a commit without MPI: staged before the vote, kept (older versions and
    ranks gone from the node removed) or abandoned after it; a relaunch finds what was kept."""
    from elastic.recovery._backing import NodeMemory
    sums = lambda a: [int(a.sum())]  # noqa: E731  (a stand-in checksum, per payload)
    node = NodeMemory(str(tmp_path / "elastic-job1"), 3, ended=lambda: False)
    gone = NodeMemory(str(tmp_path / "elastic-job1"), 5, ended=lambda: False)  # its process died here
    for version in (1, 2):
        node.receive_buffer(8, version)[:] = version
        segments = [np.full(4, version, np.uint8), np.full(4, 10 * version, np.uint8)]
        node.stage(version, segments, 8, lambda payload: {
            "owner": 3, "chunk_bytes": 64, "way": "copies:2", "own": {"nbytes": 8, "sums": sums(payload)},
            "held": {"nbytes": 8}})
        if version == 1:
            assert node.keep(1, segments, 8, None, None, lambda: [3]).tolist() == [1] * 4 + [10] * 4
    node.abandon(1)  # version 2's vote failed: version 1 stays, alone
    assert sorted(p.name for p in node.files.dir.iterdir()) == ["v1.held", "v1.json", "v1.own"]
    assert not gone.files.dir.exists()  # pruned by the node's first rank when version 1 was kept
    found = node.found(3, 64, "copies:2", sums)
    assert list(found) == [1] and found[1][1].tolist() == [1] * 4 + [10] * 4 and found[1][2].tolist() == [1] * 8
    assert node.found(3, 128, "copies:2", sums) == {}  # another chunk size: another store's versions
    assert node.found(3, 64, "xor:4", sums) == {}  # parity's store reads no copies' versions
    (node.files.dir / "v1.own").write_bytes(bytes(8))  # damaged: the payload is not offered, the copies are
    again = node.found(3, 64, "copies:2", sums)
    assert again[1][1] is None and again[1][2].tolist() == [1] * 8


def test_a_relaunch_travels_in_the_environment():
    relaunch = Relaunch(2, 5, (0, 1, -1, 4), 6, (2, 3), (), (2, 3), ("node1",), True)
    config = Config(relaunch=relaunch, node_store="/dev/shm/elastic-x")
    assert Config.from_env(config.to_env()) == config


def test_a_host_that_does_not_answer_the_probe_is_lost(tmp_path):
    agent = tmp_path / "agent.sh"  # like ssh: AGENT HOST COMMAND; "slow" never answers, "down" refuses
    agent.write_text('#!/bin/sh\ncase "$1" in slow) exec sleep 30;; down) exit 255;; esac\nexec "$2"\n')
    agent.chmod(0o700)
    assert _nodes.unreachable(["up", "slow", "down"], slurm=False, agent=[str(agent)], timeout=1) == {"slow", "down"}
    assert _nodes.unreachable(["up"], slurm=False, agent=[str(tmp_path / "no-such-ssh")]) == set()  # cannot tell
    assert _nodes.slurm_says_dead("NodeName=n3 Arch=x86_64\n   State=DOWN+NOT_RESPONDING ThreadsPerCore=1")
    assert _nodes.slurm_says_dead("   State=IDLE+DRAIN ")
    assert not _nodes.slurm_says_dead("   State=ALLOCATED ThreadsPerCore=1")


def test_a_warm_process_reaches_a_host_the_way_mpiexecs_daemons_do(monkeypatch, tmp_path):
    """Outside Slurm: the ``plm_rsh_agent`` given (``--mca`` first, then the environment; of PRRTE's
    ``ssh : rsh`` form the first one found), else ssh that never prompts, with one shell command that
    carries the directory and the environment; inside an allocation an srun step that overlaps the job's
    on the whole node, bound to no core."""
    for name in ("OMPI_MCA_plm_rsh_agent", "PRTE_MCA_plm_rsh_agent"):
        monkeypatch.delenv(name, raising=False)
    assert _nodes.rsh_agent(()) == _nodes.SSH
    monkeypatch.setenv("PRTE_MCA_plm_rsh_agent", "no-such-agent -q : sh -e")
    assert _nodes.rsh_agent(()) == ["sh", "-e"]
    assert _nodes.rsh_agent([("plm_rsh_agent", "/opt/my ssh")]) == ["/opt/my", "ssh"]
    monkeypatch.chdir(tmp_path)
    argv = _nodes.on_host("n7", ["sh", "-c", 'pwd; echo "$A/$B"'], slurm=False, agent=["ssh", "-x"],
                          env={"B": "x y", "A": "1"})
    assert argv[:3] == ["ssh", "-x", "n7"] and len(argv) == 4  # ssh runs one line in the host's shell
    ran = subprocess.run(["sh", "-c", argv[3]], capture_output=True, text=True, timeout=30, cwd="/")
    assert ran.stdout.splitlines() == [str(tmp_path), "1/x y"], ran
    srun = _nodes.on_host("n7", ["python", "x.py"], slurm=True, agent=["ssh"], env={"A": "1"})
    assert srun[0] == "srun" and srun[-2:] == ["python", "x.py"] and "--nodelist=n7" in srun
    assert {"--overlap", "--whole", "--cpu-bind=none", "--ntasks=1"} <= set(srun)
