"""A researcher's first hour, scripted (issue 54): the *installed* ``fedskew`` command driven as a subprocess
in an empty folder, the way the README's Quickstart drives it, asserting what a new user would check by eye.

One test walks the hour in order (each step builds on the files of the ones before, as a user's session
does); the failures of each capability in isolation are pinned by their own tests (test_failure_loud,
test_provenance, test_report_honest, test_config_marks, test_overrides, test_sweep_check, test_console,
test_resume_extend, test_empty_clients, test_cli_project, test_threads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

#: the console script pip installed beside this interpreter (not ``python -m``: the entry point is tested)
FEDSKEW = Path(sys.executable).parent / "fedskew"


def fedskew(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # a user's shell: no OMP_NUM_THREADS (conftest pins it for the suite), so the thread policy decides
    env = {k: v for k, v in os.environ.items() if k not in ("FEDSKEW_COMMAND", "OMP_NUM_THREADS")}
    env["COLUMNS"] = "60"  # a narrow terminal: nothing may be cut
    return subprocess.run(
        [str(FEDSKEW), *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300
    )


def ok(res: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert res.returncode == 0, res.stderr
    return res


def one_error_line(res: subprocess.CompletedProcess[str], code: int) -> str:
    """The failure a user sees: exit ``code`` and one line ``error: ...`` on stderr, the last one (logged
    warnings about the rounds may precede it)."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert res.returncode == code, res.stderr
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr
    assert all(line.startswith(("error: ", "WARNING ")) for line in lines), res.stderr
    return errors[0]


def metrics(run: Path) -> list[dict]:
    return [  # every field but the timings
        {k: v for k, v in json.loads(line).items() if not k.startswith("seconds")}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


@pytest.mark.slow
def test_a_first_hour_on_a_fresh_folder(tmp_path: Path) -> None:
    home = tmp_path
    # 13: the version, then a starter config and a method skeleton in the user's folder
    assert ok(fedskew("--version", cwd=home)).stdout.strip() == f"fedskew {version('fedskew')}"
    ok(fedskew("init", cwd=home))
    starter = (home / "fedskew.yaml").read_text()
    assert (home / "my_method.py").is_file()
    assert "force" in one_error_line(fedskew("init", cwd=home), 2)  # never overwrites
    assert (home / "fedskew.yaml").read_text() == starter

    # 5: a schema error names the file, line and column of the offending key
    bad = starter.replace("lr: 0.05", "lr: fast")
    (home / "bad.yaml").write_text(bad)
    line_no = next(i for i, line in enumerate(bad.splitlines(), 1) if "lr: fast" in line)
    err = one_error_line(fedskew("run", "bad.yaml", "--out", "runs/x", cwd=home), 2)
    assert f"bad.yaml:{line_no}:" in err and "client.lr" in err
    assert not (home / "runs" / "x").exists()

    # 1, 3, 4: the starter runs as is (2 rounds), every file under --out, provenance in the summary
    ok(fedskew("run", "fedskew.yaml", "--rounds", "2", "--threads", "1", "--out", "runs/first", cwd=home))
    assert sorted(p.name for p in home.iterdir()) == ["bad.yaml", "fedskew.yaml", "my_method.py", "runs"]
    summary = json.loads((home / "runs/first/summary.json").read_text())
    assert summary["status"] == "finished"
    prov = summary["provenance"]
    assert "--threads 1" in prov["command"] and prov["machine"]["threads"] == 1
    assert prov["versions"]["torch"] == version("torch") and prov["fedskew"]["version"] == version("fedskew")
    assert prov["config_changes"]["rounds"] == 2

    # 8: resume names what changed, with old and new values; --rounds extends exactly
    err = one_error_line(
        fedskew("run", "fedskew.yaml", "--out", "runs/first", "--resume", "--set", "client.lr=0.1", cwd=home),
        2,
    )
    assert "client.lr" in err and "0.05" in err and "0.1" in err
    ok(fedskew("run", "fedskew.yaml", "--out", "runs/first", "--resume", "--rounds", "3", cwd=home))
    # the first run's --threads 1 is kept by the resume (auto); the reference pins the same count
    ok(fedskew("run", "fedskew.yaml", "--rounds", "3", "--threads", "1", "--out", "runs/three", cwd=home))
    assert metrics(home / "runs/first") == metrics(home / "runs/three")

    # 7: switching a named section drops the old variant's keys, with a note, instead of refusing
    res = ok(
        fedskew(
            "run",
            "fedskew.yaml",
            "--rounds",
            "1",
            "--set",
            "data.partition.name=iid",
            "--out",
            "runs/[iid]",
            cwd=home,
        )
    )
    assert "alpha" in res.stderr
    assert "runs/[iid]" in res.stdout  # 6: brackets in user text are printed, not read as markup

    # 2: a run in which every upload is rejected fails loudly, its files kept
    err = one_error_line(
        fedskew(
            "run", "fedskew.yaml", "--rounds", "4", "--set", "client.lr=1e3", "--out", "runs/bad", cwd=home
        ),
        1,
    )
    assert "run failed" in err and "accepted no upload" in err
    assert json.loads((home / "runs/bad/summary.json").read_text())["status"] == "failed"

    # 10: partitioning that leaves clients empty says so once, with the count and the setting
    res = ok(
        fedskew(
            "data",
            "show",
            "fedskew.yaml",
            "--set",
            "data.num_clients=60",
            "--set",
            "data.partition.alpha=0.01",
            "--set",
            "data.partition.min_size=0",
            cwd=home,
        )
    )
    warning = [line for line in (res.stdout + res.stderr).splitlines() if "of 60 clients" in line]
    assert len(warning) == 1 and "alpha" in warning[0], res.stderr
    assert (home / "runs/fedskew-partition.png").is_file()  # 4: not in the working folder

    # 9, 4, 3: the report: the spread's unit, the failed run flagged, labels, figures under --out
    res = ok(fedskew("report", "runs/first", "runs/[iid]", "runs/bad", "--out", "runs/report", cwd=home))
    assert "over clients" not in res.stdout  # global protocol: no per-client spread
    assert "failed" in res.stdout
    assert "iid" in res.stdout and "dirichlet" in res.stdout  # the key that differs is in the labels
    assert "client.lr=1000" in res.stdout.replace("1e3", "1000").replace("1000.0", "1000")
    assert (home / "runs/report/report.png").stat().st_size > 1000
    assert any(p.name.endswith("provenance.json") for p in (home / "runs/report").iterdir())
    assert sorted(p.name for p in home.iterdir()) == ["bad.yaml", "fedskew.yaml", "my_method.py", "runs"]

    # 12: a sweep with a bad config starts nothing; a grid point a method cannot take is skipped
    err = one_error_line(fedskew("sweep", "fedskew.yaml", "bad.yaml", "--out", "runs/sweep", cwd=home), 2)
    assert err.startswith("error: sweep: ") and "client.lr" in err
    assert not any((home / "runs/sweep").rglob("config.yaml"))
    res = ok(
        fedskew(
            "sweep",
            "fedskew.yaml",
            "--grid",
            "algorithm.name=fedavg,fedprox",
            "--grid",
            "algorithm.mu=0.01",
            "--out",
            "runs/sweep",
            "--dry-run",
            cwd=home,
        )
    )
    skipped = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("skipped")]
    assert len(skipped) == 1 and "fedavg" in skipped[0], res.stderr
    assert "1 runs" in res.stdout

    # 13: the runs in a folder with their state and headline metric
    entries = json.loads(ok(fedskew("runs", "runs", "--json", cwd=home)).stdout)
    listed = {Path(r["folder"]).name: r for r in entries}
    assert listed["first"]["state"] == "finished" and listed["first"]["rounds_done"] == 3
    assert listed["bad"]["state"] == "failed"

    # 6: `list` in a narrow terminal cuts nothing; --plain is one line per registered object
    plain = ok(fedskew("list", "--plain", cwd=home)).stdout.splitlines()
    assert all(len(line.split("\t")) == 3 for line in plain)
    assert "…" not in ok(fedskew("list", cwd=home)).stdout
