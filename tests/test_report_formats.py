"""``fedskew report --format markdown|latex|csv``, ``--metrics``, ``--target``, ``--html``: the same numbers
in every format, the best of each column in bold, the paired mark where the interval excludes 0, on result
folders whose numbers are known."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedskew.experiment.report import find_runs, group_runs
from fedskew.experiment.report_tables import build_table, columns_for, markdown_table, render_latex
from fedskew.experiment.reporting import ReportRequest, make_report

#: final accuracy per seed; B is A + 0.05 on every seed (its paired interval excludes 0), C ties A on average
ACCURACY = {"A": [0.50, 0.60, 0.70], "B": [0.55, 0.66, 0.74], "C": [0.60, 0.50, 0.70]}
LOSS = {"A": 1.0, "B": 0.8, "C": 1.2}


def write_run(root: Path, method: str, seed: int, accuracy: float) -> None:
    folder = root / method / f"seed{seed}"
    folder.mkdir(parents=True)
    config = {
        "seed": seed,
        "algorithm": {"name": method},
        "data": {"dataset": "digits", "partition": {"name": "dirichlet", "alpha": 0.1}},
        "model": {"name": "mlp_mpfedcl"},
    }
    clients = [accuracy - 0.2, accuracy, accuracy + 0.2, None]  # a client without test data: None
    curve = [accuracy / 2, 0.8 * accuracy, accuracy]  # rounds 1..3
    metrics = [{"round": r + 1, "accuracy": a} for r, a in enumerate(curve)]
    metrics[-1]["accuracy_clients"] = clients
    summary = {
        "final": {"accuracy": accuracy, "accuracy_std": 0.1, "loss": LOSS[method] + seed / 100,
                  "accuracy_clients": clients},
        "rounds": 3,
        "wall_seconds": 10.0 + seed,
        "bytes_up": 2**20 * (seed + 1),
    }  # fmt: skip
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for method, accs in ACCURACY.items():
        for seed, acc in enumerate(accs):
            write_run(root, method, seed, acc)
    return root


def report(results: Path, tmp_path: Path, **kw: Any) -> str:
    return make_report(ReportRequest([results], plot=tmp_path / "r.png", **kw)).text


def markdown_rows(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {
        cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    }


def latex_rows(text: str) -> dict[str, list[str]]:
    body = text.split(r"\midrule")[1].split(r"\bottomrule")[0]
    rows = {}
    for line in body.strip().splitlines():
        cells = [c.strip() for c in line.removesuffix(r"\\").split(" & ")]
        rows[cells[0]] = cells
    return rows


def plain(latex_cell: str) -> str:
    """A LaTeX cell's text as the Markdown table shows it."""
    text = re.sub(r"\\textbf\{(.*)\}", r"\1", latex_cell.replace(r"$^\dagger$", ""))
    return text.replace(" $\\pm$ ", " ± ").replace(r"\%", "%").replace(r"\_", "_")


def test_latex_holds_the_markdown_tables_numbers(results: Path, tmp_path: Path) -> None:
    kw: dict[str, Any] = {"metrics": "accuracy,loss,bytes_up,accuracy_worst10,accuracy_gini", "target": 0.5}
    md = markdown_rows(report(results, tmp_path, **kw))
    tex_text = report(results, tmp_path, format="latex", **kw)
    tex = latex_rows(tex_text)
    assert md.keys() == tex.keys() == set(ACCURACY)
    for method, cells in md.items():
        # markdown: algorithm, data, model, seeds, rounds, metrics; latex: the same without rounds
        assert [plain(c) for c in tex[method][4:]] == cells[5:]
    assert md["A"][5] == "60.00 ± 10.00"  # mean and sample std over the three seeds, in percent
    # rounds to 50% (curves acc/2, 0.8 acc, acc): seeds of A reach it in rounds 3, 3 and 2 (0.8 · 0.7 ≥ 0.5)
    assert md["A"][10] == "2.7 ± 0.6"
    assert tex_text.count(r"\toprule") == tex_text.count(r"\bottomrule") == 1
    assert tex_text.count("{") == tex_text.count("}")
    header = tex_text.split(r"\toprule")[1].split(r"\midrule")[0]
    assert all(len(row) == header.count(" & ") + 1 for row in tex.values())


def test_latex_bolds_each_columns_best_and_marks_paired_differences(results: Path, tmp_path: Path) -> None:
    tex = latex_rows(report(results, tmp_path, format="latex", metrics="accuracy,loss", paired="A"))
    accuracy, loss = 4, 5
    assert tex["B"][accuracy].startswith(r"\textbf{")  # highest mean accuracy
    assert tex["B"][loss].startswith(r"\textbf{")  # lowest loss
    assert not tex["A"][accuracy].startswith(r"\textbf{")
    assert tex["B"][accuracy].endswith(r"$^\dagger$")  # +5, +6, +4 pp: the interval excludes 0
    assert not tex["C"][accuracy].endswith(r"$^\dagger$")  # +10, -10, 0 pp: it does not
    assert not tex["B"][loss].endswith(r"$^\dagger$")  # the mark belongs to the paired metric only


def test_csv_holds_the_raw_means_and_stds(results: Path, tmp_path: Path) -> None:
    rows = list(csv.DictReader(io.StringIO(report(results, tmp_path, format="csv", metrics="accuracy,loss"))))
    by_method = {r["algorithm"]: r for r in rows}
    assert float(by_method["A"]["accuracy_mean"]) == pytest.approx(0.6)
    assert float(by_method["A"]["accuracy_std"]) == pytest.approx(0.1)
    assert float(by_method["C"]["loss_mean"]) == pytest.approx(1.21)
    assert by_method["B"]["seeds"] == "3" and by_method["B"]["accuracy_n"] == "3"


def test_the_default_markdown_table_is_unchanged(results: Path) -> None:
    table = markdown_table(group_runs(find_runs([results])))
    assert table.splitlines()[0] == (
        "| algorithm | data | model | seeds | rounds | final accuracy (%) | std over clients (%) | loss "
        "| MB up | s/run |"
    )
    assert (
        "| A | digits dirichlet(alpha=0.1) | mlp_mpfedcl | 3 | 3 | 60.00 ± 10.00 | 10.00 | 1.0100 | 2.00 "
        "| 11.0 |" in table
    )


def test_fairness_columns_come_from_the_per_client_accuracies(results: Path, tmp_path: Path) -> None:
    md = markdown_rows(report(results, tmp_path, metrics="accuracy_worst10,accuracy_gini"))
    # clients of seed k: acc − 0.2, acc, acc + 0.2 (the fourth has no test data); worst 10% = the lowest one
    assert md["A"][5] == "40.00 ± 10.00"
    # Gini: Σ|a_i − a_j| over ordered pairs = 2 · (0.2 + 0.4 + 0.2) = 1.6, over 2 n² mean = 18 · acc
    ginis = np.array([1.6 / (18 * acc) for acc in ACCURACY["A"]])
    assert md["A"][6] == f"{ginis.mean():.3f} ± {ginis.std(ddof=1):.3f}"


def test_a_target_never_reached_counts_the_runs_that_did(results: Path, tmp_path: Path) -> None:
    md = markdown_rows(report(results, tmp_path, metrics="accuracy", target=0.7))
    assert md["A"][6] == "3.0 (1/3)"  # only seed 2 (final 0.70) gets there, in round 3
    assert md["C"][6] == "3.0 (1/3)"


def test_the_html_page_is_self_contained(results: Path, tmp_path: Path) -> None:
    page = tmp_path / "out" / "report.html"
    out = make_report(ReportRequest([results], plot=tmp_path / "r.png", paired="A", html=page))
    assert page in out.files and (tmp_path / "r_clients.png") in out.files
    text = page.read_text()
    assert text.count("<table>") == 3  # the results, the paired differences and the provenance
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == 2 and all(base64.b64decode(i).startswith(b"\x89PNG") for i in images)
    inline = re.sub(r"base64,[^\"]+", "", text)  # the images' base64 may hold any 4 letters
    assert "http" not in inline.replace("<!DOCTYPE html>", "")  # nothing to fetch


@pytest.mark.slow
def test_bad_report_options_are_one_line_and_exit_2(results: Path, tmp_path: Path) -> None:
    for args, message in (
        (["--format", "xml"], "--format 'xml': unknown; allowed: markdown, latex, csv"),
        (["--metrics", "acc"], "--metrics 'acc': no run has it; available: accuracy,"),
        (["--target", "-1"], "--target -1.0: expected a positive accuracy"),
    ):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "fedskew.cli",
                "report",
                str(results),
                "--plot",
                str(tmp_path / "p.png"),
                *args,
            ],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2, res.stderr
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.png").exists()  # refused before anything was written


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no LaTeX engine installed (pdflatex)")
def test_the_latex_table_compiles(results: Path, tmp_path: Path) -> None:
    table = render_latex(build_table(group_runs(find_runs([results])), columns_for("accuracy,loss", 0.5)))
    doc = tmp_path / "t.tex"
    doc.write_text(
        "\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n" + table + "\\end{document}\n"
    )
    done = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    assert (tmp_path / "t.pdf").stat().st_size > 0
