"""A warm ClientApp launcher: Flower's ``flwr-clientapp`` processes forked from one process that has already
imported Flower's ClientApp runtime, torch and fedskew.

Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message a SuperNode receives (its SuperExec
runs the command by name), and has no long-lived ClientApp. Each such process spends about 2.9 CPU-seconds
importing ``flwr-clientapp``'s runtime, torch and fedskew before it reads its message. This module keeps
those imports in one process per machine, the *zygote* (:func:`serve`), and puts a small ``flwr-clientapp``
shim first on the SuperNodes' ``PATH`` (:func:`write_shim`). The shim, a Python started without ``site``
(tens of milliseconds), hands its arguments and its standard streams to the zygote over a Unix socket;
the zygote forks, and the child runs Flower's own ``flwr-clientapp`` entry point with those arguments,
connects to the SuperNode and handles the message exactly as the command would; its exit code travels
back to the shim, which exits with it. Nothing of Flower is patched: the child runs Flower's code, and a
shim that finds no zygote runs the real command instead.

The zygote never runs a torch operation before forking (no thread pool to copy) and holds no connection:
each child opens its own. ``engine.runtime=flower-deployment`` starts one zygote per deployment
(:class:`fedskew.flower.deploy.LocalDeployment`, ``warm=True``); on a SuperNode machine of your own,
``python -m fedskew.flower.warm SOCKET SHIM_DIR`` starts it (docs/deployment.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

#: environment variable naming the zygote's socket (read by the shim)
SOCKET_ENV = "FEDSKEW_WARM_SOCKET"
#: the command Flower's SuperExec runs for every ClientApp task
COMMAND = "flwr-clientapp"

_SHIM = """#!{python} -S
# fedskew's warm {command} (fedskew.flower.warm): hands this task to the zygote at ${env}
import json, os, socket, struct, sys
path = os.environ.get("{env}", "")
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
except OSError:  # no zygote: the real command
    os.execv({real!r}, [{real!r}, *sys.argv[1:]])
socket.send_fds(conn, [json.dumps(sys.argv[1:]).encode()], [0, 1, 2])
code = conn.recv(4)
sys.exit(struct.unpack("i", code)[0] if len(code) == 4 else 1)
"""


def write_shim(folder: Path, real: str) -> Path:
    """Write the ``flwr-clientapp`` shim into ``folder`` (put it first on the SuperNodes' ``PATH``); ``real``:
    the command it runs when no zygote answers."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / COMMAND
    shim.write_text(_SHIM.format(python=sys.executable, command=COMMAND, env=SOCKET_ENV, real=real))
    shim.chmod(0o755)
    return shim


def _warm_imports() -> None:
    """What every ClientApp process would import: Flower's ClientApp runtime, torch and fedskew's node."""
    import flwr.supernode.cli.flwr_clientapp  # noqa: F401

    import fedskew.flower.apps
    import fedskew.flower.node  # noqa: F401


def _run_child(listener: socket.socket, conn: socket.socket, args: list[str], fds: list[int]) -> None:
    """In the forked child: the shim's streams as ours, then Flower's ``flwr-clientapp`` entry point; the
    exit code back to the shim. Never returns."""
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp

    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    sys.argv = [COMMAND, *args]
    code = 0
    try:
        flwr_clientapp()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # reported as the command would report it, then the exit code
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            conn.sendall(struct.pack("i", code))
        finally:
            os._exit(code)


def serve(path: Path) -> None:
    """The zygote: import once, then fork one child per shim connecting to ``path`` (runs until killed)."""
    _warm_imports()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel; codes go by socket
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    while True:
        conn, _ = listener.accept()
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            args = [str(a) for a in json.loads(msg.decode())]
        except (OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            _run_child(listener, conn, args, fds)
        for fd in fds:
            os.close(fd)
        conn.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python -m fedskew.flower.warm SOCKET SHIM_DIR (writes SHIM_DIR/{COMMAND})")
    real = str(Path(sys.executable).parent / COMMAND)
    write_shim(Path(sys.argv[2]), real)
    serve(Path(sys.argv[1]))
