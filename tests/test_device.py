"""The device a run trains on (``engine.device``), its precision and determinism switches.

No test needs a GPU: CUDA's and MPS' availability are monkeypatched where the choice depends on them."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

from fedskew.engine import device as devices
from fedskew.engine.device import chunk_budget_mb, deterministic_algorithms, resolve_device
from fedskew.errors import ConfigError
from fedskew.experiment import build
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment, with_resolved_device
from tests.conftest import digits_config


def _machine(monkeypatch: pytest.MonkeyPatch, cuda: int = 0, mps: bool = False) -> None:
    """Pretend the machine has ``cuda`` CUDA devices and MPS or not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Test GPU")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.parametrize(
    ("cuda", "mps", "expected"),
    [
        (0, False, torch.device("cpu")),
        (2, False, torch.device("cuda", 0)),
        (0, True, torch.device("mps")),
        (1, True, torch.device("cuda", 0)),
    ],
)
def test_auto_takes_cuda_then_mps_then_the_cpu(monkeypatch, caplog, cuda, mps, expected):
    _machine(monkeypatch, cuda, mps)
    with caplog.at_level(logging.INFO, logger="fedskew.engine"):
        assert resolve_device("auto") == expected
    assert f"engine.device=auto: running on {expected}" in caplog.text


def test_auto_is_the_default():
    assert build_config(digits_config()).engine.device == "auto"


@pytest.mark.parametrize(
    ("name", "cuda", "message"),
    [
        ("cuda", 0, "config key 'engine.device': cuda, but there is no CUDA device; allowed here: auto, cpu"),
        ("cuda:2", 2, "but this machine has 2 CUDA devices; allowed here: auto, cpu, cuda, cuda:0, cuda:1"),
        ("mps", 0, "config key 'engine.device': mps, but MPS is not available; allowed here: auto, cpu"),
    ],
)
def test_a_device_the_machine_lacks_is_refused_in_one_line(monkeypatch, name, cuda, message):
    _machine(monkeypatch, cuda)
    with pytest.raises(ConfigError, match="engine.device") as err:
        resolve_device(name)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_explicit_devices_are_used_as_given(monkeypatch):
    _machine(monkeypatch, cuda=2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:0", "mps:1", "AUTO"])
def test_a_malformed_device_names_the_allowed_values(bad):
    with pytest.raises(ConfigError, match=r"engine.device.*allowed: auto, cpu, cuda, cuda:N, mps"):
        build_config(digits_config(engine={"device": bad}))


def test_config_yaml_records_the_device_auto_chose_and_a_resume_with_auto_accepts_it(tmp_path, monkeypatch):
    _machine(monkeypatch)
    cfg = build_config(digits_config(rounds=2))
    run_experiment(cfg, tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["engine"]["device"] == "cpu"
    longer = build_config(digits_config(rounds=2))
    summary = run_experiment(longer, tmp_path / "run", resume=True)  # "auto" again: the same machine
    assert summary["rounds"] == 2


def test_worker_processes_on_a_gpu_are_refused_with_the_reason(monkeypatch):
    """Workers are forked and a CUDA context cannot be: refused, not silently run in-process."""
    monkeypatch.setattr(build, "resolve_device", lambda name: torch.device("cuda", 0))
    cfg = build_config(digits_config(engine={"workers": 2}))
    with pytest.raises(ConfigError) as err:
        with_resolved_device(cfg)
    text = str(err.value)
    assert text.startswith("config key 'engine.workers': 2 needs engine.device=cpu") and "\n" not in text
    assert "engine.mode=vectorized" in text and text.endswith("allowed here: 1")


def test_the_vectorized_chunk_budget_is_a_share_of_free_gpu_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    assert chunk_budget_mb(torch.device("cuda", 0), 1024.0) == devices.GPU_CHUNK_SHARE * 8 * 1024
    assert chunk_budget_mb(torch.device("cpu"), 1024.0) == 1024.0


def _final(tmp_path, name: str, **engine) -> dict:
    cfg = digits_config(rounds=3, engine=engine, checkpoint={"every": 0})
    return run_experiment(build_config(cfg), tmp_path / name)["final"]


def test_fp32_is_the_plain_run_and_bf16_autocast_changes_the_numbers_a_little(tmp_path):
    plain = _final(tmp_path, "plain", mode="sequential")
    assert _final(tmp_path, "fp32", mode="sequential", precision="fp32") == plain
    bf16 = _final(tmp_path, "bf16", mode="sequential", precision="bf16")
    assert bf16["loss"] != plain["loss"]
    assert bf16["loss"] == pytest.approx(plain["loss"], rel=0.02)
    assert bf16["accuracy"] == pytest.approx(plain["accuracy"], abs=0.05)


def test_bf16_runs_in_the_vectorized_mode_too(tmp_path):
    vec = _final(tmp_path, "vec", mode="vectorized", precision="bf16")
    seq = _final(tmp_path, "seq", mode="sequential", precision="bf16")
    assert vec["loss"] == pytest.approx(seq["loss"], rel=0.02)  # bf16 kernels differ between the modes


def test_deterministic_runs_give_the_same_numbers_and_leave_the_process_as_it_was(tmp_path):
    before = torch.are_deterministic_algorithms_enabled()
    det = _final(tmp_path, "det", mode="sequential", deterministic=True)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert det == _final(tmp_path, "plain", mode="sequential")


def test_deterministic_algorithms_are_on_inside_the_block_only():
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
