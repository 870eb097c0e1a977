"""What ``--resume`` accepts: the saved config unchanged, or only ``rounds`` changed, which extends (or
shortens, down to the rounds done) the run *exactly*: the same ``metrics.jsonl`` as a run of that many rounds
from the start.

Why that holds: the sampling stream is drawn by one generator row after row, so the first rows of a longer
stream are the rows of a shorter one; per-client randomness comes from ``(seed, round, client)``; and
evaluation changes no state. Two things depend on the total, and are handled here:

* the last round is always evaluated (``eval.every``): a finished run's record of its last round is dropped
  from the history when that round is off the new run's evaluation grid (a run of N rounds has none);
* the settings in :data:`ROUNDS_DEPENDENT` shape every round by the total (a cosine learning rate, DP noise
  calibrated to the run, CCVR's last-round calibration): extension is refused with one line naming why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedskew.algorithms.base import ALGORITHMS
from fedskew.errors import FedskewError
from fedskew.experiment.config import Config, results_config
from fedskew.experiment.config_diff import describe_diff, flat_diff

__all__ = ["ROUNDS_DEPENDENT", "check_resume_config", "extended_checkpoint"]


def _lr_schedule(cfg: Config) -> str | None:
    shape = cfg.client.lr_schedule
    return None if shape == "constant" else f"client.lr_schedule={shape} shapes every round's lr by the total"


def _privacy(cfg: Config) -> str | None:
    mech = cfg.privacy.mechanism
    return None if mech == "none" else f"privacy.mechanism={mech} calibrates noise and ε to the total rounds"


def _final_calibration(cfg: Config) -> str | None:
    params = ALGORITHMS.get(cfg.algorithm.name).Params(**cfg.algorithm.hyper())
    if getattr(params, "calibrate", None) == "final":
        return f"{cfg.algorithm.name} with calibrate=final changes the model in the last round only"
    return None


#: settings under which a run's rounds depend on its total: each gives why (``None``: not in use)
ROUNDS_DEPENDENT: dict[str, Callable[[Config], str | None]] = {
    "client.lr_schedule": _lr_schedule,
    "privacy": _privacy,
    "algorithm.calibrate": _final_calibration,
}


def check_resume_config(saved: Mapping[str, Any], cfg: Config, where: Path) -> bool:
    """Refuse a resume whose config differs from the ``saved`` one in anything but ``rounds``, naming every
    changed key with its saved and new value; ``True`` when ``rounds`` changed (an extension)."""
    diff = flat_diff(results_config(dict(saved)), results_config(cfg.to_dict()))
    rounds = diff.pop("rounds", None)
    if diff:
        raise FedskewError(
            f"--resume: the config differs from the one saved in '{where}' ({describe_diff(diff)}); only "
            "rounds may change on resume: rerun with the saved values, or start over with --force or "
            "another --out"
        )
    return rounds is not None


def extended_checkpoint(ckpt: dict[str, Any] | None, cfg: Config, where: Path) -> dict[str, Any] | None:
    """The checkpoint to continue from when ``rounds`` changed to ``cfg.rounds``: refused (one line) when
    fewer rounds than done are asked for or a :data:`ROUNDS_DEPENDENT` setting is on; the history keeps
    only the records a run of ``cfg.rounds`` rounds makes."""
    if ckpt is None:  # nothing committed yet: the run simply starts with the new total
        return None
    done = int(ckpt["round"])
    if cfg.rounds < done:
        raise FedskewError(
            f"--resume: rounds={cfg.rounds} is fewer than the {done} rounds done in '{where}'; allowed: "
            f"rounds >= {done}"
        )
    reasons = [why for check in ROUNDS_DEPENDENT.values() if (why := check(cfg)) is not None]
    if reasons:
        raise FedskewError(
            f"--resume: rounds cannot change exactly here: {reasons[0]}; rerun with rounds={cfg.rounds} "
            "from the start (--force or another --out)"
        )
    every = cfg.eval.every
    history = [r for r in ckpt["history"] if int(r["round"]) % every == 0 or int(r["round"]) == cfg.rounds]
    return {**ckpt, "history": history}
