"""Reports that do not mislead (issue 54, item 9): the unit of each spread per protocol, labels naming every
result-changing key that differs between the compared groups, counts as seeds × clients."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config
from fedskew.experiment.failure import final_line
from fedskew.experiment.report import find_runs, group_runs
from fedskew.experiment.report_html import pooled_count
from fedskew.experiment.reporting import ReportRequest, make_report
from fedskew.experiment.runner import run_experiment
from tests.conftest import digits_config


def write_run(root: Path, folder: str, seed: int, config: dict[str, Any], clients: int | None = None) -> None:
    """A finished run written by hand; ``clients``: per-client accuracies (personalized), else global."""
    out = root / folder / f"seed{seed}"
    out.mkdir(parents=True)
    protocol = "global" if clients is None else "personalized"
    cfg = build_config({**config, "seed": seed, "eval": {"protocol": protocol}}).to_dict()
    final: dict[str, Any] = {"accuracy": 0.5 + seed / 100, "accuracy_std": 0.0, "loss": 1.0}
    if clients is not None:
        final.update(accuracy_clients=[0.4 + c / 100 for c in range(clients)], accuracy_std=0.1)
    summary = {"final": final, "rounds": 2, "wall_seconds": 1.0, "bytes_up": 1, "protocol": protocol}
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    (out / "metrics.jsonl").write_text(json.dumps({"round": 2, **final}) + "\n")
    (out / "summary.json").write_text(json.dumps(summary))


def every_format(root: Path, tmp_path: Path, **kw: Any) -> str:
    """Markdown, LaTeX, CSV, the HTML page and the JSON sidecar of one report, concatenated."""
    texts = [
        make_report(ReportRequest([root], fmt, plot=tmp_path / "p.png", html=tmp_path / "r.html", **kw)).text
        for fmt in ("markdown", "latex", "csv")
    ]
    return "\n".join(
        [*texts, (tmp_path / "r.html").read_text(), (tmp_path / "p_provenance.json").read_text()]
    )


# ---------------------------------------------------------------------------- spreads
def test_a_global_protocol_report_never_says_over_clients(tmp_path: Path) -> None:
    """A real global-protocol run (its summary records accuracy_std 0.0) in every format, and `fedskew
    run`'s closing line."""
    summary = run_experiment(build_config(digits_config(rounds=1)), tmp_path / "runs" / "a")
    assert summary["final"]["accuracy_std"] == 0.0  # recorded, and meaningless: one model, one test set
    text = every_format(tmp_path / "runs", tmp_path)
    assert "over clients" not in text and "no per-client spread" in text
    assert "over clients" not in final_line(summary, tmp_path)
    md = text.split("\n\n")[0]
    assert "std over clients" not in md.splitlines()[0]  # the default column is left out


def test_mixed_protocols_state_each_spread_and_leave_global_runs_na(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for seed in (0, 1):
        write_run(root, "pers", seed, {"algorithm": {"name": "fedavg"}}, clients=10)
        write_run(root, "glob", seed, {"algorithm": {"name": "fedprox"}})
    md = make_report(ReportRequest([root], plot=tmp_path / "p.png")).text
    rows = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| fed")}
    # the protocol differs between the groups: the labels say so
    assert "| 10.00 |" in rows["| fedavg (eval.protocol=personalized)"]  # the std over clients
    assert "| n/a |" in rows["| fedprox (eval.protocol=global)"]  # not the 0.00 the global runs recorded
    assert "± is the sample std over seeds" in md
    assert "std over clients: the spread of a run's per-client test accuracies" in md
    assert "n/a for runs under the global protocol" in md


def test_asking_for_a_per_client_spread_of_global_runs_is_one_line(tmp_path: Path) -> None:
    write_run(tmp_path / "runs", "glob", 0, {})
    with pytest.raises(
        FedskewError, match=r"--metrics 'accuracy_std': no run has it \(the runs used the global"
    ):
        make_report(ReportRequest([tmp_path / "runs"], metrics="accuracy_std", plot=tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()


def test_the_closing_line_states_the_spread_over_clients_only_where_it_exists() -> None:
    base = {"rounds": 3, "wall_seconds": 2.0}
    pers = {**base, "protocol": "personalized", "final": {"accuracy": 0.8, "accuracy_std": 0.05}}
    glob = {**base, "protocol": "global", "final": {"accuracy": 0.8, "accuracy_std": 0.0}}
    assert (
        final_line(pers, "o")
        == "final accuracy 80.00% (± 5.00 std over clients) after 3 rounds in 2.0 s -> o"
    )
    assert final_line(glob, "o") == "final accuracy 80.00% after 3 rounds in 2.0 s -> o"


# ---------------------------------------------------------------------------- labels
def labels(root: Path) -> list[str]:
    return sorted(g.label.split(" | ")[0] for g in group_runs(find_runs([root])))


def test_labels_show_every_result_changing_key_that_differs(tmp_path: Path) -> None:
    """FedAvg at lr 0.1 against FedProx at lr 0.01: the labels used to differ by the method alone."""
    root = tmp_path / "runs"
    write_run(root, "a", 0, {"algorithm": {"name": "fedavg"}, "client": {"lr": 0.1}})
    write_run(root, "b", 0, {"algorithm": {"name": "fedprox", "mu": 0.01}, "client": {"lr": 0.01}})
    assert labels(root) == ["fedavg (client.lr=0.1)", "fedprox (client.lr=0.01)"]  # mu: part of FedProx
    write_run(root, "c", 0, {"algorithm": {"name": "fedprox", "mu": 0.1}, "client": {"lr": 0.01}})
    assert labels(root) == [
        "fedavg (client.lr=0.1)",
        "fedprox (algorithm.mu=0.01,client.lr=0.01)",
        "fedprox (algorithm.mu=0.1,client.lr=0.01)",
    ]


def test_runtime_only_keys_stay_out_of_labels_unless_nothing_else_tells_groups_apart(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    write_run(
        root, "a", 0, {"algorithm": {"name": "fedavg"}, "engine": {"workers": 2}, "checkpoint": {"every": 3}}
    )
    write_run(root, "b", 0, {"algorithm": {"name": "fedprox"}})
    assert labels(root) == ["fedavg", "fedprox"]  # workers and checkpoints do not change the numbers
    write_run(root, "c", 0, {"algorithm": {"name": "fedavg"}})
    assert labels(root) == [
        "fedavg (checkpoint.every=3,engine.workers=2)",
        "fedavg (checkpoint.every=5,engine.workers=1)",
        "fedprox",
    ]


def test_labels_name_a_differing_partition_or_attack(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    dirichlet = {"name": "dirichlet", "alpha": 0.1}
    write_run(root, "a", 0, {"data": {"partition": dirichlet}})
    write_run(
        root, "b", 0, {"data": {"partition": dirichlet}, "attack": {"name": "sign_flip", "fraction": 0.2}}
    )
    groups = {g.runs[0].path.parent.name: g.label for g in group_runs(find_runs([root]))}
    assert groups["a"].startswith(
        "fedavg (attack.fraction=0.0,attack.name=none) | digits dirichlet(alpha=0.1)"
    )
    assert groups["b"].startswith("fedavg (attack.fraction=0.2,attack.name=sign_flip) | ")


# ---------------------------------------------------------------------------- counts
def test_pooled_client_counts_say_seeds_times_clients(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for seed in (0, 1, 2):
        write_run(root, "same", seed, {"algorithm": {"name": "fedavg"}}, clients=10)
    write_run(root, "uneven", 0, {"algorithm": {"name": "fedprox"}}, clients=10)
    write_run(root, "uneven", 1, {"algorithm": {"name": "fedprox"}}, clients=8)
    groups = {g.algorithm: g for g in group_runs(find_runs([root]))}
    assert pooled_count(groups["fedavg"]) == "3 seeds × 10 clients"  # not "30 clients"
    assert pooled_count(groups["fedprox"]) == "18 clients over 2 seeds"
    page = every_format(root, tmp_path)
    assert re.search(r"\| fedavg \| digits iid\(\) \| mlp_mpfedcl \| 3 \|", page)
