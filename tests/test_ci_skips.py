"""Under CI an unexpected skip fails (tests/ci_skips.py): a broken Flower import cannot turn the Flower test
modules into a green run. Each case runs a small pytest session in this process (pytester) with the hooks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

#: a Flower test module's first lines (tests/test_flower*.py), and a test that skips from its body
FLOWER_MODULE = """
import pytest
pytest.importorskip("flwr")

def test_flower():
    pass
"""
SKIPS_IN_BODY = """
import pytest

def test_needs_the_privacy_extra():
    pytest.importorskip("dp_accounting")

def test_outside_a_checkout():
    pytest.skip("not run from a git checkout")

@pytest.mark.xfail(reason="a known failure, not a skip")
def test_expected_failure():
    assert False
"""


def session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None) -> pytest.RunResult:
    """Run the two modules above with the CI hooks, ``CI`` set to ``ci`` (None: unset); Flower's and the
    privacy extra's imports broken as a failed install would break them."""
    monkeypatch.setitem(sys.modules, "flwr", None)  # `import flwr` raises ImportError
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(test_flower_like=FLOWER_MODULE, test_body=SKIPS_IN_BODY)
    quiet = ("-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore::pytest.PytestAssertRewriteWarning")
    return pytester.runpytest("-p", "tests.ci_skips", *quiet, "--continue-on-collection-errors", "-rsx")


def test_a_broken_flower_import_fails_the_run_under_ci(pytester, monkeypatch):
    result = session(pytester, monkeypatch, "true")
    assert result.ret != 0
    result.assert_outcomes(errors=1, failed=1, skipped=1, xfailed=1)  # the module, the body's importorskip
    out = result.stdout.str()
    assert "unexpected skip under CI=true: \"could not import 'flwr'" in out
    assert "could not import 'dp_accounting'" in out and "not run from a git checkout" in out


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_the_same_imports_only_skip(pytester, monkeypatch, ci):
    result = session(pytester, monkeypatch, ci)
    assert result.ret == 0
    result.assert_outcomes(skipped=3, xfailed=1)


def test_every_reason_allowed_in_ci_is_one_a_test_still_skips_with():
    """A stale entry in ALLOWED_IN_CI would let a later skip with a similar reason pass CI unnoticed."""
    from tests.ci_skips import ALLOWED_IN_CI

    here = Path(__file__)
    text = "\n".join(p.read_text() for p in here.parent.glob("test_*.py") if p != here)
    stale = [reason for reason in ALLOWED_IN_CI if reason not in text]
    assert not stale, stale
