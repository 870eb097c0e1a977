"""The README's examples run as written: each "Add a method" snippet registers an algorithm that trains a
round on digits and passes the contract's no-mutation check on its server hook; the method in the user's own
folder runs through ``fedskew run``, ``fedskew sweep --jobs 2`` and the Flower apps (loopback) from its
config's ``plugins:``; the "Add a dataset" snippet registers a loader that a federation trains on (tiny IDX
files in its layout, nothing downloaded)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.testing import fingerprint
from tests.conftest import digits_config

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
    with ALGORITHMS.restored():  # forgotten afterwards: the plugin tests load the same name from its file
        exec(compile(code, f"README.md example {index}", "exec"), {})  # our own README, not input
        assert ALGORITHMS.get(name).name == name  # the registry names the class
        sim = build_simulation(build_config(digits_config(rounds=2, algorithm={"name": name})))
    before = {k: v.clone() for k, v in sim.server["weights"].items()}
    server_print = fingerprint(sim.server)
    first = sim.run_round().record
    assert fingerprint(sim.server) != server_print and first["rejected"] == 0
    assert any(not torch.equal(before[k], sim.server["weights"][k]) for k in before)
    assert sim.run_round().record["accuracy"] > 0.2  # chance is 0.1


# ---------------------------------------------------------------------------- a method in the user's folder
PLUGIN_EXAMPLE = Path(__file__).parent / "plugin_example"


def user_folder(tmp: Path) -> Path:
    """The README's ``my_method.py`` and ``experiment.yaml`` written into a folder outside the repository."""
    section = README.read_text().split("## Add a method")[1].split("\n## ")[0]
    folder = tmp / "my_project"
    folder.mkdir()
    (folder / "my_method.py").write_text(snippets()[0])
    (folder / "experiment.yaml").write_text(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    return folder


def test_the_plugin_example_folder_holds_the_readme_method():
    fixture = (PLUGIN_EXAMPLE / "my_method.py").read_text()
    assert fixture.split('"""', 2)[2].strip() == snippets()[0].strip()


def _main(argv: list[str], monkeypatch) -> int:
    import sys

    import fedskew.cli

    monkeypatch.setattr(sys, "argv", ["fedskew", *argv])
    try:
        fedskew.cli.main()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _metrics(out: Path) -> list[dict]:
    import json

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]


def test_the_readme_method_in_a_user_folder_runs_embedded_and_in_a_two_worker_sweep(tmp_path, monkeypatch):
    """``fedskew run`` and ``fedskew sweep --jobs 2`` from outside the repository: the sweep's spawned
    workers load the plugin from the recorded config and give the embedded run's numbers; the second
    config of the sweep also brings its own dataset and model (tests/plugin_example)."""
    from fedskew.data.base import DATASETS
    from fedskew.models.base import MODELS

    folder = user_folder(tmp_path)
    shutil.copytree(PLUGIN_EXAMPLE, tmp_path / "other")
    (tmp_path / "other/my_method.py").unlink()  # a second copy would collide (one name, two sources)
    blobs_yaml = (tmp_path / "other/experiment.yaml").read_text()
    (tmp_path / "other/blobs.yaml").write_text(
        blobs_yaml.replace("[my_method.py,", "[../my_project/my_method.py,")
    )
    monkeypatch.chdir(tmp_path)
    with ALGORITHMS.restored(), DATASETS.restored(), MODELS.restored():
        assert _main(["run", str(folder / "experiment.yaml"), "--out", "run"], monkeypatch) == 0
        configs = [str(folder / "experiment.yaml"), "other/blobs.yaml"]
        assert _main(["sweep", *configs, "--jobs", "2", "--out", "sweep"], monkeypatch) == 0
    embedded = _metrics(tmp_path / "run")
    assert len(embedded) == 3 and embedded[-1]["accuracy"] > 0.2  # chance is 0.1
    (mine,) = (tmp_path / "sweep/experiment").rglob("metrics.jsonl")
    assert _metrics(mine.parent) == embedded  # the same numbers in a spawned worker
    (blobs,) = (tmp_path / "sweep/blobs").rglob("metrics.jsonl")
    assert len(_metrics(blobs.parent)) == 2 and _metrics(blobs.parent)[-1]["accuracy"] > 0.25  # 4 classes


def test_the_readme_method_in_a_user_folder_gives_the_embedded_numbers_on_the_flower_apps(tmp_path):
    pytest.importorskip("flwr")
    from fedskew.experiment.config import load_config
    from fedskew.experiment.runner import run_experiment
    from fedskew.flower.server import serve
    from tests.flower_loopback import LoopbackGrid

    folder = user_folder(tmp_path)
    with ALGORITHMS.restored():
        cfg = load_config(folder / "experiment.yaml", ["rounds=2"])
        run_experiment(cfg, tmp_path / "embedded")
        flower = load_config(folder / "experiment.yaml", ["rounds=2", "engine.runtime=flower-simulation"])
        serve(LoopbackGrid(3), flower, tmp_path / "flower", resume=False, force=False)  # the ClientApp's
        # handlers build the config from its text: plugins loaded from the recorded absolute path
    embedded, on_flower = _metrics(tmp_path / "embedded"), _metrics(tmp_path / "flower")
    keys = ("round", "accuracy", "loss", "train_loss")
    assert len(on_flower) == len(embedded) == 2
    for a, b in zip(on_flower, embedded, strict=True):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5)


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
