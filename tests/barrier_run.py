"""A barrier in a run's hooks, so that a test kills or interrupts a run at a known round instead of hoping
that a signal lands inside a window of wall-clock time (which a loaded machine shifts).

With ``FEDSKEW_TEST_BARRIER`` (see :func:`barrier_env`) in a process's environment when this module is
imported, a call of round ``round`` (for the clients ``cids``, default any) to the hook ``hook`` of any
algorithm creates ``FOLDER/<pid>`` and blocks until the process is killed or interrupted: a Ctrl-C raises
KeyboardInterrupt out of the wait as it would out of training. Hooks that take the round info last serve:
``broadcast`` (a round's first hook, where clients train: the run or its engine workers), ``start_local``
(the first on a Flower node) or ``aggregate`` (the server, once the round's clients trained). With ``once``
only the first process to arrive blocks. Earlier rounds are committed by then, their metrics and checkpoint
written. The barrier wraps the algorithms through the public ``ALGORITHMS.replaced``: forked engine workers
inherit it, the spawned workers of a sweep get it because ``multiprocessing`` imports the parent's main
module in them, and a Flower app made by :func:`barrier_app` installs it in its ServerApp and ClientApp
processes. ``src/`` has no test-only path: a resumed run is the plain command.

With ``release`` a process at the barrier goes on once ``FOLDER/release`` exists (:func:`release`): a test
holds a run at a round until an event it waits for has happened. :func:`barrier_app` takes several barriers
(one :func:`barrier_spec` each), e.g. a node held in round 2 and the server held in round 3.

``python -m tests.barrier_run ARGS`` (from the repository root) is ``fedskew ARGS`` with the barrier.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENV = "FEDSKEW_TEST_BARRIER"
ROOT = Path(__file__).resolve().parents[1]
#: seconds a test waits for a run to reach its barrier or to exit: only a hung run takes this long
DEADLINE = 600.0


def barrier_spec(
    round_: int,
    folder: Path,
    *,
    hook: str = "broadcast",
    cids: list[int] | None = None,
    once: bool = False,
    release: bool = False,
) -> dict[str, Any]:
    """A barrier at ``hook`` of round ``round_``, events in ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "round": round_,
        "folder": str(folder),
        "hook": hook,
        "cids": cids,
        "once": once,
        "release": release,
    }


def barrier_env(
    round_: int, folder: Path, env: dict[str, str] | None = None, **options: Any
) -> dict[str, str]:
    """``env`` (default: this process's) with a barrier at ``hook`` of round ``round_``, events in
    ``folder``."""
    return {**(os.environ if env is None else env), ENV: json.dumps(barrier_spec(round_, folder, **options))}


def release(folder: Path) -> None:
    """Let the processes held at a ``release`` barrier whose events go to ``folder`` go on."""
    (folder / "release").touch()


def arrived(folder: Path) -> list[int]:
    """The pids of the processes at the barrier whose events go to ``folder``."""
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()]


def wait_for_barrier(folder: Path, proc: subprocess.Popen[Any] | None = None, count: int = 1) -> list[int]:
    """The pids of the processes at the barrier once ``count`` arrived; fails if ``proc`` exits first (with
    its stderr, when piped) or nothing arrives within :data:`DEADLINE` (a hang)."""
    end = time.monotonic() + DEADLINE
    while len(pids := arrived(folder)) < count:
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the run exited ({proc.returncode}) before its barrier: {err}")
        assert time.monotonic() < end, f"no barrier reached within {DEADLINE} s"
        time.sleep(0.05)
    return pids


def barrier_app(target: Path, *specs: dict[str, Any]) -> Path:
    """A Flower app in ``target``: fedskew's ServerApp and ClientApp with the barriers ``specs``
    (:func:`barrier_spec`) installed in their processes (Flower starts them with the SuperLink's /
    SuperNode's environment, so the specs are written into the app). Submit it in place of
    ``fedskew.flower.deploy.APP_DIR``."""
    from fedskew.flower.deploy import APP_DIR

    target.mkdir(parents=True)
    pyproject = (APP_DIR / "pyproject.toml").read_text()
    pyproject = pyproject.replace('name = "fedskew-flower"', 'name = "fedskew-barrier"')
    pyproject = pyproject.replace("fedskew.flower.apps:", "fedskew_barrier_app:")
    (target / "pyproject.toml").write_text(pyproject)
    spec = json.dumps(list(specs))
    (target / "fedskew_barrier_app.py").write_text(
        "import os\nimport sys\n\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"os.environ[{ENV!r}] = {spec!r}\n"
        "import tests.barrier_run  # noqa: E402  (installs the barrier)\n"
        "from fedskew.flower import apps  # noqa: E402\n\n"
        "server_app = apps.server_app\nclient_app = apps.client_app\n"
    )
    return target


def _install(specs: dict[str, Any] | list[dict[str, Any]]) -> contextlib.ExitStack:
    from fedskew.algorithms import ALGORITHMS

    stack = contextlib.ExitStack()
    for spec in specs if isinstance(specs, list) else [specs]:
        for name in ALGORITHMS.names():
            stack.enter_context(ALGORITHMS.replaced(name, _held(ALGORITHMS.get(name), spec)))
    return stack


def _held(cls: type, spec: dict[str, Any]) -> type:
    """``cls`` with its hook ``spec["hook"]`` held at the barrier ``spec``."""
    folder, hook, cids = Path(spec["folder"]), spec["hook"], spec["cids"]
    if hook == "aggregate" and cls.mean_aggregation:  # the engine computes a mean method's mean itself
        hook = "server_step"  # (aggregate may never run): hold its server step, which every round runs
    released = folder / "release"

    def due(info: Any) -> bool:
        if info.round != spec["round"] or (cids is not None and info.cid not in cids):
            return False
        if spec["once"]:
            try:
                os.close(os.open(folder / "once", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return False
        return True

    def wrapped(self: Any, *args: Any) -> Any:
        # server hooks end with their RoundInfo (broadcast, aggregate) or MeanInfo (server_step); client hooks
        # take a LocalStep first
        if hook == "server_step":
            info = args[-1].round
        else:
            info = args[-1] if hook in ("broadcast", "aggregate") else args[0].info
        if due(info):
            (folder / str(os.getpid())).touch()
            # short sleeps: a signal that arrives before the wait is still acted on
            while not (spec.get("release") and released.exists()):
                time.sleep(0.1)
        return getattr(super(held, self), hook)(*args)  # the class itself, not type(self): barriers nest

    held = type(cls.__name__, (cls,), {hook: wrapped})
    return held


#: the installed barrier, kept for the life of the process
INSTALLED = _install(json.loads(os.environ[ENV])) if os.environ.get(ENV) else None

if __name__ == "__main__":
    from fedskew.cli import main

    sys.argv = ["fedskew", *sys.argv[1:]]
    main()
