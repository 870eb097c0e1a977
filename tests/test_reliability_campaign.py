"""The CI-sized reliability campaign: every fault class of ``benchmarks/faults.py`` a few times, and ~100
fuzzed configs through ``fedskew run``. Every trial must survive: no traceback, no lost or altered metrics,
every rejection one line with exit code 2."""

from __future__ import annotations

import subprocess
import sys

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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "sets", "expected"),
    [
        (b"- 1\n- 2\n", [], "config must be a mapping"),
        (
            b"data:\n  partition: {name: iid, nope: 1}\n",
            [],
            "config key 'data.partition.nope': unknown option",
        ),
        (b"rounds: 2\n", ["client.lr=-1"], "config key 'client.lr': Input should be greater than 0"),
        (b"\xff\xfe\x00", [], "not UTF-8"),
        (b"rounds: \x12\n", [], "invalid YAML (unacceptable character #x0012"),  # a fuzzer's find
    ],
)
def test_bad_input_through_the_real_command_is_one_line_with_exit_code_2(tmp_path, content, sets, expected):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "fedskew.cli", "run", str(path), "--out", str(tmp_path / "out"), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert expected in res.stderr and "Traceback" not in res.stderr
