"""Golden results: every registered algorithm's metrics on small digits configs equal the recorded ones
exactly (sequential mode, bit for bit). A deliberate change re-records ``tests/golden/results.json``
(``python -m tests.golden.cases --record``) and is explained in the change's notes."""

from __future__ import annotations

import json

import pytest

from tests.golden.cases import RESULTS, case_names, run_case
from tests.test_contract import package_algorithms

GOLDEN = json.loads(RESULTS.read_text())


def test_every_registered_algorithm_has_a_golden_case():
    assert set(package_algorithms()) <= set(GOLDEN)
    assert set(case_names()) == set(GOLDEN)


@pytest.mark.parametrize("name", case_names())
def test_metrics_equal_the_golden_record(tmp_path, name):
    records = run_case(name, tmp_path / name)
    expected = GOLDEN[name]
    assert len(records) == len(expected)
    for got, want in zip(records, expected, strict=True):
        assert got.keys() == want.keys(), name
        for key in want:
            assert got[key] == want[key], f"{name} round {want['round']}: {key} {got[key]!r} != {want[key]!r}"
