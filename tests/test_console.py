"""The console hides nothing: messages holding brackets are printed as written (rich markup would take
``[tracking]`` for a style tag), ``fedskew list`` wraps instead of cutting, and ``--plain`` / ``--json`` give
it whole to scripts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.cells import cell_len
from rich.progress import Progress
from typer.testing import CliRunner

from fedskew.cli import app
from fedskew.cli.common import console, registries, run_with_progress
from fedskew.cli.sweep import SweepDisplay
from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config
from fedskew.experiment.sweep import RunState
from tests.conftest import digits_config

#: check_trackers' hint, whose "[tracking]" rich took for a style tag
HINT = "log.mlflow: the 'mlflow' package is not installed; install it (pip install 'fedskew[tracking]')"


def squash(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def narrow():
    """The shared console at 50 columns (a small terminal), restored after."""
    before = console.width
    console.width = 50
    yield
    console.width = before


def test_the_console_prints_brackets_as_written():
    with console.capture() as cap:
        console.print(HINT)
        console.print("[red]not a style[/] and [bold]")
    assert cap.get() == HINT + "\n[red]not a style[/] and [bold]\n"


def test_a_failed_sweep_run_keeps_the_brackets_of_its_folder_and_error():
    run = SimpleNamespace(folder=Path("out/grid[a=1]/seed0"), state=RunState.NEW, rounds=2)
    with console.capture() as cap, Progress(console=console) as progress:
        SweepDisplay(progress, [run]).run_failed(run, HINT)
    assert f"failed out/grid[a=1]/seed0: {HINT}" in cap.get()


def test_a_progress_label_keeps_its_brackets():
    with console.capture() as cap:
        run_with_progress(build_config(digits_config(rounds=1)), None, False, False, "fed[avg]")
    assert cap.get().startswith("fed[avg] ")


def test_list_wraps_every_name_and_doc_whole_in_a_narrow_terminal(narrow):
    res = CliRunner().invoke(app, ["list"])
    assert res.exit_code == 0, res.output
    assert max(cell_len(line) for line in res.output.splitlines()) <= 50  # cells: θ̂ is one
    text = squash(res.output)
    assert "fedskew[hf]" in text and "[prototypes]" in text  # docs with brackets, as written
    chars = "".join(res.output.split())  # a word longer than the column is folded, never cut
    for reg in registries().values():
        for name, doc in reg.items():
            assert name in text and "".join(doc.split()) in chars, name


def test_list_plain_is_one_whole_line_per_entry(narrow):
    res = CliRunner().invoke(app, ["list", "--plain"])
    lines = res.output.splitlines()
    expected = [f"{kind}\t{name}\t{doc}" for kind, reg in registries().items() for name, doc in reg.items()]
    assert lines == expected


def test_list_json_and_one_kind():
    res = CliRunner().invoke(app, ["list", "--json"])
    data = json.loads(res.output)
    assert data == {kind: dict(reg.items()) for kind, reg in registries().items()}
    one = CliRunner().invoke(app, ["list", "partitions", "--plain"])
    assert one.output and all(line.startswith("partitions\t") for line in one.output.splitlines())


def test_list_of_an_unknown_kind_names_the_allowed_ones():
    res = CliRunner().invoke(app, ["list", "algorithm"])
    assert isinstance(res.exception, FedskewError)
    assert "did you mean 'algorithms'" in str(res.exception)
    assert "allowed: algorithms, executors, models, datasets, partitions, backbones, generators" in str(
        res.exception
    )


def test_log_lines_go_to_the_stderr_of_the_moment(monkeypatch):
    """While a progress bar is live on a terminal, rich swaps ``sys.stderr`` for a proxy that prints above
    the bar; a handler that kept the stream it was made with wrote between the bar's redraws, which erased
    or repeated log lines. The CLI's handler writes to whatever ``sys.stderr`` is when the record comes."""
    import io
    import logging

    from fedskew.cli.common import LiveStderrHandler

    handler = LiveStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("fedskew.test_console")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        first, then = io.StringIO(), io.StringIO()
        monkeypatch.setattr("sys.stderr", first)
        logger.warning("round 1: [rejected]")
        monkeypatch.setattr("sys.stderr", then)  # the live display's proxy
        logger.warning("round 2: [rejected]")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    assert first.getvalue() == "WARNING round 1: [rejected]\n"
    assert then.getvalue() == "WARNING round 2: [rejected]\n"
