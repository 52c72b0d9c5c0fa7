"""The fault-injection scenarios of ``pdserve chaos`` (pdserve/chaos/scenarios.py), each on
its own cluster of real processes: what the clients saw, no block stranded, greedy output
unchanged. Two run in the default suite (a decode worker killed, a prefill worker stopped);
the rest are slow (kv-corruption has a quicker default test: tests/integration/
test_kv_corruption.py)."""
from __future__ import annotations

import pytest

from pdserve.chaos.scenarios import SCENARIOS

DEFAULT = ("kill-decode", "stop-prefill")


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in SCENARIOS])
def test_scenario(name):
    res = SCENARIOS[name]()
    failed = [check for check, ok in res.checks.items() if not ok]
    assert res.passed, (failed, res.figures, res.notes)
