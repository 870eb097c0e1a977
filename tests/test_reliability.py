"""Failure policies of a run: failing clients (``engine.on_client_error``), skipped rounds, the output-folder
lock, checkpoint retention and damage, a full disk, a dead worker process, and the security basics."""

from __future__ import annotations

import ast
import errno
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmarks.faults import Faulty, faulty_fedavg, strip_record, strip_summary

from fedskew.algorithms.base import ALGORITHMS
from fedskew.errors import ConfigError, FedskewError, RunFailure
from fedskew.experiment import results, runner
from fedskew.experiment.config import Config, build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from tests.conftest import digits_config

SRC = Path(__file__).resolve().parents[1] / "src" / "fedskew"


def _cfg(**engine) -> dict:
    return digits_config(
        rounds=4,
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "iid"}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        checkpoint={"every": 1},
        engine={"mode": "sequential", "workers": 1, **engine},
    )


def _metrics(out: Path) -> list[dict]:
    return [strip_record(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[dict], dict]:
    out = tmp_path_factory.mktemp("ref") / "run"
    run_experiment(build_config(_cfg()), out)
    return _metrics(out), strip_summary(json.loads((out / "summary.json").read_text()))


def _same_as_reference(out: Path, reference) -> bool:
    summary = strip_summary(json.loads((out / "summary.json").read_text()))
    return _metrics(out) == reference[0] and summary == reference[1]


# ---------------------------------------------------------------------------- failing clients
@pytest.mark.parametrize("kind", ["raise", "nan", "inf", "explode"])
def test_drop_policy_drops_the_failing_client_and_commits_the_round(kind):
    cfg = build_config(_cfg(on_client_error="drop"))
    with faulty_fedavg(kind, {0, 1}, round_=1):
        sim = build_simulation(cfg)
        outcome = sim.run_round()
    assert sorted(outcome.rejected) == [0, 1] and outcome.record["rejected"] == 2
    assert sim.round == 1 and "skipped" not in outcome.record
    assert all(torch.isfinite(v).all() for v in sim.server["weights"].values())


@pytest.mark.parametrize("kind", ["raise", "nan"])
def test_fail_policy_fails_the_round_and_commits_nothing(kind):
    cfg = build_config(_cfg(on_client_error="fail"))
    with faulty_fedavg(kind, {2}, round_=2):
        sim = build_simulation(cfg)
        sim.run_round()
        before = {k: v.clone() for k, v in sim.server["weights"].items()}
        with pytest.raises(RunFailure, match=r"round 2: .*client 2 .*not committed"):
            sim.run_round()
    assert sim.round == 1 and len(sim.history) == 1
    assert all(torch.equal(before[k], sim.server["weights"][k]) for k in before)


def test_fail_policy_run_resumes_to_the_uninterrupted_results(tmp_path, reference):
    out = tmp_path / "run"
    with faulty_fedavg("raise", {3}, round_=3), pytest.raises(RunFailure):
        run_experiment(build_config(_cfg(on_client_error="fail")), out)
    assert len(_metrics(out)) == 2
    run_experiment(build_config(_cfg(on_client_error="fail")), out, resume=True)
    assert _same_as_reference(out, reference)


def test_a_round_with_every_client_rejected_is_recorded_as_skipped(tmp_path):
    out = tmp_path / "run"
    with faulty_fedavg("nan", set(range(6)), round_=2):
        summary = run_experiment(build_config(_cfg()), out)
    r1, r2, r3 = json.loads("[" + ",".join((out / "metrics.jsonl").read_text().splitlines()[:3]) + "]")
    assert r2["skipped"] is True and r2["rejected"] == 6 and "skipped" not in r1 and "skipped" not in r3
    assert (r2["accuracy"], r2["loss"]) == (r1["accuracy"], r1["loss"])  # nothing was averaged
    assert summary["skipped_rounds"] == [2]


def test_the_default_drops_non_finite_updates_and_fails_on_an_exception():
    cfg = build_config(_cfg())
    assert cfg.engine.on_client_error == "drop_non_finite"
    with faulty_fedavg("inf", {1}, round_=1):
        assert build_simulation(cfg).run_round().rejected == [1]
    with faulty_fedavg("raise", {1}, round_=1), pytest.raises(RunFailure, match="client 1 raised"):
        build_simulation(cfg).run_round()


def test_a_contract_error_is_never_dropped():
    from fedskew.algorithms.base import ContractError

    class Broken(Faulty):
        def finish_local(self, step, result):
            raise ContractError("finish_local broke the contract")

    with ALGORITHMS.replaced("fedavg", Broken), pytest.raises(ContractError, match="broke the contract"):
        build_simulation(build_config(_cfg(on_client_error="drop"))).run_round()


def test_on_client_error_rejects_other_values():
    with pytest.raises(ConfigError, match=r"engine.on_client_error.*'drop' or 'fail'"):
        build_config(_cfg(on_client_error="ignore"))


# ---------------------------------------------------------------------------- output folder lock
def test_a_second_run_on_a_locked_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    with runner.output_lock(out), pytest.raises(FedskewError, match="in use by another fedskew process"):
        run_experiment(build_config(_cfg()), out)


def test_the_lock_of_a_killed_process_is_released(tmp_path, reference):
    out = tmp_path / "run"
    out.mkdir()
    holder = (  # holds the lock until killed, or until its stdin closes (the with block's end on a failure)
        "import fcntl, sys; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('locked', flush=True); sys.stdin.read()"
    )
    cmd = [sys.executable, "-c", holder, str(out / runner.LOCK_FILE)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(FedskewError, match="in use"):
            run_experiment(build_config(_cfg()), out)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    run_experiment(build_config(_cfg()), out, resume=True)  # the stale lock file does not block
    assert _same_as_reference(out, reference)


# ---------------------------------------------------------------------------- checkpoints
def _every_two() -> Config:
    cfg = _cfg()
    cfg["checkpoint"] = {"every": 2}
    return build_config(cfg)


def test_the_previous_checkpoint_is_kept(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(_every_two(), out, on_round=_stop_after(3))
    saved = [torch.load(out / f, weights_only=True) for f in ("checkpoint.pt", "checkpoint.prev.pt")]
    assert [sd["round"] for sd in saved] == [3, 2]  # written on the interrupt; the periodic one of round 2


def _stop_after(n: int):
    def on_round(sim, record):
        if sim.round == n:
            raise KeyboardInterrupt

    return on_round


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumes(tmp_path, reference, damage):
    out = tmp_path / "run"
    cfg = _every_two()
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, out, on_round=_stop_after(3))  # checkpoint.pt: round 3, .prev: round 2
    path = out / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x10  # torch does not check the zip CRCs; the content digest does
    path.write_bytes(bytes(data))
    with pytest.raises(FedskewError) as err:
        run_experiment(cfg, out, resume=True)
    assert str(err.value) == (
        f"checkpoint '{path}' is truncated or corrupted; delete it to resume from "
        f"'{out / 'checkpoint.prev.pt'}' (round 2)"
    )
    path.unlink()
    run_experiment(cfg, out, resume=True)
    assert _metrics(out) == reference[0]


def test_resume_uses_the_previous_checkpoint_when_the_last_is_missing(tmp_path, reference):
    """A kill between the two renames of a checkpoint write leaves checkpoint.prev.pt only."""
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(build_config(_cfg()), out, on_round=_stop_after(3))
    (out / "checkpoint.pt").unlink()
    run_experiment(build_config(_cfg()), out, resume=True)
    assert _same_as_reference(out, reference)


# ---------------------------------------------------------------------------- disk full
@pytest.mark.parametrize("fail_at", [3, 5, 8])  # a metrics line, a checkpoint, a later metrics line
def test_disk_full_is_one_line_keeps_the_files_and_resumes(tmp_path, monkeypatch, reference, fail_at):
    out = tmp_path / "run"
    calls, real, before = [0], results.write_bytes, {}

    def full(fh, data: bytes) -> None:
        calls[0] += 1
        if calls[0] == fail_at:
            before.update(
                {p.name: p.read_bytes() for p in out.iterdir() if p.name in ("metrics.jsonl", "config.yaml")}
            )
            fh.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fh, data)

    monkeypatch.setattr(results, "write_bytes", full)
    with pytest.raises(RunFailure, match=r"^cannot write '.*': the disk is full; .*--resume$"):
        run_experiment(build_config(_cfg()), out)
    assert {n: (out / n).read_bytes() for n in before} == before  # no half line, nothing overwritten
    assert not list(out.glob("*.tmp"))
    monkeypatch.setattr(results, "write_bytes", real)
    run_experiment(build_config(_cfg()), out, resume=True)
    assert _same_as_reference(out, reference)


# ---------------------------------------------------------------------------- worker processes
class _KillOwnWorker(Faulty):
    """SIGKILLs the worker process training client ``victim`` in round 2, once (a marker file remembers)."""

    marker = Path()

    def finish_local(self, step, result):
        if step.info.round == 2 and not self.marker.exists() and os.getpid() != self.parent:
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().finish_local(step, result)


@pytest.mark.slow
def test_a_worker_killed_mid_round_reruns_the_round_on_new_workers(tmp_path, reference, caplog):
    cls = type("KillOnce", (_KillOwnWorker,), {"marker": tmp_path / "killed", "parent": os.getpid()})
    out = tmp_path / "run"
    with ALGORITHMS.replaced("fedavg", cls), caplog.at_level("WARNING", logger="fedskew.engine"):
        run_experiment(build_config(_cfg(workers=2)), out)
    assert (tmp_path / "killed").exists()
    reruns = [r.getMessage() for r in caplog.records if "running the round again" in r.getMessage()]
    assert len(reruns) == 1 and reruns[0].startswith("round 2: engine worker"), reruns
    assert _same_as_reference(out, reference)


@pytest.mark.slow
def test_a_worker_that_always_dies_fails_the_run_with_one_line(tmp_path):
    class Always(_KillOwnWorker):
        marker = tmp_path / "never-created" / "x"
        parent = os.getpid()

        def finish_local(self, step, result):
            if os.getpid() != self.parent:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().finish_local(step, result)

    with ALGORITHMS.replaced("fedavg", Always), pytest.raises(RunFailure, match=r"round 1: engine worker"):
        run_experiment(build_config(_cfg(workers=2)), tmp_path / "run")


# ---------------------------------------------------------------------------- security basics
def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _keyword(call: ast.Call, name: str) -> object:
    kw = next((k for k in call.keywords if k.arg == name), None)
    return kw.value.value if kw is not None and isinstance(kw.value, ast.Constant) else None


def unsafe_calls(tree: ast.AST) -> list[str]:
    """eval / exec, pickle and marshal loads, non-safe YAML loaders, torch.load without weights_only=True
    and numpy loads with allow_pickle=True, as ``name:line``."""
    banned = {"eval", "exec", "pickle.load", "pickle.loads", "marshal.loads", "yaml.load", "yaml.unsafe_load"}
    banned |= {"yaml.full_load", "shelve.open"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        bad = name in banned
        bad |= name == "torch.load" and _keyword(node, "weights_only") is not True
        bad |= name.endswith("load") and _keyword(node, "allow_pickle") is True
        if bad:
            found.append(f"{name}:{node.lineno}")
    return found


def test_the_unsafe_call_finder_finds_them():
    code = "eval(x)\nm.eval()\ntorch.load(p)\ntorch.load(p, weights_only=True)\nnp.load(p, allow_pickle=True)"
    assert unsafe_calls(ast.parse(code)) == ["eval:1", "torch.load:3", "np.load:5"]


def test_no_unsafe_deserialisation_or_eval_in_the_package():
    found = {p.name: unsafe_calls(ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}
    # the two Unpicklers: the worker arenas' messages (written by the parent into memory shared with its
    # forks) and CIFAR batches (numpy arrays only)
    unpicklers = [p.name for p in SRC.rglob("*.py") if "pickle.Unpickler" in p.read_text()]
    assert sorted(unpicklers) == ["arena.py", "cifar.py"]


def test_cifar_pickles_cannot_run_code(tmp_path):
    from fedskew.data.datasets.cifar import read_cifar_batch
    from fedskew.errors import DataError

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    with pytest.raises(DataError, match="refused to load"):
        read_cifar_batch(path, "labels")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/../../b"])
def test_sweep_folder_names_cannot_leave_the_output_folder(tmp_path, name):
    from fedskew.experiment.sweep import render_name

    try:
        folder = render_name(name, "stem", "", {})
    except ConfigError:
        return
    assert not folder.is_absolute() and ".." not in folder.parts
    assert (tmp_path / folder).resolve().is_relative_to(tmp_path.resolve())
