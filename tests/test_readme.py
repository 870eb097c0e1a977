"""The README's examples run as written: each "Add a method" snippet registers an algorithm that trains a
round on digits and passes the contract's no-mutation check on its server hook; the "Add a dataset" snippet
registers a loader that a federation trains on (tiny IDX files in its layout, nothing downloaded)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from tests.conftest import digits_config
from tests.test_contract import fingerprint

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets(heading: str = "## Add a method", end: str = "## Run on Flower") -> list[str]:
    text = README.read_text()
    section = text[text.index(heading) : text.index(end)]
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


def test_readme_dataset_example_registers_a_loader_a_federation_trains_on(tmp_path, monkeypatch):
    from fedskew.data import files
    from fedskew.data.base import DATASETS
    from tests.test_data_loaders import make_idx_set

    (code,) = snippets("## Add a dataset", "## Add a method")
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    make_idx_set(tmp_path / "kmnist", "", 120, 40, lambda n: np.arange(n) % 10)
    with DATASETS.restored(), monkeypatch.context() as m:
        m.setitem(files.FILES, "kmnist", None)  # the snippet sets it; removed again on exit
        exec(compile(code, "README.md dataset example", "exec"), {})  # our own README, not input
        assert DATASETS.get("kmnist").__name__ == "kmnist"
        cfg = digits_config(
            rounds=1,
            data={
                "dataset": "kmnist",
                "root": str(tmp_path),
                "options": {"verify": False, "download": False},
                "num_clients": 4,
                "partition": {"name": "iid"},
            },
        )
        record = build_simulation(build_config(cfg)).run_round().record
    assert record["rejected"] == 0 and 0.0 <= record["accuracy"] <= 1.0


@pytest.mark.slow
def test_readme_walkthrough_from_runs_to_a_paper_table(tmp_path, monkeypatch):
    """The walkthrough's commands as written (2 rounds instead of 15): a sweep logged to the three trackers,
    a LaTeX table and an HTML page."""
    import shlex
    import subprocess
    import sys

    section = README.read_text().split("## From runs to a paper table")[1].split("\n## ")[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    yaml_text = re.search(r"<<'YAML'\n(.*?)\nYAML\n", block, re.S).group(1)
    (tmp_path / "digits.yaml").write_text(yaml_text)
    commands = block.split("\nYAML\n")[1].replace("\\\n", " ").strip().splitlines()
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    for command in commands:
        words, _, redirect = command.partition(" > ")
        args = shlex.split(words)[1:] + (["--set", "rounds=2"] if " sweep " in command else [])
        done = subprocess.run(
            [sys.executable, "-m", "fedskew.cli", *args], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{command}: {done.stderr[-1500:]}"
        if redirect:
            (tmp_path / redirect.strip()).write_text(done.stdout)
    assert r"\toprule" in (tmp_path / "table.tex").read_text()
    assert "<table>" in (tmp_path / "runs/paper/report.html").read_text()
    assert len(list((tmp_path / "runs/tb").rglob("seed*"))) == 9  # 3 methods × 3 seeds
