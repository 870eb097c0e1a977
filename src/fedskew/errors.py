"""User-facing errors: one line that names the problem and the allowed values.

The CLI turns any :class:`FedskewError` into that line on stderr and exit code 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FedskewError(ValueError):
    """Bad input (config, data, request) that the user can fix."""


class ConfigError(FedskewError):
    """An invalid configuration value or key; ``key``: the dotted config key it is about, when the raiser
    knows it (a config file's error then names that key's line: ``experiment/config_marks.py``)."""

    def __init__(self, message: str = "", key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(FedskewError):
    """Missing, corrupted or unusable data files, or an infeasible partition."""


class RunFailure(RuntimeError):
    """A run stopped by a fault outside the config (a client failed under ``engine.on_client_error``, a
    worker process died twice, the disk is full): one line; the committed rounds are kept for ``--resume``."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` when a close match exists, else ``""``."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
