"""The CI-sized reliability campaign: every fault class of ``benchmarks/faults.py`` a few times, and ~100
fuzzed configs through ``fedskew run``. Every trial must survive: no traceback, no lost or altered metrics,
every rejection one line with exit code 2."""

from __future__ import annotations

import pytest
from benchmarks.faults import run_campaign, table
from benchmarks.fuzz_config import fuzz_campaign


@pytest.mark.slow
def test_every_fault_class_is_survived():
    rows = run_campaign(trials=1, quick=True, log=lambda _: None)
    faults = {r.fault for r in rows}
    assert len(faults) >= 12, faults
    failed = [(r.fault, r.mode, r.notes) for r in rows if r.survived != r.trials]
    assert not failed, table(rows) + f"\n{failed}"
    assert sum(r.tracebacks + r.rounds_lost + r.altered for r in rows) == 0


def test_fuzzed_configs_are_accepted_or_rejected_in_one_line():
    result = fuzz_campaign(100)
    assert result.examples == 100 and result.tracebacks == 0
    assert not result.unclear, [(o.what, o.code, o.err) for o in result.unclear[:5]]
    assert result.rejected > 50  # the mutations mostly break the config: the checks are exercised
