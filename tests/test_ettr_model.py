"""The ETTR model of scripts/simulate_ettr.py: the formula, the optimum and the simulation agree."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("simulate_ettr", ROOT / "scripts" / "simulate_ettr.py")
model = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = model  # dataclasses look their module up there
spec.loader.exec_module(model)


@pytest.mark.parametrize("cost, recover, mttf",
                         [(2.0, 1.0, 3600.0), (60.0, 600.0, 7 * 3600.0), (16.0, 616.0, 4 * 3600.0)])
def test_daly_interval_is_the_optimum_and_the_simulation_agrees(cost, recover, mttf):
    method = model.Method("m", cost, recover)
    tau = model.optimal_interval(method, mttf)
    best = model.ettr(tau, method, mttf)
    assert best >= model.ettr(tau / 2, method, mttf) and best >= model.ettr(tau * 2, method, mttf)
    assert model.simulate(tau, method, mttf, days=60) == pytest.approx(best, abs=0.03)


def test_cheaper_recovery_never_loses():
    mttf = model.RANK_MTBF_H["Meta 1k-GPU MTTF 7.9 h"] * 3600 / 16384
    fast, slow = model.Method("mem", 2.0, 1.0), model.Method("ckpt", 16.0, 616.0)
    assert model.ettr(model.optimal_interval(fast, mttf), fast, mttf) > \
        model.ettr(model.optimal_interval(slow, mttf), slow, mttf)
