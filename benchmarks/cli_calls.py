"""The CLI's ``main`` called in this process, as the fault campaign (faults.py) and the config fuzzer
(fuzz_config.py) both call it: kept apart so that neither imports the other for it (faults.py runs the fuzzer
as part of its campaign, so fuzz_config.py importing faults.py back made an import circle)."""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any


def cli_exit_code(argv: list[str]) -> Any:
    """Run the CLI's ``main`` on ``argv``; its exit code (an escaped exception prints its traceback)."""
    from fedskew import cli

    sys.argv = ["fedskew", *argv]
    try:
        cli.main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return "exception"


def run_cli(*argv: str) -> tuple[Any, str]:
    """``fedskew <argv>`` through the CLI's ``main`` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_exit_code(list(argv))
    return code, err.getvalue()


def one_line(err: str) -> bool:
    """``err`` is one line (warnings aside) and no traceback."""
    lines = [x for x in err.splitlines() if not x.startswith("WARNING ")]
    return len(lines) == 1 and "Traceback" not in err
