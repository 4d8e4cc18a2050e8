"""The store, State, elastic.run and the rebuild policy in a simulated job (threads, no MPI): the
combinations that would each cost a real job seconds. Every failure-table row keeps its real-kill test
under mpiexec (CONTRIBUTING.md); these check the logic around it."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import elastic
from elastic import ConfigError
from elastic.recovery import DataLost, Redundancy, share
from elastic.testing import SimJob

STEPS = 8


def _main(commit_every: int = 1, replication: int | None = 2, redundancy: str | None = None,
          chunk_bytes: int = 1 << 20, uneven: bool = False):
    """``uneven``: shards of a different length on each rank (a parity's padding), updated so that
    every step changes every bit pattern, returned as bytes (bitwise)."""
    def main(world):
        me = int(world.logical_rank)
        state = elastic.State(world, replication=replication, redundancy=redundancy, local=("shard",),
                              chunk_bytes=chunk_bytes, w=np.zeros(4), step=0,
                              **{f"shard.{me}": np.full(3 + 5 * me if uneven else 3, float(me))})

        @elastic.run
        def train(world, state):
            while state.step < STEPS:
                g = np.full(4, float(world.logical_rank + 1) * (state.step + 1))
                world.allreduce([g], step=state.step)
                state.w = state.w + g / world.size
                for name in state.names():
                    if name.startswith("shard."):
                        state[name] = state[name] * 1.5 + 1 if uneven else state[name] + 1
                state.step += 1
                state.record_step(state.step)
                if state.step % commit_every == 0:
                    state.commit()
            return {"w": state.w.tobytes().hex(),
                    "shards": {n: state[n].tobytes().hex() if uneven else state[n].tolist()
                               for n in sorted(state.names()) if n.startswith("shard.")}}
        return train(world, state)
    return main


@pytest.fixture(scope="module")
def reference():
    return SimJob(4).run(_main())


@pytest.mark.parametrize("spares, inject, modes", [
    (1, "1@3", ["spare"]),
    (1, "0@5", ["spare"]),                   # rank 0, the root of every broadcast
    (2, "1@3,2@3", ["spare"]),               # two at once: with three copies, one of each still alive
    (1, "1@3,2@6/g1", ["spare", "shrink"]),  # the spare used up: the second loss shrinks
    (1, "2@commit4", ["spare"]),             # inside a commit: version 4 never becomes current
    (2, "1@3,3@restore/g1", ["spare", "spare"]),  # a holder dies while sending recovery data
])
def test_a_lost_rank_comes_back_bitwise_from_its_peers_copies(reference, spares, inject, modes):
    job = SimJob(4, spares=spares, inject=inject, rebuild=("spare", "shrink"))
    got = job.run(_main(replication=3 if "," in inject else 2))
    assert [e["mode"] for e in job.of("rebuilt")] == modes
    if modes == ["spare"] * len(modes):
        assert got == reference  # every rank's model and shards, bitwise the failure-free run's
    assert len(job.of("inject")) == inject.count(",") + 1


def test_after_a_shrink_the_survivors_adopt_the_removed_ranks_values():
    job = SimJob(4, inject="1@3", rebuild=("shrink",))
    got = job.run(_main())
    assert sorted(got) == [0, 2, 3] and [e["removed"] for e in job.of("rebuilt")] == [[1]]
    shards = {n: v for r in got for n, v in got[r]["shards"].items()}
    # Rank 1's shard comes back as committed at step 3 (1 + 3), then goes on with its adopter.
    assert shards == {f"shard.{r}": [float(r + STEPS)] * 3 for r in range(4)}
    assert len({got[r]["w"] for r in got}) == 1  # the shared model the same on every survivor


def test_losing_every_copy_of_some_state_is_data_lost_on_every_rank():
    job = SimJob(4, spares=2, inject="1@3,2@3", rebuild=("spare",))
    with pytest.raises(DataLost, match="logical rank 1: every chunk"):  # its one copy was on rank 2
        job.run(_main(replication=2))
    assert job.of("data_lost")


def test_failures_in_a_row_without_a_commit_stop_the_job():
    job = SimJob(4, spares=3, inject="1@3,1@3/g1", rebuild=("spare",), max_failures=1)
    with pytest.raises(elastic.Unrecoverable, match="2 failures in a row"):
        job.run(_main(commit_every=100))


def test_a_policy_that_cannot_fill_the_loss_stops_every_rank():
    job = SimJob(4, inject="1@3", rebuild=("spare",))  # no spare parked
    with pytest.raises(elastic.Unrecoverable, match="cannot be filled"):
        job.run(_main())


def test_a_software_error_in_one_rank_is_that_ranks_failure():
    job = SimJob(4, spares=1, inject="2@4:raise")
    got = job.run(_main())
    assert [e["mode"] for e in job.of("rebuilt")] == ["spare"] and sorted(got) == [0, 1, 2, 3]


def _timed_main(steps: int = 12, nan_at: int | None = None):
    """``_main``'s model with each step's own work (5 ms, a sleep standing for compute, which lets the
    other threads run as a real rank's would) and a commit every 4 steps; ``nan_at``: the step whose
    loss is NaN once in the job (the gate refuses the commit after it, every rank rolls back)."""
    import time

    def main(world):
        state = elastic.State(world, w=np.zeros(4), step=0)
        fired = []

        @elastic.run
        def train(world, state):
            while state.step < steps:
                time.sleep(0.005)
                g = np.full(4, float(world.logical_rank + 1) * (state.step + 1))
                world.allreduce([g], step=state.step)
                state.w = state.w + g / world.size
                state.step += 1
                nan = state.step == nan_at and not fired and (fired.append(True) or True)
                state.record_step(state.step, float("nan") if nan else 1.0)
                if state.step % 4 == 0:
                    state.commit()
            return state.w.tobytes().hex()
        return train(world, state)
    return main


def test_a_simulated_rank_that_waits_for_its_peers_is_no_straggler_and_a_slow_one_is_evicted():
    """A rank's waits in the fabric count as waiting (``job.waited``), not as its own work: with a
    straggler bound the fast ranks, which wait for the slow one in every all-reduce, are never
    stragglers, and the slow one is evicted to the spare, the result bitwise."""
    reference = SimJob(4).run(_timed_main())
    job = SimJob(4, spares=1, inject="2@5:slow=8", straggler_factor=3.0, straggler_steps=3)
    assert job.run(_timed_main()) == reference
    evicted = [e for e in job.of("straggler") if e["evicted"]]
    assert {e["rank"] for e in job.of("straggler")} == {2}
    assert {(e["rank"], e["step"]) for e in evicted} == {(2, 7)}  # slow from step 5: three in a row
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [2])]
    # Where the job's policy cannot fill the place (a shrink to 3 of a job that must stay even), the
    # slow rank stays, and the job ends on every rank.
    kept = SimJob(4, inject="2@5:slow=8", straggler_factor=3.0, straggler_steps=3, rebuild=("shrink",),
                  multiple_of=2)
    assert kept.run(_timed_main()) == reference
    assert kept.of("straggler") and not any(e["evicted"] for e in kept.of("straggler")) and not kept.of("rebuilt")


def test_a_replacement_rolled_back_from_a_non_finite_step_before_its_first_commit_takes_the_shared_values_again():
    """Logical 1 dies at step 5 (committed at 4); its replacement gets the shared values from the
    survivors, then step 7's loss is NaN, so the commit at 8 is refused and every rank rolls back to
    4. The replacement's own payload has no shared values (they are never replicated): it must take
    them from the survivors again, or it keeps its live ones and is fenced as a corrupt rank."""
    reference = SimJob(4).run(_timed_main())
    job = SimJob(4, spares=1, inject="1@5", rebuild=("spare",))
    assert job.run(_timed_main(nan_at=7)) == reference
    assert [e["mode"] for e in job.of("rebuilt")] == ["spare"]
    assert {e["verdict"] for e in job.of("integrity")} == {"nonfinite"}  # nobody fenced
    assert len(job.of("rolled_back")) == 4 and job.of("shared_copied")[-1]["receivers"] == [1]


def test_a_failure_inside_a_roll_back_is_recovered_like_any_other():
    """``drive`` rolls back inside its loop: a rank that dies while the others roll back (the roll-back
    is collective) is a failure the job recovers from, not an error out of the loop."""
    from elastic._driver import drive
    from elastic._integrity import NonFinite
    from elastic.comm import ProcessFailure, Role

    calls = []

    class World:
        role, last_rebuild = Role.INITIAL, None

        def recover(self, outlook=None):
            calls.append("recover")
            return "rebuilt"

    class Policy:
        outlook = None

        def steps(self):
            calls.append("steps")
            if calls.count("steps") == 1:
                raise NonFinite("version 3 not committed", 7, ())
            return "done"

        def roll_back(self, error):
            calls.append("roll_back")
            raise ProcessFailure("a rank died in the roll-back's collective")

        def failed(self, rebuild):
            calls.append("failed")

        def restore(self, rebuild):
            calls.append("restore")

    assert drive(World(), Policy()) == "done"
    assert calls == ["steps", "roll_back", "recover", "failed", "restore", "steps"]


def _pipeline(refuse_at: int | None = None, steps: int = 8):
    """Each rank a stage: ``applied`` is the updates it made, ``lost`` what each rebuild asked it to
    bring back; stage 2's part of step ``refuse_at`` fails once."""
    from elastic.comm import ProcessFailure
    from elastic.pipeline import roll_forward

    def main(world):
        applied, lost, failed = [], [], []

        def compute(step):
            world.allreduce([np.zeros(1)], step=step)  # the collective every stage takes part in
            if int(world.logical_rank) == 2 and step == refuse_at and not failed:
                failed.append(step)  # once, after the others' part of the step is done
                raise ProcessFailure("the last stage's backward failed")
            return 0.0

        def rebuild(gone):
            world.allreduce([np.zeros(1)])  # bringing stages back is collective: a failure can land in it
            lost.append(sorted(gone))

        done = roll_forward(world, steps, compute, applied.append, rebuild)
        return done, applied, lost
    return main


def test_a_pipeline_step_lands_on_every_stage_or_on_none():
    """roll_forward's rule: a stage whose part of step 4 failed votes it down, so no stage applies
    it; every stage then goes on from step 4, and each update lands exactly once."""
    job = SimJob(3)
    got = job.run(_pipeline(refuse_at=4))
    assert got == {r: (8, list(range(8)), [[]]) for r in range(3)}
    assert [(e["failed"], e["mode"]) for e in job.of("rebuilt")] == [([], "none")]


def test_a_lost_stage_is_rebuilt_on_every_rank_and_resumes_at_the_step_in_flight():
    job = SimJob(3, spares=1, inject="1@c5")  # inside step 5's collective: nobody applies step 5
    got = job.run(_pipeline())
    assert {r: got[r][1] for r in (0, 2)} == {0: list(range(8)), 2: list(range(8))}
    assert got[1] == (8, [5, 6, 7], [[1]])  # the replacement: from the step in flight
    assert got[0][2] == got[2][2] == [[1]]  # every stage was told which one to bring back


def test_a_replacement_that_has_not_committed_yet_rolls_back_its_shared_values_too(reference):
    """Logical 1 dies at step 5 (committed at 4): its replacement gets the shared values, trains
    steps 4 and 5 again, and logical 0 dies at step 6, before the next commit. Everyone rolls back
    to step 4; the replacement's own payload has no shared values yet (they are never replicated),
    so it must take them from the survivors again, not keep its live ones (a CommitRejected, seen
    when a promoted spare came up fast enough to train before the next failure)."""
    job = SimJob(4, spares=2, inject="1@5,0@6/g1", rebuild=("spare",))
    assert job.run(_main(commit_every=4, replication=3)) == reference  # 3: the copies 1 held for 0 live on
    assert [e["mode"] for e in job.of("rebuilt")] == ["spare", "spare"]


def test_a_failure_while_stages_are_brought_back_keeps_them_to_bring_back():
    """Stage 2 dies as the rebuild of stage 1 starts: the next rebuild brings back both, on every
    rank, the replacement of the interrupted rebuild included, and every rank ends at the same step."""
    job = SimJob(3, spares=2, inject="1@c5,2@restore/g1")
    got = job.run(_pipeline())
    assert {r: got[r][2] for r in range(3)} == {0: [[1, 2]], 1: [[1, 2]], 2: [[1, 2]]}
    assert got[0][1] == list(range(8)) and got[1][1] == got[2][1] == [5, 6, 7]


def _stages(commit_every: int = 2, steps: int = 8):
    """A 4-stage pipeline of one linear layer per stage on ``roll_forward`` and ``StageRebuild``; each
    stage's gradient depends on its own weights only, so a stage brought back exactly ends where the
    failure-free run's ends. Returns each rank's final weights (bytes)."""
    import torch
    from torch import nn

    from elastic.pipeline import StageRebuild, roll_forward

    class Stage(nn.Module):
        def __init__(self, s: int) -> None:
            super().__init__()
            self.body = nn.Linear(3, 3)
            with torch.no_grad():  # not from torch's RNG: the simulated ranks share it (threads of one process)
                for i, p in enumerate(self.body.parameters()):
                    p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (s + 1 + i))

    def main(world):
        me = int(world.logical_rank)
        stage = Stage(me)
        run = {"opt": torch.optim.Adam(stage.parameters(), lr=0.1), "gnorm": 1.0}
        rebuilder = StageRebuild(world, 4, commit_every=commit_every)

        def compute(step):
            world.allreduce([np.zeros(1)], step=step)  # the collective every stage takes part in
            run["opt"].zero_grad()
            (stage.body(torch.full((1, 3), float(step))) ** 2).sum().backward()
            return 0.0

        def apply(step):
            run["gnorm"] = float(sum(p.grad.pow(2).sum() for p in stage.parameters()) ** 0.5)
            run["opt"].step()

        def rebuild(lost):
            run["opt"], run["gnorm"], resume = rebuilder.rebuild(
                lost, me, stage, run["opt"], run["gnorm"], lambda boost: torch.optim.Adam(stage.parameters(), lr=0.1))
            return resume

        roll_forward(world, steps, compute, apply, rebuild,
                     after=lambda step: rebuilder.after_step(step, stage, run["opt"], run["gnorm"]))
        return b"".join(v.numpy().tobytes() for v in stage.state_dict().values())
    return main


def test_a_pipeline_takes_back_from_the_store_what_has_a_copy_and_rebuilds_the_rest_by_checkfree():
    """Stages 1 and 2 die at step 5; a stage's copy lives on the next rank, so stage 2's (on 3) is
    left and stage 1's (on 2) is not. Every rank rolls back to the commit of step 4: stages 0, 2 and 3
    end bitwise where the failure-free run ends, stage 1 is rebuilt by CheckFree from 0 and the
    restored 2; without copies the same loss stops the job (two neighbouring stages)."""
    reference = SimJob(4).run(_stages())
    job = SimJob(4, spares=2, inject="1@5,2@5")
    got = job.run(_stages())
    assert {r: got[r] == reference[r] for r in range(4)} == {0: True, 1: False, 2: True, 3: True}
    assert sorted((e["logical"], e["method"], tuple(e["sources"]), e.get("step")) for e in job.of("stage_rebuilt")) \
        == [(1, "checkfree", (0, 2), None), (2, "store", (), 4)]
    assert {tuple(e["given_up"]) for e in job.of("store_recovered")} == {(1,)}
    with pytest.raises(elastic.Unrecoverable, match="stage 1: a neighbouring stage was lost too"):
        SimJob(4, spares=2, inject="1@5,2@5").run(_stages(commit_every=0))


def test_a_mesh_keeps_each_logical_ranks_coordinates_through_a_substitution():
    """A 2 x 2 mesh loses logical rank 1 inside step 3's collective; its replacement is stage 1 of
    replica 0 again, and every rank's groups follow the new world (no bookkeeping in the program)."""
    from elastic.mesh import Mesh
    from elastic.pipeline import roll_forward

    def main(world):
        mesh = Mesh(world, 2, 2)
        roll_forward(world, 5, lambda step: world.allreduce([np.zeros(1)], step=step), lambda step: None,
                     lambda lost: None)
        where = {int(logical): rank for rank, logical in enumerate(world.logical_ranks)}
        assert mesh.twins() == [where[mesh.stage], where[2 + mesh.stage]]
        assert mesh.stage_hosts() == {0: where[2 * mesh.replica], 1: where[2 * mesh.replica + 1]}
        return mesh.replica, mesh.stage, world.generation

    job = SimJob(4, spares=1, inject="1@c3")
    assert job.run(main) == {0: (0, 0, 1), 1: (0, 1, 1), 2: (1, 0, 1), 3: (1, 1, 1)}
    with pytest.raises(elastic.ConfigError, match=r"a 3 x 2 mesh .* needs 6 ranks and the job has 4: launch with -n 6"):
        SimJob(4).run(lambda world: Mesh(world, 3, 2))


def _mesh_training(steps: int = 6):
    """A 2 x 2 mesh on roll_forward: each stage a weight vector, its gradient summed over the twins
    through ``Mesh.allreduce_stage`` (the World's ``neighbors``); a lost stage comes back from a live
    twin, sent point to point."""
    from elastic.mesh import Mesh
    from elastic.pipeline import roll_forward

    def main(world):
        mesh = Mesh(world, 2, 2)
        w = np.zeros(3)
        grad = np.zeros(3)

        def compute(step):
            grad[:] = (mesh.replica + 1) * (step + 1) * (mesh.stage + 1)  # each replica its own batch
            mesh.allreduce_stage([grad], step=step)
            return float(grad.sum())

        def apply(step):
            w[:] = w - 0.01 * grad

        def rebuild(lost):
            twins = mesh.twins()
            me, mine = int(world.rank), int(world.logical_rank) in lost
            givers = [r for r in twins if int(world.logical_ranks[r]) not in lost]
            sends = [(r, 7, w) for r in twins if int(world.logical_ranks[r]) in lost] if me == givers[0] else []
            world.neighbors(sends, [(givers[0], 7, w)] if mine else [], None)
            return None

        roll_forward(world, steps, compute, apply, rebuild)
        return w.tobytes().hex()
    return main


def test_a_mesh_sums_its_twins_point_to_point_and_a_lost_stage_comes_back_from_its_twin_bitwise():
    """``Mesh`` and ``roll_forward`` in the simulated job, with the neighbour exchange on its data
    plane: logical rank 1 (stage 1 of replica 0) dies inside step 3's sum; the spare gets stage 1
    from its twin (logical rank 3) and every stage ends bitwise the failure-free run's."""
    reference = SimJob(4).run(_mesh_training())
    assert reference[0] == reference[2] and reference[1] == reference[3] and reference[0] != reference[1]
    job = SimJob(4, spares=1, inject="1@c3")
    assert job.run(_mesh_training()) == reference
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [1])]
    assert {e["logical"] for e in job.of("resumed")} == {0, 1, 2, 3}  # the one driver's events, pipelines too


def test_an_injected_bit_flip_in_a_simulated_rank_is_fenced_as_in_a_real_one(reference):
    """The simulated job fires the real fault table: ``R@S:bitflip`` corrupts rank 2's shared value
    at step 3, the gate fences it at the next commit, the spare takes the majority's values, and the
    job ends bitwise the failure-free run."""
    job = SimJob(4, spares=1, inject="2@3:bitflip")
    assert job.run(_main()) == reference
    assert [e["value"] for e in job.of("bitflip")] == ["w"]
    assert {(e["verdict"], tuple(e["ranks"])) for e in job.of("integrity")} == {("fenced", (2,))}
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [2])]


def test_a_rank_local_loss_given_to_record_step_is_said_once_an_all_reduced_one_never():
    def main(local: bool):
        def program(world):
            state = elastic.State(world, w=np.zeros(2), step=0)

            @elastic.run
            def train(world, state):
                while state.step < 6:
                    loss = np.array([float(world.logical_rank + 1) * (state.step + 1)])
                    if not local:
                        world.allreduce([loss])
                    state.step += 1
                    state.record_step(state.step, float(loss[0]))
                    if state.step % 2 == 0:
                        state.commit()
            return train(world, state)
        return program

    job = SimJob(3)
    job.run(main(local=True))
    told = job.of("local_loss")
    assert sorted(e["logical"] for e in told) == [0, 1, 2] and told[0]["losses"] == [2.0, 4.0, 6.0]
    quiet = SimJob(3)
    quiet.run(main(local=False))
    assert not quiet.of("local_loss")


def test_the_fill_rule_is_one_function_for_the_real_and_the_simulated_rebuild():
    """Spares first (as many as are parked, lowest logical rank first), then a spawn or a shrink
    takes the rest; a mode with nothing left, or unknown, is skipped."""
    from elastic.comm.runtime import fill
    assert fill(("spare", "shrink"), [5, 2, 7], 2) == [("spare", [2, 5]), ("shrink", [7])]
    assert fill(("spare", "spawn"), [1], 3) == [("spare", [1])]
    assert fill(("spare",), [1, 2], 1) == [("spare", [1])]  # rank 2 left unfilled: the job stops
    assert fill(("bogus", "spawn", "shrink"), [3, 4], 0) == [("spawn", [3, 4])]


def test_a_loss_the_policy_cannot_fill_stops_every_rank_naming_why():
    job = SimJob(4, inject="1@5,2@5", rebuild=("shrink",), min_size=3)
    with pytest.raises(elastic.Unrecoverable, match="below min_size=3"):
        job.run(_main())
    assert not job.of("finished")


def _drifting(rank: int):
    """Logical ``rank`` drifts from the others at step 5, in the first generation only (a transient
    corruption of its copy of a value every rank must hold alike)."""
    def main(world):
        state = elastic.State(world, w=np.zeros(4), step=0)

        @elastic.run
        def train(world, state):
            while state.step < STEPS:
                drift = 1e-9 if int(world.logical_rank) == rank and state.step == 5 and world.generation == 0 else 0.0
                state.w = state.w + 1 + drift
                state.step += 1
                state.commit()
            return state.w.tolist()
        return train(world, state)
    return main


def test_state_that_differs_across_two_ranks_is_refused_on_every_rank_and_the_last_version_kept():
    # Two ranks: no majority can say which copy is right.
    job = SimJob(2)
    with pytest.raises(elastic.ConfigError, match=r"'w' on logical ranks \[1\] differs") as refused:
        job.run(_drifting(1))
    assert "last version is kept" in str(refused.value) and "no majority of the 2 ranks" in str(refused.value)
    assert not job.of("finished")
    assert [e["verdict"] for e in job.of("integrity")] == ["no_majority"] * 2
    committed = {r: [e["version"] for e in job.of("committed") if e["logical"] == r] for r in range(2)}
    assert committed == {r: [0, 1, 2, 3, 4, 5] for r in range(2)}  # step 6's, refused, replaced nothing anywhere


def test_a_rank_that_differs_from_the_majority_is_fenced_and_replaced_by_the_spare():
    job = SimJob(4, spares=1)
    results = job.run(_drifting(2))
    assert results == {r: [float(STEPS)] * 4 for r in range(4)}  # the drift never reached the end
    verdicts = job.of("integrity")
    assert {e["verdict"] for e in verdicts} == {"fenced"} and {tuple(e["ranks"]) for e in verdicts} == {(2,)}
    assert {tuple(e["values"]["2"]) for e in verdicts} == {("w",)}
    (rebuilt,) = {(e["mode"], tuple(e["failed"])) for e in job.of("rebuilt")}
    assert rebuilt == ("spare", (2,))


# ------------------------------------------------------------------ shared values and per-step points
def test_the_shared_values_go_to_no_peer_and_a_replacement_gets_them_from_every_survivor(reference):
    """The store replicates only the rank-unique values (the shards); the model every rank holds
    alike stays in each rank's own roll-back copy, and the spare gets it from the three survivors."""
    job = SimJob(4, spares=1, inject="1@3")
    assert job.run(_main()) == reference
    committed = job.of("committed")
    assert all(e["replicated_bytes"] < e["payload_bytes"] - 4 * 8 for e in committed)  # w (4 float64) not sent
    shared = job.of("shared_copied")
    assert {(e["logical"], tuple(e["receivers"]), e["senders"]) for e in shared} == \
        {(r, (1,), 3) for r in range(4)}  # the replacement (logical rank 1) and the three that sent to it


LCG = (1103515245, 12345, 1 << 31)


def _per_step_main(late_collective: bool = False):
    """A per-step loop: each rank draws from its own stream in the 'forward' (rank-unique state),
    the gradients are all-reduced, then the step point, then the update. ``computed``: the steps
    whose forward ran here, so a step done twice shows."""
    def main(world):
        me = int(world.logical_rank)
        state = elastic.State(world, per_step=True, local=("draw",), w=np.zeros(4), step=0,
                              draw=np.array([me + 1], np.int64))
        computed = []

        @elastic.run
        def train(world, state):
            while state.step < STEPS:
                state.draw = (state.draw * LCG[0] + LCG[1]) % LCG[2]
                g = np.full(4, float(state.draw[0] % 1000) + state.step)
                world.allreduce([g], step=state.step)
                computed.append(state.step)
                state.step_point()
                state.w = state.w + g / world.size
                state.step += 1
                if late_collective:
                    world.allreduce([np.zeros(1)])  # a loss all-reduce after the update: refused
                state.record_step(state.step)
            return {"w": state.w.tobytes().hex(), "draw": int(state.draw[0])}, computed
        return train(world, state)
    return main


@pytest.fixture(scope="module")
def per_step_reference():
    return {r: result for r, (result, _) in SimJob(4).run(_per_step_main()).items()}


@pytest.mark.parametrize("inject, redone", [
    ("1@3", 0),         # after step 3's update: the survivors find out in step 4's all-reduce
    ("1@c5", 0),        # inside step 5's all-reduce: nobody reached its step point
    ("2@commit4", 1),   # inside step 3's step point (version 4): nobody applies step 3, it is done again
    ("0@6", 0),         # rank 0, the root of the broadcasts
])
def test_every_step_is_a_recovery_point_and_only_the_step_in_flight_is_redone(per_step_reference, inject, redone):
    job = SimJob(4, spares=1, inject=inject)
    got = job.run(_per_step_main())
    assert {r: result for r, (result, _) in got.items()} == per_step_reference  # bitwise, each rank's stream too
    survivors = [r for r in range(4) if r != int(inject[0])]
    for r in survivors:
        computed = got[r][1]
        assert sorted(set(computed)) == list(range(STEPS)) and len(computed) - STEPS == redone
    assert [e["mode"] for e in job.of("rebuilt")] == ["spare"]
    assert not [e for e in job.of("committed") if e["replicated_bytes"] != e["payload_bytes"]]  # w in no payload


def test_after_a_shrink_per_step_the_survivors_go_on_from_the_step_in_flight():
    job = SimJob(4, inject="2@c5", rebuild=("shrink",))
    got = job.run(_per_step_main())
    assert sorted(got) == [0, 1, 3] and len({got[r][0]["w"] for r in got}) == 1
    assert all(got[r][1] == list(range(STEPS)) for r in got)  # no step done twice


def test_the_gate_runs_at_the_per_step_point_too_and_fences_a_flipped_bit(per_step_reference):
    """With ``per_step=True`` no ``commit()`` is called: the gate runs at the step point of every
    ``gate_every``-th version. A bit flipped in rank 2's model at the end of step 3 is fenced at the
    next gated point (version 4), the spare takes the majority's model, and the job ends bitwise the
    failure-free run. With the gate off at the step points (``gate_every=0``) only the job's final
    commit (version 9) finds it: every step between ran on the flipped model."""
    job = SimJob(4, spares=1, inject="2@3:bitflip", gate_every=2)
    assert {r: result for r, (result, _) in job.run(_per_step_main()).items()} == per_step_reference
    assert {(e["verdict"], tuple(e["ranks"]), e["version"]) for e in job.of("integrity")} == {("fenced", (2,), 4)}
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [2])]
    late = SimJob(4, spares=1, inject="2@3:bitflip", gate_every=0)
    late.run(_per_step_main())
    assert {(e["verdict"], e["version"]) for e in late.of("integrity")} == {("fenced", STEPS + 1)}


def test_a_nonfinite_loss_per_step_stops_at_the_next_gated_point_saying_why():
    """A per-step job has no copy of its shared values to roll back to: the gate's NaN stops every
    rank at the next gated step point, with the reason and what to use instead."""
    def main(world):
        state = elastic.State(world, per_step=True, w=np.zeros(2), step=0)

        @elastic.run
        def train(world, state):
            while state.step < STEPS:
                state.step_point()
                state.w = state.w + 1
                state.step += 1
                state.record_step(state.step, float("nan") if state.step == 3 else 1.0)
        return train(world, state)

    job = SimJob(3, gate_every=2)
    with pytest.raises(elastic.Unrecoverable, match="per_step=False to roll back"):
        job.run(main)
    assert not job.of("finished") and max(e["version"] for e in job.of("committed")) == 3  # refused at 4


def test_a_collective_between_the_step_point_and_the_steps_end_is_refused_on_every_rank():
    job = SimJob(4)
    with pytest.raises(elastic.ConfigError, match="a collective ran between the step point"):
        job.run(_per_step_main(late_collective=True))
    assert not job.of("finished")


def test_per_step_misuse_is_refused_saying_what_to_do():
    world = SimJob(2).rank(0)
    with pytest.raises(elastic.ConfigError, match="make the State with per_step=True"):
        elastic.State(world, step=0).step_point()
    with pytest.raises(elastic.ConfigError, match="a sharded optimizer.*give twins="):
        elastic.TorchState(world, per_step=True, shard_optimizer=True)
    with pytest.raises(elastic.ConfigError, match="twins= and twinned= go together"):
        elastic.State(world, per_step=True, twinned=("adam",), step=0)


def test_ranks_whose_own_values_have_other_names_share_only_what_they_hold_alike():
    """Each rank's unique values have names of its own (their index differs in length across
    ranks, as FSDP2's shard names do): the spare gets the shared values, and its own back."""
    def main(world):
        me = int(world.logical_rank)
        state = elastic.State(world, local=("own",), w=np.zeros(3), step=0, **{"own." + "x" * (me + 1): np.full(2, me)})

        @elastic.run
        def train(world, state):
            while state.step < STEPS:
                g = np.full(3, float(me + 1))
                world.allreduce([g], step=state.step)
                state.w = state.w + g
                state.step += 1
                state.record_step(state.step)
                state.commit()
            return state.w.tolist(), sorted(state.names())
        return train(world, state)
    job = SimJob(4, spares=1, inject="2@3")
    got = job.run(main)
    assert got == {r: ([10.0 * STEPS] * 3, sorted(["own." + "x" * (r + 1), "step", "w"])) for r in range(4)}


def test_share_cuts_the_bytes_among_the_senders_at_any_boundary():
    """Two receivers, three senders, arrays of odd sizes, an empty one and mixed dtypes: every byte
    arrives where it belongs (the ranges cut arrays in the middle)."""
    values = {"a": np.arange(7, dtype=np.uint8), "b": np.zeros(0), "c": np.linspace(0, 1, 13).astype(np.float32),
              "d": np.arange(6, dtype=np.int64).reshape(2, 3)}

    def main(world):
        me = int(world.logical_rank)
        return share(world, None if me in (1, 3) else values, [1, 3])
    got = SimJob(5).run(main)
    assert got[0] is None and got[2] is None and got[4] is None
    for r in (1, 3):
        assert {k: (v.dtype, v.shape, v.tobytes()) for k, v in got[r].items()} == \
            {k: (v.dtype, v.shape, v.tobytes()) for k, v in values.items()}


def test_the_first_sync_moves_the_shared_values_only_to_the_ranks_that_differ():
    def main(world):
        me = int(world.logical_rank)
        state = elastic.State(world, w=np.full(3, 1.0 if me in (0, 2) else float(me + 10)), step=0)

        @elastic.run
        def train(world, state):
            return state.w.tolist()
        return train(world, state)
    job = SimJob(4)
    assert job.run(main) == {r: [1.0, 1.0, 1.0] for r in range(4)}  # the first survivor's, everywhere
    assert {(tuple(e["receivers"]), e["senders"]) for e in job.of("shared_copied")} == {((1, 3), 2)}
    alike = SimJob(4)
    alike.run(lambda world: elastic.run(lambda world, state: None)(world, elastic.State(world, w=np.ones(3))))
    assert not alike.of("shared_copied")  # a seeded start moves nothing


def _late_corruption(keep: int):
    """Every rank adds the same error to ``w`` at step 7, once per process: it passes the gate (equal
    everywhere, finite) and is committed at step 10; the loss goes NaN from step 12 on while it is
    there, so the roll-back to step 10 does not help and only the version of step 5 does."""
    def main(world):
        state = elastic.State(world, keep_versions=keep, w=np.zeros(4), step=0)
        fired = [False]

        @elastic.run
        def train(world, state):
            while state.step < 20:
                if state.step == 7 and not fired[0]:
                    fired[0] = True
                    state.w = state.w + 1000
                state.w = state.w + 1
                state.step += 1
                state.record_step(state.step, float("nan") if state.w[0] > 500 and state.step >= 12 else 1.0)
                if state.step % 5 == 0:
                    state.commit()
            return state.w.tolist()
        return train(world, state)
    return main


def test_a_corruption_that_passed_the_gate_falls_back_one_more_kept_version():
    job = SimJob(4)
    assert job.run(_late_corruption(keep=2)) == {r: [20.0] * 4 for r in range(4)}
    back = sorted({(e["version"], e["step"], e["fallback"]) for e in job.of("rolled_back")}, reverse=True)
    assert back == [(2, 12, False), (1, 12, True)]  # step 10's version first, then step 5's
    assert len(job.of("rolled_back")) == 8


def test_without_an_older_version_kept_everywhere_a_repeated_non_finite_step_stops():
    again = r"not finite again after the roll-back to version 2.*keep_versions=1"
    with pytest.raises(elastic.Unrecoverable, match=again):
        SimJob(4).run(_late_corruption(keep=1))
    # A failure leaves every rank only the current version (the replacement holds no other): the
    # same stop, never a fall-back to a version some rank lacks.
    job = SimJob(4, spares=1, inject="1@11")
    with pytest.raises(elastic.Unrecoverable, match=r"no older version is kept on every rank: keep_versions=2"):
        job.run(_late_corruption(keep=2))
    assert [e["mode"] for e in job.of("rebuilt")][:1] == ["spare"] and not job.of("finished")


def _twin_main(replicas: int = 2, steps: int = STEPS, corrupt: tuple[int, int] | None = None,
               commit_every: int = 0, replication: int = 2):
    """ZeRO-1 with twins (``State(per_step=True, twins=mesh)``): ``replicas`` instances of
    ``n / replicas`` shards; each rank draws from its own stream, the gradient of the whole model is
    summed over every rank, each rank updates its shard (moment and master weights, ``opt.<k>.*``)
    after the step point, and the next step starts by gathering the model from its instance's
    shards. After a shrink the ranks of an instance out of use compute nothing but still update
    their shard (they receive the same sum): they stay their shards' twins. ``corrupt``: (logical
    rank, step) whose update goes wrong once, silently. ``commit_every``: the program's commits, the
    way back when every twin of a shard dies."""
    from elastic.mesh import Mesh

    def main(world):
        n = world.job.initial_size
        mesh = Mesh(world, replicas, n // replicas)
        me, k = int(world.logical_rank), mesh.stage
        bounds = [3 * s for s in range(mesh.pp + 1)]
        w0 = np.linspace(-1.0, 1.0, bounds[-1])
        state = elastic.State(world, per_step=True, twins=mesh, twinned=("opt",), local=("draw",), step=0,
                              replication=replication, draw=np.array([me + 1], np.int64),
                              **{f"opt.{k}.m": np.zeros(3), f"opt.{k}.p": w0[bounds[k]:bounds[k + 1]].copy()})
        computed = []

        @elastic.run
        def train(world, state):
            w = np.empty(bounds[-1])
            while state.step < steps:
                if mesh.working:  # the model, from the shards of this rank's instance
                    hosts = mesh.stage_hosts()
                    mine = state[f"opt.{k}.p"]
                    world.neighbors([(hosts[s], 0, mine) for s in hosts if s != k],
                                    [(hosts[s], 0, w[bounds[s]:bounds[s + 1]]) for s in hosts if s != k],
                                    step=state.step)
                    w[bounds[k]:bounds[k + 1]] = mine
                state.draw = (state.draw * LCG[0] + LCG[1]) % LCG[2]
                g = np.zeros(bounds[-1])
                if mesh.working:
                    g += np.sin(w * (1 + state.draw[0] % 7)) + state.step
                world.allreduce([g], step=state.step)
                if mesh.working:
                    computed.append(state.step)  # a step summed twice shows
                state.step_point()
                m, p = state[f"opt.{k}.m"], state[f"opt.{k}.p"]
                m *= 0.9
                m += g[bounds[k]:bounds[k + 1]]
                p -= 0.01 * m
                if (me, state.step) == corrupt and world.generation == 0:
                    p[0] += 1e-9  # a flipped bit, say
                state.step += 1
                state.record_step(state.step)
                if commit_every and state.step % commit_every == 0:
                    state.commit()
            return {"m": state[f"opt.{k}.m"].tobytes().hex(), "p": state[f"opt.{k}.p"].tobytes().hex(),
                    "draw": int(state.draw[0])}, computed
        return train(world, state)
    return main


@pytest.fixture(scope="module")
def twin_reference():
    return {r: result for r, (result, _) in SimJob(4).run(_twin_main()).items()}


@pytest.mark.parametrize("inject, redone", [
    ("1@3", 0),         # between steps: the survivors find out in step 3's gather
    ("1@c5", 0),        # inside step 5's sum: nobody reached its step point
    ("3@u4", 0),        # inside step 4's update, past its point: its twin completed the update
    ("2@commit4", 1),   # inside step 3's step point: nobody applies step 3, it is done again
])
def test_a_shard_comes_back_from_its_twin_bitwise_and_nothing_of_it_is_copied_per_step(twin_reference, inject,
                                                                                        redone):
    job = SimJob(4, spares=1, inject=inject)
    got = job.run(_twin_main())
    assert {r: result for r, (result, _) in got.items()} == twin_reference
    assert twin_reference[0]["m"] == twin_reference[2]["m"] and twin_reference[0]["m"] != twin_reference[1]["m"]
    lost = int(inject[0])
    for r in set(range(4)) - {lost}:
        assert len(got[r][1]) - STEPS == redone, got[r][1]
    twin = {0: 2, 1: 3, 2: 0, 3: 1}[lost]
    assert [(e["logical"], e["senders"]) for e in job.of("twin_copied")] == [(lost, [twin])]
    # The step points replicated the random streams and the index only: no shard's bytes.
    assert all(e["replicated_bytes"] == e["payload_bytes"] < 2048 for e in job.of("committed"))


def test_losing_both_twins_of_a_shard_at_once_is_data_lost_naming_the_shard_on_every_rank():
    job = SimJob(4, spares=2, inject="1@3,3@3")
    with pytest.raises(DataLost, match=r"logical rank 1's shard, held by logical ranks \[1, 3\]"):
        job.run(_twin_main())
    assert sorted(e["logical"] for e in job.of("data_lost")) == [0, 1, 2, 3]  # the two replacements too


@pytest.mark.parametrize("inject, spares, senders", [
    ("3@4", 1, {3: [7]}),               # (pp 1, dp 0, tp 1): its slot's twin in replica 1
    ("3@c4,6@c4", 2, {3: [7], 6: [2]}),  # two coordinates of two slots, one in each replica: each from its twin
    ("3@4,7@4", 2, None),               # both replicas of one slot: no way back without a commit
])
def test_each_lost_coordinate_of_a_pp_dp_tp_mesh_takes_the_way_back_its_slot_has(inject, spares, senders):
    """examples/llama3d.py's layout at pp=2 x dp=2 x tp=2: logical rank k is replica k // 4 and slot
    k % 4 (stage, tp rank), the twins of a slot its replicas (``Mesh(world, dp, pp * tp)``)."""
    reference = {r: result for r, (result, _) in SimJob(8).run(_twin_main()).items()}
    job = SimJob(8, spares=spares, inject=inject)
    if senders is None:
        with pytest.raises(DataLost, match=r"logical rank 3's shard, held by logical ranks \[3, 7\]"):
            job.run(_twin_main())
        assert sorted(e["logical"] for e in job.of("data_lost")) == list(range(8))
        return
    got = job.run(_twin_main())
    assert {r: result for r, (result, _) in got.items()} == reference
    assert {e["logical"]: e["senders"] for e in job.of("twin_copied")} == senders


def test_a_shrink_takes_the_lost_ranks_instance_out_and_its_survivors_stay_twins():
    """Logical rank 1 dies without a spare: the mesh policy takes instance 0 out; logical rank 0
    (instance 0) computes nothing more but keeps its shard in step with its twin, logical rank 2."""
    from elastic.mesh import mesh_policy

    job = SimJob(4, inject="1@3", rebuild=("shrink",))
    job.policy = mesh_policy(2, 2, job.policy)
    got = job.run(_twin_main())
    assert sorted(got) == [0, 2, 3]
    assert got[0][0]["m"] == got[2][0]["m"] and got[0][0]["p"] == got[2][0]["p"]
    assert got[0][1] == [0, 1, 2] and got[2][1] == list(range(STEPS))  # rank 0 idles from step 3 on
    assert [e["removed"] for e in job.of("rebuilt")] == [[1]]


def _twin_torch_main(steps: int = STEPS):
    """The library's sharded path: a torch Adam over this rank's shard of the weights
    (``TorchState(shard_optimizer=True, per_step=True, twins=mesh)``), its ``step()`` the step point."""
    import torch

    from elastic.mesh import Mesh

    def main(world):
        mesh = Mesh(world, 2, world.job.initial_size // 2)
        me, k = int(world.logical_rank), mesh.stage
        bounds = [3 * s for s in range(mesh.pp + 1)]
        shard = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            shard.weight.copy_(torch.linspace(-1.0, 1.0, bounds[-1], dtype=torch.float32)[bounds[k]:bounds[k + 1]])
        optimizer = torch.optim.Adam(shard.parameters(), lr=0.01)
        state = elastic.TorchState(world, modules={"shard": (shard, optimizer)}, shard_optimizer=True, per_step=True,
                                   twins=mesh, twinned=("shard",), local=("draw",), step=0,
                                   draw=np.array([me + 1], np.int64))

        @elastic.run
        def train(world, state):
            w = np.empty(bounds[-1], np.float32)
            while state.step < steps:
                hosts, mine = mesh.stage_hosts(), shard.weight.detach().numpy().reshape(-1)
                world.neighbors([(hosts[s], 0, mine) for s in hosts if s != k],
                                [(hosts[s], 0, w[bounds[s]:bounds[s + 1]]) for s in hosts if s != k], step=state.step)
                w[bounds[k]:bounds[k + 1]] = mine
                state.draw = (state.draw * LCG[0] + LCG[1]) % LCG[2]
                g = (np.sin(w * (1 + state.draw[0] % 7)) + state.step).astype(np.float32)
                world.allreduce([g], step=state.step)
                shard.weight.grad = torch.from_numpy(g[bounds[k]:bounds[k + 1]].reshape(1, 3).copy())
                optimizer.step()  # the step point first (the hook), then the update: local
                state.step += 1
                state.record_step(state.step)
            moments = optimizer.state[shard.weight]["exp_avg_sq"]
            return shard.weight.detach().numpy().tobytes().hex() + moments.numpy().tobytes().hex()
        return train(world, state)
    return main


@pytest.mark.parametrize("inject", ["1@3", "3@u4", "0@c5"])
def test_a_torch_optimizer_shard_comes_back_from_its_twin_bitwise(inject):
    reference = SimJob(4).run(_twin_torch_main())
    assert reference[0] == reference[2] != reference[1] == reference[3]
    job = SimJob(4, spares=1, inject=inject)
    assert job.run(_twin_torch_main()) == reference
    assert len(job.of("twin_copied")) == 1


def test_twins_that_differ_stop_every_rank_naming_the_shard_when_no_majority_can_tell():
    job = SimJob(4, twin_check_every=2)
    with pytest.raises(elastic.Unrecoverable, match=r"at step 4 the twins \[1, 3\] differ in \['opt.1.p'\]"):
        job.run(_twin_main(corrupt=(3, 3)))  # step 3's update, the check at the end of step 4
    assert [(e["step"], e["undecided"]) for e in job.of("integrity") if e["logical"] == 0] == \
        [(4, {"[1, 3]": ["opt.1.p"]})]


def test_a_twin_that_differs_from_its_majority_is_fenced_and_replaced_bitwise():
    """Three instances: the odd twin of shard 1 is fenced at the step's end, before its shard feeds
    anyone's model; the spare takes the shard from the two that agree, and the run ends bitwise the
    failure-free one."""
    reference = SimJob(6, twin_check_every=1).run(_twin_main(replicas=3))
    job = SimJob(6, spares=1, twin_check_every=1)
    got = job.run(_twin_main(replicas=3, corrupt=(3, 3)))
    assert {r: result for r, (result, _) in got.items()} == {r: result for r, (result, _) in reference.items()}
    fenced = [e for e in job.of("integrity") if e["verdict"] == "twins"]
    assert {e["logical"] for e in fenced} == set(range(6)) and {tuple(e["ranks"]) for e in fenced} == {(3,)}
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [3])]
    assert [(e["logical"], e["senders"]) for e in job.of("twin_copied")] == [(3, [1, 5])]


def test_losing_both_twins_of_a_shard_with_commits_goes_back_to_the_last_commit_bitwise():
    reference = SimJob(4).run(_twin_main(commit_every=3))
    job = SimJob(4, spares=2, inject="1@5,3@5")  # after step 5's update: the last commit was at step 3
    got = job.run(_twin_main(commit_every=3))
    assert {r: result for r, (result, _) in got.items()} == {r: result for r, (result, _) in reference.items()}
    assert {(e["ranks"][0], e["version"]) for e in job.of("twins_lost")} == {(1, 0)}  # the program's first
    assert sorted(got[0][1]) == [0, 1, 2, 3, 3, 4, 4, 5, 6, 7]  # steps 3 and 4 done again
    assert not job.of("twin_copied")  # every shard came from the commit


def test_one_rank_lost_in_each_instance_and_one_spare_makes_one_instance_whole_and_takes_the_other_out():
    """Logical ranks 1 and 2 die together (one in each instance) with one spare and no spawn: no
    instance is whole among the survivors, so the spare completes instance 0 and instance 1 goes
    out of use; the replacement takes shard 1 from logical rank 3, which idles but keeps it."""
    from elastic.mesh import mesh_policy

    job = SimJob(4, spares=1, inject="1@3,2@3", rebuild=("spare", "shrink"))
    job.policy = mesh_policy(2, base=job.policy, copies=True)
    got = job.run(_twin_main(replication=3))  # with 2, logical rank 1's random stream had its copy on 2 alone
    assert [(e["mode"], e["replaced"], e["removed"]) for e in job.of("rebuilt")] == [("spare+shrink", [1], [2])]
    shards = {r: (got[r][0]["m"], got[r][0]["p"]) for r in got}
    assert sorted(got) == [0, 1, 3] and shards[1] == shards[3] != shards[0]  # twins to the end
    assert got[3][1] == [0, 1, 2] and [(e["logical"], e["senders"]) for e in job.of("twin_copied")] == [(1, [3])]


def test_twins_sharing_a_failure_domain_in_a_job_that_spans_several_are_said_once_on_each_rank():
    """Failure domains dealt round robin over two names put logical ranks 0 and 2 (the twins of
    shard 0) in domain a, and 1 and 3 in b: each rank warns, naming its twin. Dealt in blocks
    (a, a, b, b after a 4-name list), every shard's twins are apart: nothing is said."""
    job = SimJob(4, domains=("a", "b"))
    job.run(_twin_main(steps=2))
    assert sorted((e["logical"], tuple(e["twins"])) for e in job.of("twins_colocated")) == \
        [(0, (0, 2)), (1, (1, 3)), (2, (2, 0)), (3, (3, 1))]
    apart = SimJob(4, domains=("a", "a", "b", "b"))
    apart.run(_twin_main(steps=2))
    assert not apart.of("twins_colocated")


# ------------------------------------------------------------------ parity instead of copies
def _uneven(redundancy: str | None, chunk_bytes: int = 1 << 20):
    """_main with uneven shards and a commit every step (``chunk_bytes``: small, a parity commit
    goes in several exchanges)."""
    return _main(replication=None, redundancy=redundancy, chunk_bytes=chunk_bytes, uneven=True)


@pytest.fixture(scope="module")
def uneven_reference():
    return SimJob(4).run(_uneven("copies:2"))


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 24])  # one exchange per commit; up to 8, in pieces
@pytest.mark.parametrize("redundancy", ["xor:4", "rs:4+2"])
@pytest.mark.parametrize("lost", [c for n in (1, 2, 3) for c in itertools.combinations(range(4), n)])
def test_every_loss_pattern_of_a_parity_group_comes_back_bitwise_or_is_data_lost(uneven_reference, redundancy, lost,
                                                                                  chunk_bytes):
    job = SimJob(4, spares=len(lost), inject=",".join(f"{r}@3" for r in lost), rebuild=("spare",))
    if len(lost) <= Redundancy.parse(redundancy).m:
        assert job.run(_uneven(redundancy, chunk_bytes)) == uneven_reference
        assert {tuple(e["dead"]) for e in job.of("store_recovered")} == {lost}
        assert all(e["came_back"] == {d: "parity" for d in lost} for e in job.of("store_recovered"))
    else:
        with pytest.raises(DataLost, match=re.escape(f"parity group [0, 1, 2, 3] ({redundancy}) lost logical ranks "
                                                     f"{list(lost)}")):
            job.run(_uneven(redundancy, chunk_bytes))
    commits = [e for e in job.of("committed") if e["gen"] == 0]
    assert commits and all(e["bytes_out"] > 0 for e in commits)


def test_after_a_shrink_the_adopter_decodes_the_removed_ranks_parity_kept_values(uneven_reference):
    job = SimJob(4, inject="2@3", rebuild=("shrink",))
    got = job.run(_uneven("xor:4"))
    shards = {n: v for r in got for n, v in got[r]["shards"].items()}
    assert sorted(got) == [0, 1, 3] and shards == {n: v for r in uneven_reference
                                                   for n, v in uneven_reference[r]["shards"].items()}


def test_redundancy_and_replication_together_are_refused_and_the_setting_is_the_default():
    from elastic._state import _redundancy
    with pytest.raises(ConfigError, match="give one of them"):
        _redundancy(3, "xor:2", None)
    assert str(_redundancy(None, None, "rs:6+2")) == "rs:6+2" and str(_redundancy(None, None, None)) == "copies:2"
    for program, way in ((_uneven(None), "parity"), (_main(), "copy")):  # _main asks for replication=2
        job = SimJob(4, spares=1, inject="1@3", rebuild=("spare",), redundancy="xor:4")
        job.run(program)
        assert job.of("store_recovered") and all(e["came_back"] == {1: way} for e in job.of("store_recovered"))


def test_a_second_loss_before_the_groups_next_commit_counts_the_replacement_without_parity():
    # Rank 1's replacement holds its payload but no parity until the group commits again: rank 2 lost
    # before that leaves xor:4 two members short; rs:4+2 decodes it.
    job = SimJob(4, spares=2, inject="1@3,2@3/g1", rebuild=("spare",))
    with pytest.raises(DataLost, match=re.escape("lost logical ranks [2], and [1] hold no parity of it")):
        job.run(_uneven("xor:4"))
    job = SimJob(4, spares=2, inject="1@3,2@3/g1", rebuild=("spare",))
    assert job.run(_uneven("rs:4+2")) == SimJob(4).run(_uneven("copies:2"))
    # After a shrink the adopter holds the removed rank's payload, not its parity: the same exposure.
    with pytest.raises(DataLost, match=re.escape("lost logical ranks [2], and [1] hold no parity of it")):
        SimJob(4, inject="1@3,2@3/g1", rebuild=("shrink",)).run(_uneven("xor:4"))
    got = SimJob(4, inject="1@3,2@3/g1", rebuild=("shrink",)).run(_uneven("rs:4+2"))
    assert sorted(got) == [0, 3] and {n: v for r in got for n, v in got[r]["shards"].items()} == \
        {n: v for r, out in SimJob(4).run(_uneven("copies:2")).items() for n, v in out["shards"].items()}


@pytest.mark.parametrize("redundancy", ["copies:3", "rs:4+2"])
def test_a_value_adopted_in_a_shrink_rolls_back_when_a_second_shrink_comes_before_its_next_commit(redundancy):
    """Logical rank 0 adopts rank 1's shard at version 2 and steps it once; rank 2 dies before the
    commit of that step: the adopted shard goes back to version 2 with rank 0's own values (it kept
    the uncommitted step, one update ahead of the failure-free run, until adopted values rolled back)."""
    got = SimJob(4, inject="1@3,2@3/g1", rebuild=("shrink",)).run(_uneven(redundancy))
    assert sorted(got) == [0, 3]
    assert {n: v for r in got for n, v in got[r]["shards"].items()} == \
        {n: v for r, out in SimJob(4).run(_uneven("copies:2")).items() for n, v in out["shards"].items()}
