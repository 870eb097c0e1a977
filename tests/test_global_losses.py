"""FedLC, FedNTD, FedDecorr: global-model methods whose change is the local loss, on tiny hand-checked cases.

Each test calls the hooks directly (no engine) on a model whose logits or representations are literal numbers;
expected values are the papers' formulas evaluated by hand, so a wrong sign, factor or normalisation fails.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fedskew.algorithms.feddecorr
import fedskew.algorithms.fedlc
import fedskew.algorithms.fedntd  # noqa: F401  (the imports register the algorithms)
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    Context,
    LocalStep,
    Payload,
    RoundInfo,
    Scratch,
    model_arrays,
)
from fedskew.algorithms.feddecorr import decorrelation_loss
from fedskew.algorithms.fedlc import calibration_shift
from fedskew.algorithms.fedntd import global_logits, not_true_logits, ntd_loss
from fedskew.errors import ConfigError
from fedskew.models.base import FedModel
from fedskew.settings import ClientSection
from tests.paired import assert_paired, baseline_accuracy, digits_run, run_paired


class Logits(FedModel):
    """features = identity on ``C`` inputs, head = a ``C × C`` linear map: with weight 0 the logits are the
    head's bias, with weight I and bias 0 they are the input itself."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.embed_dim = c
        self.classifier = nn.Linear(c, c)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.eye(c))
            self.classifier.bias.zero_()

    def features(self, x: Tensor) -> Tensor:
        return x

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


def context(c: int = 3) -> Context:
    return Context(
        num_clients=2,
        num_classes=c,
        in_shape=(c,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, batch_size=2, lr=0.1),
        client_sizes=torch.tensor([2, 2]),
        class_counts=torch.ones(2, c, dtype=torch.long),
        rounds=2,
        seed=0,
        build_model=lambda cid: Logits(c),
    )


def make(name: str, c: int = 3, **params: object) -> Algorithm:
    cls = ALGORITHMS.get(name)
    return cls(cls.Params(**params), context(c))


def step_for(
    alg: Algorithm, model: nn.Module, counts: list[int], payload: Payload | None = None
) -> LocalStep:
    """A client's step with label counts ``counts`` (these losses read no client data), scratch made."""
    c = len(counts)
    view = ClientView(
        cid=0,
        x=torch.zeros(sum(counts), c),
        y=torch.zeros(sum(counts), dtype=torch.long),
        class_counts=torch.tensor(counts),
    )
    payload = payload or Payload(arrays=model_arrays(model.state_dict()))
    step = LocalStep(model=model, payload=payload, state={}, client=view, info=RoundInfo(1, 0, 0))
    return step.replace(scratch=Scratch(alg.init_scratch(step)))


def batch(x: list[list[float]], y: list[int]) -> Batch:
    return Batch(torch.tensor(x), torch.tensor(y))


# ==================================================================== FedLC
def test_fedlc_shift_is_tau_times_count_to_the_minus_quarter():
    shift = calibration_shift(torch.tensor([16, 1, 0, 81]), tau=1.0)
    assert shift[:2].tolist() == [0.5, 1.0] and math.isinf(shift[2].item())
    assert shift[3].item() == pytest.approx(1 / 3)
    clamp = calibration_shift(torch.tensor([16, 0]), tau=0.5, zero_count="clamp")
    assert clamp.tolist() == pytest.approx([0.25, 0.5 * 100.0])  # (1e-8)^(-1/4) = 100
    assert calibration_shift(torch.tensor([3, 0]), tau=0.0).tolist() == [0.0, 0.0]  # τ = 0: plain CE


def test_fedlc_calibrated_cross_entropy_three_classes_by_hand():
    alg = make("fedlc", tau=1.0)
    model = Logits(3)
    step = step_for(alg, model, [16, 1, 0])
    # logits (1, 2, 3), y = 0; shifts (0.5, 1, ∞): calibrated (0.5, 1, −∞)
    loss = alg.local_loss(step, batch([[1.0, 2.0, 3.0]], [0]))
    expected = -math.log(math.exp(0.5) / (math.exp(0.5) + math.exp(1.0)))  # = log(1 + e^{0.5}) = 0.974077
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(0.974077, abs=1e-6)
    # the missing class leaves the softmax: its logit changes nothing, and every gradient is finite
    assert alg.local_loss(step, batch([[1.0, 2.0, 50.0]], [0])).item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # clamp (FL-bench): the missing class keeps exp(3 − 100)
    clamp = make("fedlc", tau=1.0, zero_count="clamp")
    got = clamp.local_loss(step_for(clamp, Logits(3), [16, 1, 0]), batch([[1.0, 2.0, 3.0]], [0]))
    denom = math.exp(0.5) + math.exp(1.0) + math.exp(3.0 - 100.0)
    assert got.item() == pytest.approx(-math.log(math.exp(0.5) / denom), rel=1e-6)


def test_fedlc_two_classes_is_the_pairwise_margin():
    alg = make("fedlc", c=2, tau=0.5)
    step = step_for(alg, Logits(2), [1, 81])  # shifts (0.5, 0.5/3)
    loss = alg.local_loss(step, batch([[0.0, 0.0], [0.0, 0.0]], [0, 1]))
    # y = 0: log(1 + e^{Δ}) with Δ = 0.5 − 1/6 = 1/3; y = 1: log(1 + e^{−1/3}); mean of the two
    expected = 0.5 * (math.log(1 + math.exp(1 / 3)) + math.log(1 + math.exp(-1 / 3)))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert math.log(1 + math.exp(1 / 3)) == pytest.approx(0.873639, abs=1e-6)  # the rare class costs more


def test_fedlc_evaluates_the_plain_logits_and_declares_its_flags():
    alg = make("fedlc")
    model = Logits(3)
    x = torch.tensor([[1.0, 2.0, 3.0]])
    out = alg.predict(model, x, Payload(arrays=model_arrays(model.state_dict())), None)
    assert torch.equal(out["logits"], x)
    cls = ALGORITHMS.get("fedlc")
    assert cls.mean_aggregation and cls.vectorizable and cls.loss_reads == frozenset()


# ==================================================================== FedNTD
def test_not_true_logits_drop_the_true_class_in_order():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    got = not_true_logits(logits, torch.tensor([0, 2, 1]))
    assert got.tolist() == [[2.0, 3.0], [4.0, 5.0], [7.0, 9.0]]


def ntd_setup(local_bias: list[float], global_bias: list[float], **params: object):
    alg = make("fedntd", **params)
    model = Logits(3)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor(local_bias))
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    glob["classifier.bias"] = torch.tensor(global_bias)
    payload = Payload(arrays=model_arrays(glob))
    return alg, model, step_for(alg, model, [1, 1, 1], payload), payload


def test_fedntd_loss_by_hand_tau_one():
    # local logits (0, 0, ln 3), y = 0: CE = ln 5; not-true local (0, ln 3) -> q_l = (1/4, 3/4)
    # global logits (7, 0, 0): not-true (0, 0) -> q_g = (1/2, 1/2)
    # KL(q_g || q_l) = ½ ln 2 + ½ ln(2/3) = ½ ln(4/3)
    alg, _, step, _ = ntd_setup([0.0, 0.0, math.log(3.0)], [7.0, 0.0, 0.0], beta=1.0, tau=1.0)
    loss = alg.local_loss(step, batch([[0.0, 0.0, 0.0]], [0]))
    assert loss.item() == pytest.approx(math.log(5.0) + 0.5 * math.log(4.0 / 3.0), rel=1e-6)
    assert 0.5 * math.log(4.0 / 3.0) == pytest.approx(0.143841, abs=1e-6)


def test_fedntd_temperature_and_the_codes_tau_squared():
    # τ = 2: q_l ∝ (1, √3), q_g = (½, ½): KL = ½ ln(½(1+√3)) + ½ ln(½(1+√3)/√3)
    s = 1 + math.sqrt(3.0)
    kl = 0.5 * math.log(0.5 * s) + 0.5 * math.log(0.5 * s / math.sqrt(3.0))
    ce = math.log(5.0)
    local, glob = [0.0, 0.0, math.log(3.0)], [7.0, 0.0, 0.0]
    for scaling, factor in (("paper", 1.0), ("code", 4.0)):
        alg, _, step, _ = ntd_setup(local, glob, beta=0.5, tau=2.0, scaling=scaling)
        loss = alg.local_loss(step, batch([[0.0, 0.0, 0.0]], [0]))
        assert loss.item() == pytest.approx(ce + 0.5 * factor * kl, rel=1e-6), scaling


def test_fedntd_ignores_the_global_models_true_class_and_keeps_the_payload():
    x, y = batch([[0.0, 0.0, 0.0]], [0]).x, torch.tensor([0])
    losses = []
    for true_logit in (7.0, -3.0, 40.0):  # only the global true-class logit changes
        alg, _, step, payload = ntd_setup([0.0, 0.0, math.log(3.0)], [true_logit, 0.0, 0.0])
        before = {k: v.clone() for k, v in payload.arrays.items()}
        loss = alg.local_loss(step, Batch(x, y))
        loss.backward()
        losses.append(loss.item())
        assert all(torch.equal(payload.arrays[k], v) for k, v in before.items())  # the payload is untouched
        assert all(not v.requires_grad for v in payload.arrays.values())
    assert losses[0] == losses[1] == losses[2]
    # a global model equal to the local one: the not-true KL is 0, the loss is plain CE
    alg, _, step, _ = ntd_setup([1.0, 2.0, 0.5], [1.0, 2.0, 0.5])
    plain = F.cross_entropy(torch.tensor([[1.0, 2.0, 0.5]]), y)
    assert alg.local_loss(step, Batch(x, y)).item() == pytest.approx(plain.item(), rel=1e-6)


def test_ntd_loss_is_the_not_true_kl_per_sample_mean():
    local = torch.tensor([[0.0, 0.0, math.log(3.0)], [math.log(3.0), 9.0, 0.0]])
    glob = torch.tensor([[7.0, 0.0, 0.0], [0.0, -5.0, 0.0]])
    # sample 1 (y=0): ½ ln(4/3); sample 2 (y=1): local not-true (ln 3, 0) vs global (0, 0): ½ ln(4/3) again
    got = ntd_loss(local, glob, torch.tensor([0, 1]), tau=1.0)
    assert got.item() == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-6)


def test_fedntd_global_forward_keeps_batchnorm_statistics_and_the_payload():
    """The global model's train-mode forward updates BatchNorm statistics on copies only."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()
    glob = {k: v.clone() + 0.5 for k, v in model.state_dict().items()}
    payload = Payload(arrays=model_arrays(glob))
    own, sent = snapshot_state(model), {k: v.clone() for k, v in payload.arrays.items()}
    out = global_logits(model, payload, torch.randn(4, 3))
    assert out.shape == (4, 3) and not out.requires_grad
    assert all(torch.equal(model.state_dict()[k], v) for k, v in own.items())
    assert all(torch.equal(payload.arrays[k], v) for k, v in sent.items())


def snapshot_state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fedntd_flags():
    cls = ALGORITHMS.get("fedntd")
    assert cls.mean_aggregation and cls.vectorizable and cls.loss_reads == frozenset({"payload"})


# ==================================================================== FedDecorr
def test_feddecorr_correlated_and_decorrelated_batches_by_hand():
    # perfectly correlated: ẑ = ((1, 1), (−1, −1)) -> K = all ones -> ‖K‖²/d² = 4/4 = 1
    correlated = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    assert decorrelation_loss(correlated, "paper").item() == pytest.approx(1.0, rel=1e-6)
    # decorrelated (±1 grid): K = I -> ‖I‖²/d² = 1/d = 1/2 (paper); the code's off-diagonal term is 0
    grid = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    assert decorrelation_loss(grid, "paper").item() == pytest.approx(0.5, rel=1e-6)
    assert decorrelation_loss(grid, "code").item() == pytest.approx(0.0, abs=1e-7)
    # ρ = ½: z = ((0, 0), (1, 2), (2, 1)); centred (−1, 0, 1) and (−1, 1, 0), cov = 1/3, var = 2/3 each
    z = torch.tensor([[0.0, 0.0], [1.0, 2.0], [2.0, 1.0]])
    assert decorrelation_loss(z, "paper").item() == pytest.approx((1 + 1 + 0.25 + 0.25) / 4, rel=1e-6)
    # code: unbiased var = 1 so ẑ = centred, ẑᵀẑ = ((2, 1), (1, 2)); off-diagonal mean of squares 1, / N = 3
    assert decorrelation_loss(z, "code").item() == pytest.approx(1 / 3, rel=1e-6)


def test_feddecorr_a_single_sample_gives_zero_and_finite_gradients():
    z = torch.tensor([[3.0, -1.0, 2.0]], requires_grad=True)
    for formula in ("paper", "code"):
        loss = decorrelation_loss(z, formula)
        assert loss.item() == 0.0
        (g,) = torch.autograd.grad(loss, z)
        assert torch.isfinite(g).all()


def test_feddecorr_local_loss_is_ce_plus_beta_times_the_term():
    alg = make("feddecorr", beta=0.1, formula="paper")
    model = Logits(2)  # features = x, logits = x
    x, y = torch.tensor([[0.0, 0.0], [1.0, 2.0], [2.0, 1.0]]), torch.tensor([0, 1, 0])
    step = step_for(alg, model, [2, 1])
    got = alg.local_loss(step, Batch(x, y))
    expected = F.cross_entropy(x, y).item() + 0.1 * 0.625
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_feddecorr_needs_a_model_with_features():
    alg = make("feddecorr")
    with pytest.raises(ConfigError, match="feddecorr needs a model with features"):
        alg.prepare_model(nn.Linear(3, 3))
    model = Logits(3)
    assert alg.prepare_model(model) is model
    cls = ALGORITHMS.get("feddecorr")
    assert cls.mean_aggregation and cls.vectorizable and cls.loss_reads == frozenset()


# ==================================================================== end to end
@pytest.mark.slow
@pytest.mark.parametrize(("name", "below"), [("fedlc", 0.05), ("fedntd", 0.05), ("feddecorr", 0.10)])
def test_learns_on_digits_and_keeps_up_with_fedavg(name, below):
    """Paired with the run's untrained model (0.10) and FedAvg on the same seed and partition (0.867), at
    most ``below`` under it. Measured at seed 0: FedLC 0.906, FedNTD 0.900; FedDecorr 0.861 on AVX-512 (Zen 4)
    and 0.808 on AVX2 (Zen 3) kernels: at its authors' strength (the issue-52 default) it does not keep up
    within 5 pp on every CPU (docs/reproduction/global.md measures -7.3 pp on Fashion-MNIST Dir(0.1)), so its
    margin is 10 pp."""
    raw = digits_run({"name": name})
    assert_paired(run_paired(raw), baseline_accuracy(raw, {"name": "fedavg"}), below=below)
