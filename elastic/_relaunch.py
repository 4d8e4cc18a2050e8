"""The relaunch planner: after a launch ended unfinished (a node lost), what the next one runs (local).

From what the last launch's processes wrote (where each logical rank lived at
the last agreed commit, which injections fired) and the hosts that are lost,
it decides the next placement (``_nodes.replan``: ranks stay on their hosts, a
lost host's go to a spare node or are removed), probes real hosts before using
them (a host that does not answer is lost too, and the plan made again), and
gives the configuration every process of the relaunch starts from. No MPI, no
processes started (the probe aside).
"""
from __future__ import annotations

import dataclasses

from elastic.comm import Config
from elastic.comm.events import read_events
from elastic.comm.faults import parse_schedule
from elastic.comm.runtime import SPARE, Relaunch

from . import _nodes
from ._plan import LaunchPlan


@dataclasses.dataclass(frozen=True)
class NextLaunch:
    placement: _nodes.Placement
    relaunch: Relaunch
    config: Config                      # what every process of the relaunch starts from
    spare_hosts: tuple[str, ...]        # spare nodes still unused
    probed: frozenset[str]              # hosts the probe found dead

    def describe(self, plan: LaunchPlan, lost: set[str]) -> str:
        what = f"node(s) {', '.join(sorted(lost))} lost" if lost else "the runtime ended unfinished"
        relaunch = self.relaunch
        moved = (f"; logical ranks {list(relaunch.replaced)} on spare node(s)" if relaunch.replaced else "") + \
            (f"; logical ranks {list(relaunch.removed)} removed (shrink)" if relaunch.removed else "")
        return (f"{what}: relaunch {relaunch.count} of {plan.relaunches} on "
                f"{', '.join(h for h, _ in self.placement.hosts)} from the nodes' memory{moved}")


def next_launch(plan: LaunchPlan, previous: _nodes.Placement, config: Config, spare_hosts: tuple[str, ...],
                pids: set[int], lost: set[str], lost_before: set[str], count: int) -> NextLaunch:
    """The ``count``-th relaunch after the launch of ``pids`` (their files in the run directory)
    ended unfinished with ``lost`` hosts gone (``lost_before``: in earlier launches).

    Raises:
        GiveUp: no relaunch can continue the job (no spare node and no shrink, too few ranks left).
        ConfigError: the injections still owed do not fit the new placement.
    """
    events = read_events(plan.run_dir)
    generation, live_on, host_of = _nodes.where_ranks_live(plan.run_dir, pids)
    committed = any(e["event"] == "committed" for e in events)
    placement, relaunch, left, probed = _probed_placement(plan, previous, live_on, lost, list(spare_hosts), config,
                                                          count, generation + 1, committed)
    inject = _nodes.pending_injections(plan.inject_text, [e for e in events if e["event"] == "inject"],
                                       lost | lost_before | probed, host_of)
    if plan.simulate_nodes:
        inject = _nodes.node_injections(inject, placement.ranks_on(), left)
    # What did not fire yet fires in the relaunch, its generations counted from the relaunch's start.
    pending = tuple(dataclasses.replace(e, gen=e.gen + relaunch.generation)
                    for e in (parse_schedule(inject) if inject else ()))
    config = config.replace(relaunch=relaunch, spares=placement.table.count(SPARE), inject=pending)
    return NextLaunch(placement, relaunch, config, tuple(left), frozenset(probed))


def _probed_placement(plan: LaunchPlan, previous: _nodes.Placement, live_on: dict[int, str], lost: set[str],
                      spare_hosts: list[str], config: Config, count: int, generation: int, committed: bool
                      ) -> tuple[_nodes.Placement, Relaunch, list[str], set[str]]:
    """The relaunch's placement (``_nodes.replan``) on hosts that answer a probe (real hosts; a
    simulated node's loss is known): a host that does not is lost too, and the plan made again.
    Returns the placement, the Relaunch, the spare nodes left and the hosts the probe found dead."""
    probed: set[str] = set()
    agent = _nodes.rsh_agent(plan.mca)
    while True:
        spares = [h for h in spare_hosts if h not in probed]
        placement, relaunch, left = _nodes.replan(previous, live_on, lost | probed, spares, config, count, generation,
                                                  plan.nprocs, committed)
        if plan.simulate_nodes or len(plan.hosts) + len(plan.spare_hosts) < 2:
            return placement, relaunch, left, probed
        dead = _nodes.unreachable([h for h, _ in placement.hosts], slurm=plan.slurm, agent=agent)
        if not dead:
            return placement, relaunch, left, probed
        print(f"[launch] {', '.join(sorted(dead))} did not answer (the probe): counted as lost", flush=True)
        probed |= dead

