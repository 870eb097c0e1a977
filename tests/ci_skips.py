"""Under CI an unexpected skip fails: the pytest hooks tests/conftest.py installs (issue 53, item 8).

``pytest.importorskip("flwr")`` turns a broken Flower install into a green run with the Flower modules
skipped; ``make`` installs every extra the suite imports, so in CI (``CI`` set to true: GitHub Actions,
``.ci/run``) a skip is an error unless its reason starts with one of :data:`ALLOWED_IN_CI`: the skips that
still hold on a CI machine set up by ``make install``. A skip at collection (a module's ``importorskip``)
becomes a collection error, one in a test's setup or body an error of that test; both name the reason.
Outside CI nothing changes: a laptop without an extra skips as before.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

#: skip reasons (prefixes) that may apply in CI -> why they are not a broken environment
ALLOWED_IN_CI = {
    "not run from a git checkout": "a source export (tarball, a CI cache) has no .git",
    "no git": "git is a system tool make does not install",
    "no LaTeX engine installed": "pdflatex is a system tool make does not install",
    "needs diffusers": "the generators extra and a local pipeline folder are not part of make install",
    "a CUDA device is present": "the test checks the error on a machine without one",
    "needs Linux /proc": "the platform, not the environment",
}

#: the words CI services set ``CI`` to
TRUE = {"1", "true", "yes"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in TRUE


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason pytest shows for a skipped report (its ``longrepr`` is ``(path, line, "Skipped: ...")``)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def fail_unexpected_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turn ``report`` into a failure when it is a skip CI does not allow (xfails are not skips here)."""
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    reason = skip_reason(report)
    if reason.startswith(tuple(ALLOWED_IN_CI)):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"unexpected skip under CI=true: {reason!r} (a skip allowed in CI is listed in tests/ci_skips.py)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    fail_unexpected_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    fail_unexpected_skip(report)
    return report
