"""Ditto, pFedMe and Per-FedAvg: their defining updates on a tiny model with hand-computed numbers.

Each test calls the hooks directly (no engine) and, where the engine's optimizer would step, takes one plain
SGD step itself. The tiny model starts with zero weights except the classifier bias, so the features are 0
and every gradient is a softmax difference in the bias: the expected values below are the papers' update
rules evaluated with a calculator (softmax([1, 0, 0]) = [e, 1, 1]/(e + 2) = [0.576117, 0.211942, 0.211942]).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fedskew.algorithms.ditto
import fedskew.algorithms.perfedavg
import fedskew.algorithms.pfedme  # noqa: F401  (the imports register the algorithms)
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    Context,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    Scratch,
    Upload,
    load_state,
    model_arrays,
)
from fedskew.algorithms.ditto import PERSONAL, is_personal
from fedskew.algorithms.perfedavg import batch_parts, meta_gradient
from fedskew.algorithms.pfedme import THETA, inner_solve
from fedskew.models.base import FedModel
from fedskew.settings import ClientSection
from tests.paired import assert_paired, baseline_accuracy, digits_run, run_paired

X = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
Y = torch.tensor([0, 2])


class Tiny(FedModel):
    """features = a 2x2 linear map, head = a 3-class classifier, plus one float buffer."""

    embed_dim = 2

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.classifier = nn.Linear(2, 3)
        self.register_buffer("stat", torch.zeros(2))

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


def context(lr: float = 0.1) -> Context:
    return Context(
        num_clients=2,
        num_classes=3,
        in_shape=(2,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, batch_size=4, lr=lr),
        client_sizes=torch.tensor([2, 2]),
        class_counts=torch.tensor([[1, 0, 1], [1, 0, 1]]),
        rounds=2,
        seed=0,
        build_model=lambda cid: Tiny(),
    )


def make(name: str, lr: float = 0.1, **params: object) -> Algorithm:
    cls = ALGORITHMS.get(name)
    return cls(cls.Params(**params), context(lr))


def weights(bias: list[float], value: float = 0.0, stat: float = 0.0) -> dict[str, Tensor]:
    """A Tiny state: every weight ``value``, the classifier bias ``bias``, the buffer ``stat``."""
    return {
        "body.weight": torch.full((2, 2), value),
        "classifier.weight": torch.full((3, 2), value),
        "classifier.bias": torch.tensor(bias),
        "stat": torch.full((2,), stat),
    }


def step_of(alg: Algorithm, model: nn.Module, payload: Payload, state: dict, n: int = 2) -> LocalStep:
    """A client's step with ``model`` loaded from ``model_weights`` and its scratch made."""
    load_state(model, alg.model_weights(payload, state))
    view = ClientView(0, X[:n], Y[:n], torch.tensor([1, 0, 1]))
    step = LocalStep(model=model, payload=payload, state=state, client=view, info=RoundInfo(1, 0, 0))
    step = step.replace(derived=alg.start_local(step).derived)
    return step.replace(scratch=Scratch(alg.init_scratch(step)))


def sgd_step(alg: Algorithm, step: LocalStep, batch: Batch, lr: float) -> Tensor:
    """What the engine does with a loss: backward, then p ← p − lr · grad."""
    loss = alg.local_loss(step, batch)
    step.model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in step.model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return loss.detach()


def payload_of(state: dict[str, Tensor]) -> Payload:
    return Payload(arrays=model_arrays(state))


def upload(cid: int, n: int, state: dict[str, Tensor]) -> Upload:
    return Upload(cid=cid, num_samples=n, payload=payload_of(state))


def close(t: Tensor, expected: list[float]) -> bool:
    return torch.allclose(t, torch.tensor(expected), atol=1e-6)


# -------------------------------------------------------------------------------------------- Ditto
def test_ditto_one_step_is_one_global_step_and_one_personal_step():
    """w ← w − η∇F(w); v ← v − η(∇F(v) + λ(v − w^t)) on the same batch (Alg. 1; authors' code)."""
    alg = make("ditto", lam=0.5)
    model = alg.prepare_model(Tiny())
    payload = payload_of(weights([0.0, 0.0, 0.0]))  # w^t = 0
    state = {"personal": weights([1.0, 0.0, 0.0])}  # v: bias [1, 0, 0]
    step = step_of(alg, model, payload, state, n=1)
    loss = sgd_step(alg, step, Batch(X[:1], Y[:1]), lr=0.1)
    # CE(w) = log 3, CE(v) = −log 0.576117, λ/2 ‖v − w^t‖² = 0.25
    assert loss.item() == pytest.approx(math.log(3) + 0.551445 + 0.25, abs=1e-5)
    out = alg.finish_local(step, LocalResult(steps=1, loss=loss.item(), lr=0.1))
    sent = out.upload.model_state()
    assert set(sent) == {"body.weight", "classifier.weight", "classifier.bias", "stat"}  # w only
    # w bias: 0 − 0.1 · ([1/3, 1/3, 1/3] − e_0)
    assert close(sent["classifier.bias"], [0.0666667, -0.0333333, -0.0333333])
    # v bias: [1, 0, 0] − 0.1 · ([0.576117 − 1 + 0.5 · 1, 0.211942, 0.211942])
    assert close(out.state["personal"]["classifier.bias"], [0.9923883, -0.0211942, -0.0211942])
    assert torch.equal(out.state["personal"]["body.weight"], torch.zeros(2, 2))  # z = 0: no gradient
    assert torch.equal(state["personal"]["classifier.bias"], torch.tensor([1.0, 0.0, 0.0]))  # not mutated


def test_ditto_keeps_the_personal_copy_out_of_the_server_and_evaluates_v_or_w():
    alg = make("ditto")
    model = alg.prepare_model(Tiny())
    assert isinstance(getattr(model, PERSONAL), Tiny) and alg.prepare_model(model) is model  # once
    server = alg.init_server(model)
    assert not any(is_personal(k) for k in server["weights"])
    assert set(alg.init_client(0)["personal"]) == set(server["weights"])
    payload, v = payload_of(weights([1.0, 2.0, 3.0])), weights([4.0, 5.0, 6.0])
    assert torch.equal(alg.eval_weights(payload, {"personal": v})["classifier.bias"], v["classifier.bias"])
    assert torch.equal(alg.eval_weights(payload, None)["classifier.bias"], torch.tensor([1.0, 2.0, 3.0]))
    trained = alg.model_weights(payload, {"personal": v})
    assert torch.equal(trained[PERSONAL + ".classifier.bias"], v["classifier.bias"])
    assert torch.equal(trained["classifier.bias"], torch.tensor([1.0, 2.0, 3.0]))
    assert alg.personalized_eval and not alg.requires_personalized_eval and alg.mean_aggregation


def test_ditto_personal_epochs_add_a_phase_for_the_difference():
    alg = make("ditto", personal_epochs=3)
    model = alg.prepare_model(Tiny())
    step = step_of(alg, model, payload_of(weights([0.0] * 3)), {"personal": weights([0.0] * 3)})
    phases = alg.start_local(step).phases
    assert [p.epochs for p in phases] == [1, 2]  # s = 3 personal epochs, E = 1 global
    assert phases[0].trainable is None and phases[1].trainable is not None
    assert phases[1].trainable(PERSONAL + ".body.weight") and not phases[1].trainable("body.weight")
    fewer = make("ditto", personal_epochs=0).start_local(step).phases
    assert [p.epochs for p in fewer] == [0, 1] and not fewer[1].trainable(PERSONAL + ".body.weight")


# -------------------------------------------------------------------------------------------- pFedMe
def test_pfedme_inner_solver_takes_k_gradient_steps_on_the_moreau_objective():
    """θ ← θ − p_lr (∇f̃(θ; D) + λ(θ − w)), K = 2, λ = 2, p_lr = 0.5, from θ = w (Eq. 7)."""
    model = Tiny()
    load_state(model, weights([0.3, 0.0, -0.3]))
    w = {n: p.detach() for n, p in model.named_parameters()}
    theta, value = inner_solve(model, w, w, Batch(X[:1], Y[:1]), steps=2, lr=0.5, lam=2.0)
    # step 1: softmax([0.3, 0, −0.3]) − e_0; step 2 from θ_1 = [0.581624, −0.161777, −0.419847]
    assert close(theta["classifier.bias"], [0.5286786, -0.1290117, -0.3996668])
    assert value.item() == pytest.approx(0.6113038, abs=1e-6)  # f̃(θ_1): −log softmax(θ_1)_0
    assert torch.equal(theta["body.weight"], torch.zeros(2, 2))


def test_pfedme_local_step_is_w_minus_eta_lambda_w_minus_theta():
    """Line 8: w ← w − η λ (w − θ̂), η = 0.1, λ = 2; θ̂ kept in scratch and then in the client state."""
    alg = make("pfedme", lam=2.0, K=2, personal_lr=0.5)
    model = Tiny()
    step = step_of(alg, model, payload_of(weights([0.3, 0.0, -0.3])), {}, n=1)
    loss = sgd_step(alg, step, Batch(X[:1], Y[:1]), lr=0.1)
    assert loss.item() == pytest.approx(0.6113038, abs=1e-6)  # reports f̃(θ) of the personalized model
    # gradient λ(w − θ̂) = [−0.457357, 0.258023, 0.199334]
    assert close(model.classifier.bias.detach(), [0.3457357, -0.0258023, -0.3199334])
    assert close(step.scratch[THETA + "classifier.bias"], [0.5286786, -0.1290117, -0.3996668])
    out = alg.finish_local(step, LocalResult(steps=1, loss=loss.item(), lr=0.1))
    assert close(out.upload.model_state()["classifier.bias"], [0.3457357, -0.0258023, -0.3199334])
    personal = out.state["personal"]
    assert close(personal["classifier.bias"], [0.5286786, -0.1290117, -0.3996668])  # θ̂ (paper's PM)
    assert close(
        alg.eval_weights(out.upload, out.state)["classifier.bias"], [0.5286786, -0.1290117, -0.3996668]
    )
    local = make("pfedme", lam=2.0, K=2, personal_lr=0.5, personal_model="local").finish_local(
        step, LocalResult(steps=1, loss=loss.item(), lr=0.1)
    )
    assert close(local.state["personal"]["classifier.bias"], [0.3457357, -0.0258023, -0.3199334])  # w_{i,R}


@pytest.mark.parametrize("init", ["warm", "local"])
def test_pfedme_inner_solver_starts_warm_or_from_the_local_model(init):
    """The second batch's inner solve starts from θ̂ of the first (warm, the authors' code) or from w_{i,1}."""
    alg = make("pfedme", lam=2.0, K=2, personal_lr=0.5, inner_init=init)
    model = Tiny()
    step = step_of(alg, model, payload_of(weights([0.3, 0.0, -0.3])), {}, n=1)
    sgd_step(alg, step, Batch(X[:1], Y[:1]), lr=0.1)
    w_1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    theta_1 = {n: step.scratch[THETA + n].clone() for n in w_1}
    reference = Tiny()
    load_state(reference, w_1)
    start = theta_1 if init == "warm" else w_1
    expected, _ = inner_solve(reference, start, w_1, Batch(X[1:], Y[1:]), steps=2, lr=0.5, lam=2.0)
    sgd_step(alg, step, Batch(X[1:], Y[1:]), lr=0.1)
    got = step.scratch[THETA + "classifier.bias"]
    assert torch.allclose(got, expected["classifier.bias"], atol=1e-7)
    other, _ = inner_solve(
        reference, w_1 if init == "warm" else theta_1, w_1, Batch(X[1:], Y[1:]), 2, 0.5, 2.0
    )
    assert not torch.allclose(got, other["classifier.bias"], atol=1e-4)  # the two starts differ


@pytest.mark.parametrize(("mean", "expected"), [("uniform", 5.0), ("samples", 6.0)])
def test_pfedme_server_mixes_with_beta(mean, expected):
    """w^{t+1} = (1 − β) w^t + β mean(w_i), β = 2: w^t = 1, uploads 2 (1 sample) and 4 (3 samples)."""
    alg = make("pfedme", beta=2.0, weights=mean)
    server = {"weights": weights([1.0] * 3, value=1.0, stat=1.0)}
    ups = [upload(0, 1, weights([2.0] * 3, 2.0, stat=2.0)), upload(1, 3, weights([4.0] * 3, 4.0, stat=4.0))]
    new = alg.aggregate(server, ups, RoundInfo(1, None, 0)).state["weights"]
    assert torch.allclose(new["body.weight"], torch.full((2, 2), expected))  # −1 + 2 · mean
    assert torch.allclose(new["classifier.bias"], torch.full((3,), expected))
    mean_stat = 3.0 if mean == "uniform" else 3.5
    assert torch.allclose(new["stat"], torch.full((2,), mean_stat))  # buffers: the mean, no β
    assert torch.equal(server["weights"]["body.weight"], torch.ones(2, 2))


# -------------------------------------------------------------------------------------------- Per-FedAvg
def quadratic(params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    """f_D(w) = h_D/2 ‖w − c_D‖² with h_D = mean(x), c_D = mean(y): ∇f = h_D (w − c_D), ∇²f = h_D I."""
    return 0.5 * x.mean() * (params["w"] - y.mean()).pow(2).sum()


@pytest.mark.parametrize(
    ("hvp", "expected"),
    [("none", [0.3, -1.3]), ("exact", [0.21, -0.91]), ("finite_difference", [0.21, -0.91])],
)
def test_perfedavg_meta_gradient_on_a_quadratic(hvp, expected):
    """w = [1, −1], α = 0.1; D: h = 2, c = 0 → w̃ = [0.8, −0.8]; D': h = 1, c = 0.5 → ∇f(w̃) = [0.3, −1.3];
    D'': h = 3 → (I − α·3) [0.3, −1.3] = [0.21, −0.91]."""
    parts = [
        (torch.tensor([2.0]), torch.tensor([0.0])),
        (torch.tensor([1.0]), torch.tensor([0.5])),
        (torch.tensor([3.0]), torch.tensor([7.0])),
    ]
    g, value = meta_gradient(quadratic, {"w": torch.tensor([1.0, -1.0])}, parts, 0.1, hvp)  # type: ignore[arg-type]
    assert torch.allclose(g["w"], torch.tensor(expected), atol=5e-4 if hvp == "finite_difference" else 1e-6)
    assert value.item() == pytest.approx(0.89)  # 1/2 (0.3² + 1.3²)


def test_perfedavg_cuts_the_batch_into_independent_parts():
    batch = Batch(torch.arange(10.0).view(5, 2), torch.arange(5))
    assert [p[1].tolist() for p in batch_parts(batch, 2)] == [[0, 1, 2], [3, 4]]
    assert [p[1].tolist() for p in batch_parts(batch, 3)] == [[0, 1], [2, 3], [4]]
    assert [p[1].tolist() for p in batch_parts(Batch(batch.x[:1], batch.y[:1]), 2)] == [[0], [0]]


def test_perfedavg_fo_step_on_the_model():
    """FO, α = 0.3, β = 0.1, w = 0: w̃ = −α(softmax(0) − e_0) = [0.2, −0.1, −0.1] on D = (x_0, 0); then
    w ← −β (softmax(w̃) − e_2) on D' = (x_1, 2)."""
    alg = make("perfedavg", alpha=0.3, variant="fo")
    model = Tiny()
    step = step_of(alg, model, payload_of(weights([0.0] * 3)), {})
    loss = sgd_step(alg, step, Batch(X, Y), lr=0.1)
    assert loss.item() == pytest.approx(1.2089182, abs=1e-6)  # f̃(w̃; D') = −log softmax(w̃)_2
    assert close(model.classifier.bias.detach(), [-0.0402960, -0.0298520, 0.0701480])


def test_perfedavg_hf_surrogate_gradient_is_the_second_order_maml_gradient():
    """With the exact HVP the engine's gradient is ∇f(w̃; D') − α ∇²f(w; D'') ∇f(w̃; D'), checked against
    torch.autograd's double backward on a random tiny model."""
    torch.manual_seed(0)
    alg = make("perfedavg", alpha=0.2, variant="hf")
    model = Tiny()
    x, y = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    loss = alg.local_loss(step_of(alg, model, payload_of(model.state_dict()), {}), Batch(x, y))
    got = torch.autograd.grad(loss, list(model.parameters()))
    ps = list(model.parameters())
    g0 = torch.autograd.grad(F.cross_entropy(model(x[:2]), y[:2]), ps)
    ref = Tiny()
    load_state(ref, {n: p.detach() - 0.2 * g for (n, p), g in zip(model.named_parameters(), g0, strict=True)})
    g1 = torch.autograd.grad(F.cross_entropy(ref(x[2:4]), y[2:4]), list(ref.parameters()))
    g2 = torch.autograd.grad(F.cross_entropy(model(x[4:]), y[4:]), ps, create_graph=True)
    hv = torch.autograd.grad(g2, ps, grad_outputs=g1)
    for a, b, h in zip(got, g1, hv, strict=True):
        assert torch.allclose(a, b - 0.2 * h, atol=1e-6)


def test_perfedavg_stale_personal_model_is_one_alpha_step_from_the_received_model():
    """``eval_adapt: stale`` (the former procedure; the default adapts at evaluation,
    tests/test_eval_adaptation.py): d_i = −α ∇f(w_k; D) at the received w_k = 0 over the client's two samples
    (labels 0 and 2): ∇_bias = [1/3, 1/3, 1/3] − [1/2, 0, 1/2]; evaluated as w + d_i for the current w."""
    fresh = make("perfedavg", alpha=0.3)
    step = step_of(fresh, Tiny(), payload_of(weights([0.0] * 3)), {})
    assert "adapt" not in fresh.finish_local(step, LocalResult(steps=1, loss=0.0, lr=0.1)).state
    alg = make("perfedavg", alpha=0.3, eval_adapt="stale")
    model = Tiny()
    received = payload_of(weights([0.0] * 3))
    step = step_of(alg, model, received, {})
    load_state(model, weights([5.0] * 3, value=1.0))  # the trained model is not where d_i is taken
    out = alg.finish_local(step, LocalResult(steps=1, loss=0.0, lr=0.1))
    assert close(out.state["adapt"]["classifier.bias"], [0.05, -0.1, 0.05])
    assert torch.equal(out.state["adapt"]["body.weight"], torch.zeros(2, 2))
    assert close(out.upload.model_state()["classifier.bias"], [5.0, 5.0, 5.0])
    now = payload_of(weights([1.0, 2.0, 3.0]))
    assert close(alg.eval_weights(now, out.state)["classifier.bias"], [1.05, 1.9, 3.05])
    assert close(alg.eval_weights(now, None)["classifier.bias"], [1.0, 2.0, 3.0])
    assert close(alg.eval_weights(now, {})["classifier.bias"], [1.0, 2.0, 3.0])  # never trained


@pytest.mark.parametrize(("mean", "expected"), [("uniform", 3.0), ("samples", 3.5)])
def test_perfedavg_server_averages_uniformly_by_default(mean, expected):
    alg = make("perfedavg", weights=mean)
    ups = [upload(0, 1, weights([2.0] * 3, 2.0)), upload(1, 3, weights([4.0] * 3, 4.0))]
    server = {"weights": weights([1.0] * 3, 1.0)}
    new = alg.aggregate(server, ups, RoundInfo(1, None, 0)).state["weights"]
    assert torch.allclose(new["classifier.weight"], torch.full((3, 2), expected))


# -------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "hyper", "below"),
    [
        ("ditto", {}, 0.05),
        ("pfedme", {}, 0.25),  # still well behind after 8 rounds at these settings (measured 0.17 under)
        ("perfedavg", {}, 0.1),
        ("perfedavg", {"variant": "fo"}, 0.1),
    ],
)
def test_personalized_methods_learn_on_digits_and_keep_up_with_local(name, hyper, below):
    """Paired with the run's untrained model (0.118) and with Local (every client alone, 0.886) on the same
    seed and partition, at most ``below`` under it. Measured at seed 0: Ditto 0.909, pFedMe 0.713,
    Per-FedAvg 0.923 (HF) and 0.844 (FO) with α = β = client.lr (issue 52; 0.847 and 0.865 at the former
    α = 0.001)."""
    raw = digits_run({"name": name, **hyper}, rounds=8, protocol="personalized")
    assert_paired(run_paired(raw), baseline_accuracy(raw, {"name": "local"}), below)
