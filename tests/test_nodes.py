"""Several nodes: the simulated-node test bed (fake nodes on this machine), process failures across
nodes (tier 1), and what the loss of a whole node does today.

The fake nodes need root (``unshare --uts --mount``, a tmpfs per node): elsewhere these tests skip,
saying so. Each runs real processes under ``mpiexec --with-ft ulfm`` with a timeout.
"""
from __future__ import annotations

import pytest

from conftest import assert_bitwise, launch
from elastic import _nodes, launch as launcher
from elastic.comm import ConfigError

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
    job = launch(tmp_path, 4, "--simulate-nodes", "2", "--spares", "1", "--inject", "node1@20", program=TRAIN)
    assert job.rc == 1, job.output
    assert "node(s) node1 lost with every process on them" in job.output
    killer = [o for o in job.outcomes if o["status"] == "injected-node"]
    assert [(o["logical"], o["host"], o["step"]) for o in killer] == [(3, "node1", 20)]
    assert not [o for o in job.outcomes if o["status"] == "finished"]
    assert "killed its node (node1) by injection at step 20" in job.output


def test_node_injections_name_the_first_rank_of_the_node():
    hosts = _nodes.simulated_hosts(3, 7)  # 3 slots per node: ranks 0-2, 3-5, 6
    assert hosts == [("node0", 3), ("node1", 3), ("node2", 3)]
    ranks_on = _nodes.Placement.first(hosts, 7, 0).ranks_on()
    assert _nodes.node_injections("node1@20,2@5/g1,node2@c7/g1", ranks_on) == "3@20:node,2@5/g1,6@c7:node/g1"
    with pytest.raises(ConfigError, match="node3 holds no active rank"):
        _nodes.node_injections("node3@2", ranks_on)
    with pytest.raises(ConfigError, match="node2 holds no active rank"):
        _nodes.node_injections("node2@2", _nodes.Placement.first(hosts, 6, 1).ranks_on())  # only the spare


def test_a_node_kill_without_simulated_nodes_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        launcher.parse_args(["-n", "4", "--inject", "1@3:node", "--", "python", "x.py"])
    assert "only simulated nodes" in capsys.readouterr().err
