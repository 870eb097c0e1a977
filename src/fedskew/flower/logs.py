"""Flower's own log in the run folder, fedskew's progress on the console.

Why: Flower's runtime logs at INFO to the console by default (its ``flwr`` logger carries a console handler
of its own), and its CLI helpers print "Using SuperLink ..." on every status poll: a 3-round deployment
printed it 27 times, burying fedskew's progress. For the length of a run the ``flwr`` logger writes to
``<out>/flower.log`` instead (its console handlers detached, not propagated to the root logger), the
SuperLink's, SuperNodes' and ClientApp processes' output is appended there when a deployment closes
(:meth:`fedskew.flower.deploy.LocalDeployment.close`), and the console gets one line saying where.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the file in a run's folder that holds Flower's own log
FLOWER_LOG = "flower.log"
#: the logger Flower logs through (``flwr.common.logger.LOGGER_NAME``)
FLWR_LOGGER = "flwr"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


@contextmanager
def flower_log(path: Path) -> Iterator[Path]:
    """Within the block the ``flwr`` logger writes (INFO and above) to a temporary file and nowhere else,
    appended to ``path`` at the end (the run folder must not hold a file before the run checks that it is
    new); its handlers, level and propagation are restored afterwards."""
    logger = logging.getLogger(FLWR_LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    with tempfile.TemporaryDirectory(prefix="fedskew-flwr-log-") as scratch:
        handler = logging.FileHandler(Path(scratch) / FLOWER_LOG, encoding="utf-8", delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for h in saved[0]:
            if _is_console(h):
                logger.removeHandler(h)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            yield path
        finally:
            logger.removeHandler(handler)
            handler.close()
            for h in saved[0]:
                if h not in logger.handlers:
                    logger.addHandler(h)
            logger.setLevel(saved[1])
            logger.propagate = saved[2]
            path.parent.mkdir(parents=True, exist_ok=True)
            append_process_logs([("flwr logger", Path(scratch) / FLOWER_LOG)], path)


def append_process_logs(logs: list[tuple[str, Path]], path: Path) -> None:
    """Append each ``(name, log file)`` to ``path`` under a ``==== name ====`` header (missing files are
    skipped): the deployment's process logs outlive its temporary folder."""
    with path.open("a", encoding="utf-8") as out:
        for name, log in logs:
            if log.is_file():
                out.write(f"==== {name} ({log.name}) ====\n")
                out.write(_ANSI.sub("", log.read_text(errors="replace")))  # Flower colours its levels
