"""The open_clip path from pixels: a random-weight CLIP saved to a local checkpoint, loaded through the
``open_clip`` backbone (torchvision stand-in included), then zero-shot, CacheFL and PromptFL runs."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.models.clip_compat import FrozenBatchNorm2d, import_open_clip, stand_in_modules

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None, reason="needs the [clip] extra (open-clip-torch)"
)
TINY = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def test_the_torchvision_stand_in_freezes_batchnorm_and_refuses_transforms():
    bn = torch.nn.BatchNorm2d(3).eval()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        bn.running_mean.copy_(torch.tensor([0.1, -0.2, 0.3]))
        bn.running_var.copy_(torch.tensor([1.0, 4.0, 0.25]))
    frozen = FrozenBatchNorm2d(3)
    frozen.load_state_dict(bn.state_dict())  # num_batches_tracked is dropped
    x = torch.randn(2, 3, 4, 4)
    assert torch.allclose(frozen(x), bn(x), atol=1e-6)
    assert not list(frozen.parameters())
    transforms = stand_in_modules()["torchvision.transforms"]
    with pytest.raises(RuntimeError, match="torchvision is not available"):
        transforms.Resize(224)
    import_open_clip()
    assert "torchvision" not in sys.modules or sys.modules["torchvision"].__spec__ is not None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    open_clip = import_open_clip()
    torch.manual_seed(0)
    net = open_clip.model.CLIP(**TINY)
    path = tmp_path_factory.mktemp("clip") / "tiny_clip.pt"
    torch.save(net.state_dict(), path)
    return path


def clip_config(checkpoint, algorithm: dict, rounds: int = 2) -> dict:
    return {
        "seed": 0,
        "rounds": rounds,
        "data": {
            "dataset": "digits",
            "num_clients": 3,
            "partition": {"name": "iid"},
            "train_limit": 60,
            "vision_language": {
                "backbone": {
                    "name": "open_clip",
                    "options": {"checkpoint": str(checkpoint), "model_config": TINY},
                },
                "generator": {"name": "procedural"},
                "shots": 2,
                "cache": False,
            },
        },
        "model": {"name": "identity"},
        "algorithm": algorithm,
        "client": {"epochs": 1, "batch_size": 8, "lr": 0.1},
        "engine": {"mode": "sequential"},
        "checkpoint": {"every": 0},
    }


@pytest.mark.parametrize("algorithm", ["zeroshot", "cachefl", "promptfl"])
def test_runs_from_pixels_train_only_their_own_parameters(checkpoint, algorithm):
    params = {"name": algorithm} | ({"n_ctx": 4} if algorithm == "promptfl" else {})
    sim = build_simulation(build_config(clip_config(checkpoint, params)))
    model = sim.executor.runtime.models.model_for(0)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    sim.run_round()
    after = model.state_dict()
    changed = sorted(k for k in frozen if not torch.equal(frozen[k], after[k]))
    expected = {"zeroshot": [], "cachefl": ["keys"], "promptfl": ["ctx"]}[algorithm]
    assert changed == expected  # text tower, W2, W_text: bit-identical
    x = sim.executor.runtime.data.x[:5]
    assert model(x).shape == (5, 10) and torch.isfinite(model(x)).all()
    sent = sim.server.get("weights", {})
    assert sorted(sent) == [f"model.{k}" for k in expected]


def test_prompt_gradients_reach_only_the_context(checkpoint):
    sim = build_simulation(build_config(clip_config(checkpoint, {"name": "promptfl", "n_ctx": 4})))
    model = sim.executor.runtime.models.model_for(0)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(
        model(sim.executor.runtime.data.x[:6]), sim.executor.runtime.data.y[:6]
    ).backward()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert with_grad == ["ctx"] and model.ctx.grad.abs().sum() > 0


def test_the_open_clip_pipeline_is_deterministic(checkpoint):
    cfg = build_config(clip_config(checkpoint, {"name": "cachefl"}))
    assert run_experiment(cfg)["final"] == run_experiment(cfg)["final"]
