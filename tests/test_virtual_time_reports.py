"""Issue 55: ``eval.per_class`` (the global model's test accuracy per class, what a deadline does to the rare
classes) and accuracy against virtual time (``fedskew report --x virtual_time``, ``accuracy_at_time``), on
hand cases: a model that always predicts one class, and result folders whose curves are known."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
import torch
import yaml

from fedskew.engine.assembly import initial_server
from fedskew.engine.evaluation import EvalData, Evaluator, class_accuracy
from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.build import build_algorithm, build_data
from fedskew.experiment.config import build_config
from fedskew.experiment.report import find_runs, group_runs, run_value
from fedskew.experiment.report_time import accuracy_at_time, draw_time, mean_time_curve
from fedskew.experiment.reporting import paired_at_time
from fedskew.experiment.runner import run_experiment
from tests.conftest import cli, digits_config

matplotlib.use("Agg")


# ---------------------------------------------------------------------------- per-class accuracy
def test_class_accuracy_on_hand_counts():
    correct = torch.tensor([True, False, True, True, False, False])
    labels = torch.tensor([0, 0, 1, 2, 2, 2])
    assert class_accuracy(correct, labels, 4) == [0.5, 1.0, 1 / 3, None]  # class 3: no test sample
    empty = class_accuracy(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long), 3)
    assert empty == [None, None, None]


def always(cfg: dict[str, Any], cls: int, protocol: str = "global") -> dict[str, Any]:
    """The test record of a model that predicts ``cls`` for every sample (zero weights, the classifier's
    bias one-hot on ``cls``), scored by an evaluator asked for per-class accuracy."""
    config = build_config(cfg)
    data = build_data(config)
    algorithm, models = build_algorithm(config, data)
    server = initial_server(algorithm, models, config.seed)
    weights = {k: torch.zeros_like(v) for k, v in server["weights"].items()}
    weights["classifier.bias"][cls] = 1.0
    ev = Evaluator(algorithm, models, EvalData.of(data, models.device), protocol, 64, 0, per_class=True)
    return ev.evaluate({**server, "weights": weights}, lambda cid: {}, 1)


def test_a_model_that_always_says_three_is_right_on_every_three_and_no_other_class():
    record = always(digits_config(rounds=1), 3)
    assert record["accuracy_classes"] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert record["accuracy"] == 37 / 360  # digits' test set holds 37 threes of 360


def test_personalized_pools_the_clients_test_samples_and_a_class_none_of_them_holds_is_none():
    """Three clients of one class each ({3}, {1}, {0} on this seed): the other seven classes have no
    client test sample: ``None``, not 0."""
    data = {"dataset": "digits", "num_clients": 3, "partition": {"name": "classes_per_client", "k": 1}}
    record = always(digits_config(rounds=1, data=data), 3, "personalized")
    assert record["accuracy_classes"] == [0.0, 0.0, None, 1.0, None, None, None, None, None, None]
    assert record["accuracy_clients"] == [1.0, 0.0, 0.0]


def metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_off_by_default_the_records_hold_no_per_class_key(tmp_path):
    summary = run_experiment(build_config(digits_config(rounds=1)), tmp_path / "r")
    assert "accuracy_classes" not in summary["final"]
    assert all("accuracy_classes" not in m for m in metrics(tmp_path / "r"))


@pytest.mark.parametrize(
    ("algorithm", "protocol", "pooled"),
    [("fedavg", "global", "accuracy"), ("fedper", "personalized", "accuracy_weighted")],
)
def test_a_run_s_class_accuracies_weighted_by_class_size_give_its_accuracy_exactly(
    tmp_path, algorithm, protocol, pooled
):
    """Each class's accuracy times its test count is a whole number of hits, and the hits add up to the
    record's accuracy (personalized: the sample-weighted one, every client's own model on its samples)."""
    cfg = digits_config(
        rounds=2, algorithm={"name": algorithm}, eval={"protocol": protocol, "per_class": True}
    )
    run_experiment(build_config(cfg), tmp_path / "r")
    fd = build_data(build_config(cfg))
    y = fd.dataset.y_test
    labels = y if protocol == "global" else y[torch.cat(fd.test_idx)]
    counts = torch.bincount(labels, minlength=10).tolist()
    records = metrics(tmp_path / "r")
    assert len(records) == 2
    for m in records:
        hits = [0.0 if a is None else a * n for a, n in zip(m["accuracy_classes"], counts, strict=True)]
        assert all(h == pytest.approx(round(h), abs=1e-9) for h in hits)
        assert sum(round(h) for h in hits) / sum(counts) == pytest.approx(m[pooled], abs=1e-12)
    assert any(0 < a < 1 for a in records[-1]["accuracy_classes"])  # not a degenerate model


def test_per_class_is_refused_on_a_flower_runtime_in_one_line():
    cfg = digits_config(eval={"per_class": True}, engine={"runtime": "flower-simulation"})
    with pytest.raises(ConfigError) as info:
        build_config(cfg)
    assert str(info.value) == (
        "config key 'eval.per_class': accuracy per class is measured by the embedded engine, not "
        "engine.runtime=flower-simulation; allowed: false"
    )


def test_per_class_takes_a_boolean_only(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(digits_config(rounds=1)))
    args = ["run", str(path), "--out", str(tmp_path / "out"), "--set", "eval.per_class=sometimes"]
    code, _, err = cli(args, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "eval.per_class" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- accuracy vs virtual time
#: (virtual time, accuracy) per seed: seed 1's second evaluation was not finite (logged null)
CURVES = {
    "fast": {0: [(10.0, 0.1), (20.0, 0.2), (30.0, 0.3)], 1: [(15.0, 0.4), (25.0, 0.5)]},
    "slow": {0: [(40.0, 0.6), (80.0, 0.7)], 1: [(5.0, 0.2), (60.0, None)]},
}


def write_run(
    root: Path, folder: str, seed: int, curve: list[tuple[float, float | None]], clock: bool = True
):
    """A finished run written by hand: one evaluated record per (virtual time, accuracy)."""
    out = root / folder / f"seed{seed}"
    out.mkdir(parents=True)
    lr = 0.05 if folder == "fast" else 0.1  # tells the groups apart
    cfg = build_config({**digits_config(rounds=3), "seed": seed, "client": {"lr": lr}}).to_dict()
    records = [
        {"round": r + 1, "accuracy": a, "loss": 1.0, **({"virtual_time": t} if clock else {})}
        for r, (t, a) in enumerate(curve)
    ]
    final = {"accuracy": records[-1]["accuracy"], "accuracy_std": 0.0, "loss": 1.0}
    summary = {"final": final, "rounds": len(curve), "wall_seconds": 1.0, "bytes_up": 1, "protocol": "global"}
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))
    (out / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def timed(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for folder, seeds in CURVES.items():
        for seed, curve in seeds.items():
            write_run(root, folder, seed, curve)
    return root


def group(root: Path, name: str):
    return next(g for g in group_runs(find_runs([root])) if g.runs[0].path.parent.name == name)


def test_the_mean_curve_steps_through_every_run_s_times_up_to_the_shortest_run_s_end(timed):
    """fast: seed 0 at 10/20/30, seed 1 at 15/25: the mean from 15 (both evaluated) to 25 (seed 1's end),
    each run's value that of its last evaluation at or before the time."""
    grid, mean = mean_time_curve(group(timed, "fast"))
    assert grid.tolist() == [15.0, 20.0, 25.0]
    assert mean == pytest.approx([(0.1 + 0.4) / 2, (0.2 + 0.4) / 2, (0.2 + 0.5) / 2])


def test_the_figure_draws_the_mean_and_each_seed_at_its_own_times(timed):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    draw_time(ax, group(timed, "fast"), "accuracy", 100.0, "fast")
    mean, *seeds = ax.lines
    assert list(mean.get_xdata()) == [15.0, 20.0, 25.0] and mean.get_drawstyle() == "steps-post"
    assert [list(s.get_xdata()) for s in seeds] == [[10.0, 20.0, 30.0], [15.0, 25.0]]  # none extended
    assert list(seeds[1].get_ydata()) == pytest.approx([40.0, 50.0])
    assert {s.get_color() for s in seeds} == {mean.get_color()}  # a group keeps one colour
    plt.close(fig)


def test_report_x_virtual_time_writes_the_figure(timed, tmp_path, monkeypatch, capsys):
    png = tmp_path / "t.png"
    code, out, err = cli(
        ["report", str(timed), "--x", "virtual_time", "--plot", str(png)], monkeypatch, capsys
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in out
    by_round = tmp_path / "r.png"
    assert cli(["report", str(timed), "--plot", str(by_round)], monkeypatch, capsys)[0] == 0
    assert by_round.read_bytes() != png.read_bytes()  # another x axis, another figure


def test_a_folder_without_virtual_time_is_named_in_one_line_and_nothing_is_written(
    timed, tmp_path, monkeypatch, capsys
):
    write_run(timed, "noclock", 0, [(1.0, 0.5)], clock=False)  # beside runs that do have the clock
    png = tmp_path / "t.png"
    code, _, err = cli(["report", str(timed), "--x", "virtual_time", "--plot", str(png)], monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1
    assert err == (
        f"error: --x virtual_time: '{timed / 'noclock' / 'seed0'}' logs no virtual_time in its metrics.jsonl "
        "(a run without a clock: section); allowed for it: --x round\n"
    )
    assert not png.exists() and not (tmp_path / "t_provenance.json").exists()
    code, _, err = cli(["report", str(timed), "--x", "wallclock", "--plot", str(png)], monkeypatch, capsys)
    assert code == 2 and err == "error: --x 'wallclock': unknown x axis; allowed: round, virtual_time\n"


def test_accuracy_at_time_is_each_seed_s_last_evaluation_within_the_budget(timed):
    fast, slow = group(timed, "fast"), group(timed, "slow")
    assert accuracy_at_time(fast, 9.0) == {0: None, 1: None}  # before any evaluation: None, not 0
    assert accuracy_at_time(fast, 10.0) == {0: 0.1, 1: None}  # at the evaluation's own time: counted
    assert accuracy_at_time(fast, 24.9) == {0: 0.2, 1: 0.4}
    assert accuracy_at_time(fast, 1e9) == {0: 0.3, 1: 0.5}  # past a run's end: its last value
    at = accuracy_at_time(slow, 60.0)
    assert at[0] == 0.6 and math.isnan(at[1])  # a non-finite evaluation: NaN, told apart from "not yet"
    paired = paired_at_time([fast, slow], fast, 40.0)
    assert len(paired) == 1 and paired[0].diffs == pytest.approx({0: 0.6 - 0.3, 1: 0.2 - 0.5})
    assert paired_at_time([fast, slow], fast, 12.0)[0].unpaired == 2  # no seed has both by t = 12


def test_accuracy_at_time_refuses_a_meaningless_budget_unsorted_records_and_a_run_without_the_clock(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "fast", 0, [(30.0, 0.3), (10.0, 0.1), (20.0, 0.2)])  # written out of time order
    assert accuracy_at_time(group(root, "fast"), 25.0) == {0: 0.2}
    for budget in (float("nan"), float("inf"), -1.0):
        with pytest.raises(FedskewError, match="virtual-time budget"):
            accuracy_at_time(group(root, "fast"), budget)
    write_run(root, "slow", 0, [(1.0, 0.5)], clock=False)
    with pytest.raises(FedskewError, match="logs no virtual_time"):
        accuracy_at_time(group(root, "slow"), 5.0)
    write_run(root / "again", "fast", 0, [(5.0, 0.9)])  # a second run of seed 0 in the same group
    with pytest.raises(FedskewError, match="two runs of seed 0"):
        accuracy_at_time(group(root, "fast"), 5.0)


def test_a_list_valued_metric_is_no_paired_metric(timed):
    """``--paired --metric accuracy_classes``: one line, not a TypeError from float(list)."""
    run = find_runs([timed])[0]
    run.summary["final"]["accuracy_classes"] = [0.5, None]
    with pytest.raises(FedskewError, match="no number in the results of"):
        run_value(run, "accuracy_classes")
    assert np.isfinite(run_value(run, "accuracy"))
