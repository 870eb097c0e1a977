"""The README's "Add a method" examples run as written: each snippet registers an algorithm that trains a
round on digits and passes the contract's no-mutation check on its server hook."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from tests.conftest import digits_config
from tests.test_contract import fingerprint

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Add a method") : text.index("## Benchmarks")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_both_examples():
    assert len(snippets()) == 2


@pytest.mark.parametrize("index", [0, 1])
def test_readme_example_registers_and_trains(index):
    code = snippets()[index]
    name = re.search(r'register\("(\w+)"\)', code).group(1)
    if name not in ALGORITHMS:
        exec(compile(code, f"README.md example {index}", "exec"), {})  # our own README, not input
    assert ALGORITHMS.get(name).name == name  # the registry names the class
    sim = build_simulation(build_config(digits_config(rounds=2, algorithm={"name": name})))
    before = {k: v.clone() for k, v in sim.server["weights"].items()}
    server_print = fingerprint(sim.server)
    first = sim.run_round().record
    assert fingerprint(sim.server) != server_print and first["rejected"] == 0
    assert any(not torch.equal(before[k], sim.server["weights"][k]) for k in before)
    assert sim.run_round().record["accuracy"] > 0.2  # chance is 0.1
