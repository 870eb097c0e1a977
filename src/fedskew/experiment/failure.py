"""When a run that finished counts as failed (issue 54, item 2: "a run that failed says it succeeded").

A run whose clients all diverge (``client.lr=1e3``) has every upload rejected as non-finite in every round:
the server never moves, and the run used to end with exit code 0 at chance accuracy. Now the summary
counts the rounds that accepted no upload (``rounds_without_update``; which ones: ``skipped_rounds``) and
the evaluated rounds whose loss or accuracy is non-finite (``nonfinite_rounds``), and says ``status``:
``failed`` (with ``failure``, one line) when

* more than ``engine.max_skipped_share`` of the rounds accepted no upload (exactly the share passes), or
* the final round's loss or accuracy is non-finite.

The results files are written all the same (nothing is lost); ``fedskew run`` then exits with code 1 and
one line, ``fedskew sweep`` counts the run among the failed ones, and reports flag it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedskew.errors import RunFailure

#: ``summary.json["status"]`` of a run that finished its rounds and of one that counts as failed
FINISHED, FAILED = "finished", "failed"
#: the evaluated metrics whose non-finite value marks a round (and, in the final round, the run)
WATCHED = ("loss", "accuracy")


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def nonfinite_rounds(history: list[dict[str, Any]]) -> list[int]:
    """The evaluated rounds whose loss or accuracy is NaN or infinite."""
    return [int(r["round"]) for r in history if any(_nonfinite(r.get(k)) for k in WATCHED)]


def assess(
    rounds: int, skipped: list[int], history: list[dict[str, Any]], max_skipped_share: float
) -> dict[str, Any]:
    """The summary's health entries of a run of ``rounds`` rounds done, ``skipped`` of which accepted no
    upload, with the metrics records ``history``."""
    bad = nonfinite_rounds(history)
    last = history[-1] if history else {}
    reasons = []
    if rounds and len(skipped) > max_skipped_share * rounds:
        reasons.append(
            f"{len(skipped)} of {rounds} rounds accepted no upload (more than "
            f"engine.max_skipped_share={max_skipped_share:g} of them)"
        )
    for key in WATCHED:
        if _nonfinite(last.get(key)):
            reasons.append(f"the final {key} is non-finite ({last[key]})")
    health: dict[str, Any] = {
        "status": FAILED if reasons else FINISHED,
        "rounds_without_update": len(skipped),
        "nonfinite_rounds": bad,
    }
    if reasons:
        health["failure"] = "; ".join(reasons)
    return health


def failed(summary: dict[str, Any]) -> bool:
    return summary.get("status") == FAILED


def check_finished(summary: dict[str, Any], out: Path | str | None) -> None:
    """Raise the one-line :class:`RunFailure` of a summary that says failed (the CLI: exit code 1)."""
    if failed(summary):
        where = f"; see {Path(out) / 'summary.json'}" if out is not None else ""
        raise RunFailure(f"run failed: {summary.get('failure', 'see its summary')}{where}")


def final_line(summary: dict[str, Any], out: Path | str | None) -> str:
    """``fedskew run``'s closing line: the final accuracy, with its spread over clients only where there
    is one (the personalized protocol; under the global protocol one model is scored on one test set), the
    rounds, the time and the folder."""
    final = summary.get("final", {})
    acc, spread = final.get("accuracy"), final.get("accuracy_std")
    text = "final accuracy " + ("n/a (non-finite)" if acc is None else f"{100 * acc:.2f}%")
    if summary.get("protocol") == "personalized" and spread is not None:
        text += f" (± {100 * spread:.2f} std over clients)"
    text += f" after {summary.get('rounds')} rounds in {summary.get('wall_seconds', 0.0):.1f} s"
    return text + (f" -> {out}" if out is not None else "")


def recorded_failure(folder: Path) -> str | None:
    """The ``failure`` of the ``summary.json`` in ``folder`` when it says failed (a sweep rerun counts a
    finished-but-failed run as failed again), else ``None``."""
    import json

    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or not failed(summary):
        return None
    return f"run failed: {summary.get('failure', 'see its summary')}"
