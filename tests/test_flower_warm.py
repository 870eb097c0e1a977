"""The warm ClientApp launcher (fedskew.flower.warm): the ``flwr-clientapp`` shim hands its arguments and
standard streams to the zygote, whose forked child runs Flower's own ``flwr-clientapp`` entry point and
sends its exit code back; without a zygote the shim runs the real command. (On a real deployment, every
LocalDeployment test of tests/test_flower_deployment.py runs its ClientApps through it.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedskew.flower.warm import COMMAND, SOCKET_ENV, write_shim

REAL = str(Path(sys.executable).parent / COMMAND)


def _shim(shim: Path, socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **{SOCKET_ENV: str(socket)})
    return subprocess.run(
        [str(shim), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_shim_runs_flowers_entry_point_in_a_forked_child_and_returns_its_exit_code(tmp_path):
    sock, folder = tmp_path / "warm.sock", tmp_path / "bin"
    zygote = subprocess.Popen([sys.executable, "-m", "fedskew.flower.warm", str(sock), str(folder)])
    try:
        end = time.monotonic() + 120
        while not sock.exists():
            assert zygote.poll() is None and time.monotonic() < end, "the zygote did not start"
            time.sleep(0.05)
        shim = folder / COMMAND
        helped = _shim(shim, sock, "--help")  # argparse's help, printed on the shim's stdout, exit 0
        assert helped.returncode == 0 and "Run a Flower ClientApp" in helped.stdout
        wrong = _shim(shim, sock, "--no-such-flag")  # argparse's error on the shim's stderr, exit 2
        assert wrong.returncode == 2 and "flwr-clientapp: error: one of the arguments --token" in wrong.stderr
        assert zygote.poll() is None  # the zygote serves on
    finally:
        zygote.kill()
        zygote.wait()


def test_without_a_zygote_the_shim_runs_the_real_command(tmp_path):
    shim = write_shim(tmp_path / "bin", REAL)
    done = _shim(shim, tmp_path / "nothing.sock", "--help")
    assert done.returncode == 0 and "Run a Flower ClientApp" in done.stdout
