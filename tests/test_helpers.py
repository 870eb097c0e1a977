"""The base helpers (fedskew.algorithms.helpers) and the shared update rules (fedskew.update_rules): each does
what the copies it replaced did, and the engine and the algorithms step through one rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedskew.algorithms.base import RoundInfo
from fedskew.algorithms.helpers import (
    eval_mode,
    frozen,
    frozen_copy,
    no_global_model,
    personal_module,
    train_mode,
)
from fedskew.engine import optimizers, sgd
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.update_rules import SGD, adam_l2_update
from tests.test_contract import tiny_config


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))


@pytest.mark.parametrize(("ctx", "inside"), [(eval_mode, False), (train_mode, True)])
def test_mode_contexts_set_the_mode_and_restore_it_even_after_an_error(ctx, inside):
    model = net()
    for before in (True, False):
        model.train(before)
        with ctx(model) as m:
            assert m is model and model.training is inside and model[1].training is inside
        assert model.training is before
        with pytest.raises(RuntimeError, match="boom"), ctx(model):  # adversarial: the block raises
            raise RuntimeError("boom")
        assert model.training is before and model[1].training is before


def test_frozen_and_frozen_copy():
    model = net()
    assert frozen(model) is model and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    live = net()
    copy = frozen_copy(live)
    assert live.training and all(p.requires_grad for p in live.parameters())  # the original untouched
    pairs = zip(copy.parameters(), live.parameters(), strict=True)
    assert not copy.training and all(torch.equal(a, b) for a, b in pairs)
    with torch.no_grad():
        next(iter(copy.parameters())).add_(1.0)
    assert not torch.equal(next(iter(copy.parameters())), next(iter(live.parameters())))  # no shared storage


def test_personal_module_is_added_once():
    model = net()
    calls: list[int] = []

    def build(m: nn.Module) -> nn.Module:
        calls.append(1)
        return nn.Linear(2, 2)

    assert personal_module(model, "mine", build) is model
    first = model.mine
    personal_module(model, "mine", build)  # adversarial: preparing a prepared model twice
    assert calls == [1] and model.mine is first
    assert [k for k in model.state_dict() if k.startswith("mine.")] == ["mine.weight", "mine.bias"]
    copied = personal_module(net(), "twin")  # default: a deep copy of the model, same values
    assert torch.equal(copied.twin[0].weight, copied[0].weight)
    assert copied.twin[0].weight.data_ptr() != copied[0].weight.data_ptr()


def test_no_global_model_is_one_config_line_naming_the_method_and_the_fix():
    err = no_global_model("fedproto")
    assert isinstance(err, ConfigError) and "\n" not in str(err)
    assert str(err) == "fedproto has no global model to evaluate; set eval.protocol=personalized"
    for name in ("fedfomo", "lgfedavg", "fedpac"):  # the methods moved onto it, asked for a global model
        sim = build_simulation(build_config(tiny_config(name)))
        payload = sim.algorithm.broadcast(sim.server, RoundInfo(1, None, 0))
        with pytest.raises(ConfigError, match=f"^{name} has no global (model|head) to evaluate; set eval"):
            sim.algorithm.eval_weights(payload, None)


def test_the_engine_and_the_algorithms_share_one_sgd_rule():
    assert sgd.SGD is SGD and optimizers.AdamW.__module__ == "fedskew.update_rules"


def test_adam_l2_matches_torch_adam_and_leaves_its_moments_alone():
    torch.manual_seed(0)
    p = torch.randn(5)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=0.01, weight_decay=0.1)
    m, v = {"p": torch.zeros(5)}, {"p": torch.zeros(5)}
    for t in range(1, 4):
        g = torch.randn(5)
        ref.grad = g.clone()
        opt.step()
        old = (m["p"].clone(), v["p"].clone())
        with torch.no_grad():
            m2, v2 = adam_l2_update({"p": p}, {"p": g}, (m, v), t, 0.01, (0.9, 0.999), 1e-8, 0.1)
        assert torch.equal(m["p"], old[0]) and torch.equal(v["p"], old[1])  # functional: inputs unchanged
        m, v = m2, v2
    assert torch.allclose(p, ref.detach(), rtol=1e-6, atol=1e-7)
