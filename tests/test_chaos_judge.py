"""How scripts/chaos.py judges a run that ended in DataLost: from fixed events, no job run.

A shrink gives a dead rank's state to an adopter, which alone holds it (beside the copies the
holders keep) until the next commit; the adopter's death in that window loses it where the
holders died too, and the judge must expect that, not call the agreed DataLost a mismatch."""
from __future__ import annotations

import importlib.util
import json
import sys

from conftest import ROOT

spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
chaos = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = chaos  # dataclasses look their module up there
spec.loader.exec_module(chaos)


def _events(tmp_path, adopter: int, commit_between: bool = False):
    """Logical 3 dies in generation 0, a shrink gives its state to ``adopter``, logical 0 dies in
    generation 1 (replication 2 on 4 ranks, one chunk each: logical 3's copy is on logical 0)."""
    tmp_path.mkdir(exist_ok=True)
    events = [{"event": "inject", "t": 1.0, "gen": 0, "rank": 3, "point": "step", "action": "exit"},
              {"event": "store_recovered", "t": 2.0, "gen": 1, "dead": [3], "receivers": {"3": adopter}},
              {"event": "inject", "t": 3.0, "gen": 1, "rank": 0, "point": "step", "action": "raise"}]
    if commit_between:
        events.insert(2, {"event": "committed", "t": 2.5, "gen": 1})
    (tmp_path / "events-host-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return tmp_path


SCENARIO = chaos.Scenario(mode="shrink", rebuild="shrink", spares=0, replication=2, inject="3@6:exit,0@9:raise/g1",
                          stall=None, straggler=None)


def test_the_adopter_that_held_the_only_copy_dying_before_a_commit_loses_the_state(tmp_path):
    assert chaos.loss_expected(_events(tmp_path, adopter=0), SCENARIO, chunks=1)


def test_an_adopter_that_lives_or_a_commit_in_between_keeps_it(tmp_path):
    assert not chaos.loss_expected(_events(tmp_path / "a", adopter=1), SCENARIO, chunks=1)
    assert not chaos.loss_expected(_events(tmp_path / "b", adopter=0, commit_between=True), SCENARIO, chunks=1)
