"""``fedskew`` command line: run, flower-app, sweep, list, report, demo, data show, features,
cachefl-search, cachefl-posthoc, init, runs, tune (and ``--version``, shell completion).

Bad input exits with code 2 and one line naming the problem and the allowed values.
"""

from __future__ import annotations

import sys

import typer

# each module registers its commands (help lists them in import order)
from fedskew.cli import inspect, project, run, sweep, tools, tune  # noqa: F401
from fedskew.cli.common import app, configure_logging, one_line
from fedskew.errors import FedskewError, RunFailure

__all__ = ["app", "main"]


def main() -> None:
    configure_logging()
    from fedskew.experiment.provenance import record_command

    record_command(sys.argv)  # summary.json's provenance, also in the processes a run starts
    try:
        # Outside standalone mode typer *returns* the exit code of an Exit, and Ctrl-C becomes Exit(130)
        code = app(standalone_mode=False)
        if code == 130:
            raise KeyboardInterrupt
        if isinstance(code, int) and code:
            sys.exit(code)
    except FedskewError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)  # one unwrapped line
        sys.exit(2)
    except RunFailure as err:  # a fault, not bad input: the committed rounds are kept for --resume
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted: progress kept in the checkpoint; continue with --resume", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as err:  # click usage errors
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            sys.exit(2)
        if isinstance(err, click.exceptions.Abort):
            sys.exit(130)
        raise
