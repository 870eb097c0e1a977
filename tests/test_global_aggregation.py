"""FedNova, q-FedAvg and SCAFFOLD option I: their defining updates on a tiny linear model, by hand.

Each test calls the hooks directly (no engine) and compares with the papers' formulas written out with
literal numbers, so a wrong sign, factor or weighting fails. The Tiny model has 10 parameters (body 2x2,
classifier 2x2 + 2) and one 2-float buffer ``stat``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import fedskew.algorithms.fedavg
import fedskew.algorithms.fednova
import fedskew.algorithms.qfedavg
import fedskew.algorithms.scaffold  # noqa: F401  (the imports register the algorithms)
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    Context,
    LocalResult,
    LocalStep,
    Payload,
    Upload,
    model_arrays,
)
from fedskew.algorithms.fednova import NORMALIZED_PREFIX, normalizer
from fedskew.algorithms.qfedavg import DELTA_PREFIX, LOSS_KEY, dataset_loss
from fedskew.algorithms.scaffold import CONTROL_PREFIX
from fedskew.engine.sgd import SGD
from fedskew.settings import ClientSection
from tests.paired import Paired, assert_paired, baseline_accuracy, digits_run, run_paired
from tests.test_baselines_math import (
    PARAM_NAMES,
    Tiny,
    assert_params,
    assert_unchanged,
    const_model,
    const_state,
    info,
    offsets,
    snapshot,
    upload,
    view,
)


def context(momentum: float = 0.0, weight_decay: float = 0.0) -> Context:
    torch.manual_seed(0)
    return Context(
        num_clients=4,
        num_classes=2,
        in_shape=(2,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, batch_size=2, lr=0.1, momentum=momentum, weight_decay=weight_decay),
        client_sizes=torch.tensor([1, 3, 2, 2]),
        class_counts=torch.ones(4, 2, dtype=torch.long),
        rounds=3,
        seed=0,
        build_model=lambda cid: Tiny(),
    )


def make(name: str, ctx: Context, **params: object) -> Algorithm:
    cls = ALGORITHMS.get(name)
    return cls(cls.Params(**params), ctx)


def empty_view(cid: int = 0) -> ClientView:
    return ClientView(
        cid, torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    )


def step_for(model: Tiny, x: dict[str, Tensor], cid: int = 0, client: ClientView | None = None, **derived):
    payload = Payload(arrays=model_arrays(x))
    return LocalStep(model, payload, {}, client or view(cid), info(1, cid), derived=derived)


def as_upload(out_payload: Payload, cid: int, n: int) -> Upload:
    return Upload(cid=cid, num_samples=n, payload=out_payload)


# ============================================================================================== FedNova
def test_fednova_registered_with_paper_defaults() -> None:
    p = ALGORITHMS.get("fednova").Params()
    assert (p.mu, p.tau_eff, p.buffers) == (0.0, "normalizer", "mean")
    cls = ALGORITHMS.get("fednova")
    assert cls.mean_aggregation and cls.vectorizable and cls.loss_reads == frozenset({"payload"})


def test_fednova_normalizer_special_cases() -> None:
    assert normalizer(5) == 5.0  # vanilla SGD: ‖a‖₁ = τ
    # momentum ρ = 0.5: [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ); τ = 2: (2 − 0.75)/0.5; τ = 5: (5 − 0.96875)/0.5
    assert normalizer(2, 0.5) == pytest.approx(2.5)  # = (1 + 0.5) + 1
    assert normalizer(5, 0.5) == pytest.approx(8.0625)  # = 1.9375 + 1.875 + 1.75 + 1.5 + 1
    # proximal ημ = 0.1: [1 − 0.9^τ]/0.1
    assert normalizer(2, 0.0, 0.1) == pytest.approx(1.9)
    assert normalizer(5, 0.0, 0.1) == pytest.approx(4.0951)
    # both: x − y_2 = η(b_1 + b_2), b_1 = g_1, b_2 = 0.5 g_1 + g_2 − 0.1 g_1: ‖a‖₁ = 1.4 + 1 = 2.4
    assert normalizer(2, 0.5, 0.1) == pytest.approx(2.4)
    assert normalizer(5, 0.5, 1e-12) == pytest.approx(8.0625)  # the recursion meets both closed forms
    assert normalizer(5, 1e-12, 0.1) == pytest.approx(4.0951)
    assert normalizer(0, 0.5, 0.1) == 0.0


@pytest.mark.parametrize(("tau", "rho", "mu"), [(2, 0.0, 0.0), (5, 0.5, 0.0), (5, 0.0, 1.0), (7, 0.9, 0.5)])
def test_fednova_normalizer_is_the_engines_sgd_under_a_constant_gradient(
    tau: int, rho: float, mu: float
) -> None:
    """With loss ⟨v, w⟩ + μ/2‖w − x‖² the gradient part is the constant v, so x − y_τ = η ‖a‖₁ v exactly."""
    eta, v = 0.1, torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    x = torch.tensor([0.3, 0.1, -0.4], dtype=torch.float64)
    w = x.clone().requires_grad_(True)
    opt = SGD([w], eta, rho, 0.0)
    for _ in range(tau):
        opt.zero_grad()
        ((v * w).sum() + 0.5 * mu * (w - x).pow(2).sum()).backward()
        opt.step()
    assert torch.allclose(
        (x - w.detach()) / (eta * v), torch.full((3,), normalizer(tau, rho, eta * mu), dtype=torch.float64)
    )


def fednova_round(alg: Algorithm, steps: tuple[int, int]) -> tuple[list[Upload], dict]:
    """Clients 0 (n = 1) and 1 (n = 3) from x = 0 to y_0 = −0.2 (stat 1) and y_1 = 1.0 (stat 3)."""
    x = const_state(0.0, 0.0)
    server = alg.init_server(const_model(0.0, 0.0))
    ups = []
    for cid, n, y, stat, tau in [(0, 1, -0.2, 1.0, steps[0]), (1, 3, 1.0, 3.0, steps[1])]:
        out = alg.finish_local(step_for(const_model(y, stat), x, cid), LocalResult(tau, 0.0, 0.1))
        ups.append(as_upload(out.upload, cid, n))
    return ups, server


def normalized(up: Upload) -> dict[str, Tensor]:
    return {
        k[len(NORMALIZED_PREFIX) :]: v
        for k, v in up.payload.arrays.items()
        if k.startswith(NORMALIZED_PREFIX)
    }


def test_fednova_unequal_steps_without_momentum() -> None:
    alg = make("fednova", context())
    ups, server = fednova_round(alg, (2, 5))
    assert ups[0].payload.config == {"a": 2.0} and ups[1].payload.config == {"a": 5.0}
    assert_params(normalized(ups[0]), -0.1)  # (y − x)/a = −0.2/2
    assert_params(normalized(ups[1]), 0.2)  # 1.0/5
    assert set(normalized(ups[0])) == set(PARAM_NAMES)  # the buffer travels as model state
    assert torch.equal(ups[0].payload.model_state()["stat"], torch.full((2,), 1.0))
    # the upload counts as y_i would: 10 parameters + the buffer, one config value
    assert ups[0].payload.num_params() == 12 and ups[0].payload.nbytes() == 4 * 12 + 8
    before, ups_before = snapshot(server), [snapshot(u.payload.arrays) for u in ups]
    update = alg.aggregate(server, ups, info(1))
    # p = (1/4, 3/4): τ_eff = 0.25·2 + 0.75·5 = 4.25; x = 0 + 4.25·(0.25·(−0.1) + 0.75·0.2) = 0.53125
    assert update.metrics["tau_eff"] == pytest.approx(4.25)
    assert_params(update.state["weights"], 0.53125)
    assert torch.allclose(update.state["weights"]["stat"], torch.full((2,), 2.5))  # 0.25·1 + 0.75·3
    fedavg = make("fedavg", context()).aggregate(server, ups_as_models(ups, server), info(1)).state
    assert_params(fedavg["weights"], 0.7)  # FedAvg would give 0.25·(−0.2) + 0.75·1.0
    assert_unchanged(server, before)
    for u, b in zip(ups, ups_before, strict=True):
        assert_unchanged(u.payload.arrays, b)


def ups_as_models(ups: list[Upload], server: dict) -> list[Upload]:
    """The FedAvg uploads of the same clients: y_i = x + a_i·(normalised update)."""
    out = []
    for u in ups:
        a, x = u.payload.config["a"], server["weights"]
        y = {**u.payload.model_state(), **{k: x[k] + a * d for k, d in normalized(u).items()}}
        out.append(upload(u.cid, u.num_samples, y))
    return out


def test_fednova_unequal_steps_with_momentum() -> None:
    alg = make("fednova", context(momentum=0.5))
    ups, server = fednova_round(alg, (2, 5))
    assert ups[0].payload.config["a"] == pytest.approx(2.5)
    assert ups[1].payload.config["a"] == pytest.approx(8.0625)
    assert_params(normalized(ups[0]), -0.08)  # −0.2/2.5
    assert_params(normalized(ups[1]), 1 / 8.0625)
    update = alg.aggregate(server, ups, info(1))
    tau_eff = 0.25 * 2.5 + 0.75 * 8.0625  # 6.671875
    assert update.metrics["tau_eff"] == pytest.approx(6.671875)
    assert_params(update.state["weights"], tau_eff * (0.25 * -0.08 + 0.75 / 8.0625), rel=1e-5)  # 0.487202
    assert_params(update.state["weights"], 0.4872020, rel=1e-5)


def test_fednova_with_equal_steps_and_no_momentum_is_fedavg() -> None:
    alg, fedavg = make("fednova", context()), make("fedavg", context())
    ups, server = fednova_round(alg, (3, 3))
    nova = alg.aggregate(server, ups, info(1)).state["weights"]
    avg = fedavg.aggregate(server, ups_as_models(ups, server), info(1)).state["weights"]
    assert_params(nova, 0.7)
    for k in avg:
        assert torch.allclose(nova[k], avg[k], atol=1e-6), k


def test_fednova_options_steps_tau_eff_and_normalized_buffers() -> None:
    alg = make("fednova", context(), mu=1.0, tau_eff="steps", buffers="normalized")
    ups, server = fednova_round(alg, (2, 5))
    # ημ = 0.1: a = 1.9 and 4.0951; the authors' code takes τ_eff = Σ p_i τ_i = 4.25 under a proximal term
    assert ups[0].payload.config == pytest.approx({"a": 1.9, "steps": 2.0})
    update = alg.aggregate(server, ups, info(1))
    assert update.metrics["tau_eff"] == pytest.approx(4.25)
    assert_params(update.state["weights"], 4.25 * (0.25 * -0.2 / 1.9 + 0.75 * 1.0 / 4.0951), rel=1e-5)
    assert "stat" in normalized(ups[0])  # NIID-Bench: the buffer normalised and rescaled like a parameter
    expected_stat = 4.25 * (0.25 * 1.0 / 1.9 + 0.75 * 3.0 / 4.0951)
    assert torch.allclose(update.state["weights"]["stat"], torch.full((2,), expected_stat))


def test_fednova_proximal_loss_and_a_client_without_steps() -> None:
    alg = make("fednova", context(), mu=2.0)
    x = const_state(0.0)
    model = const_model(0.5)
    step = step_for(model, x)
    plain = F.cross_entropy(model(view().x), view().y).detach()
    # μ/2 ‖w − x‖² = 1.0 · 10 · 0.25
    assert float(alg.local_loss(step, Batch(view().x, view().y)).detach()) == pytest.approx(
        float(plain) + 2.5, rel=1e-6
    )
    out = alg.finish_local(
        step_for(const_model(0.0), x, client=empty_view()), LocalResult(0, float("nan"), 0.1)
    )
    assert out.upload.config == {"a": 0.0}
    assert_params(normalized(as_upload(out.upload, 0, 0)), 0.0)


# ============================================================================================== q-FedAvg
def test_qfedavg_registered_with_paper_defaults() -> None:
    cls = ALGORITHMS.get("qfedavg")
    assert (cls.Params().q, cls.Params().loss_offset) == (1.0, 0.0)
    assert not cls.mean_aggregation and cls.vectorizable and cls.loss_reads == frozenset()


def test_qfedavg_start_local_measures_the_training_loss_at_the_received_model() -> None:
    alg = make("qfedavg", context())  # batch_size 2: the 3 samples in two batches
    model = Tiny()
    x = {k: v.clone() for k, v in model.state_dict().items()}
    held = snapshot(model.state_dict())
    model.train()
    plan = alg.start_local(step_for(model, x))
    assert_unchanged(dict(model.state_dict()), held)
    assert model.training  # the mode is restored
    expected = F.cross_entropy(model(view().x), view().y).detach()  # the mean over all 3 samples
    assert float(plan.derived[LOSS_KEY]) == pytest.approx(float(expected), rel=1e-6)
    assert float(dataset_loss(model, empty_view(), 2)) == 0.0


def qffl_upload(alg: Algorithm, cid: int, y: float, loss: float, stat: float) -> Upload:
    step = step_for(const_model(y, stat), const_state(0.0), cid, **{LOSS_KEY: torch.tensor(loss)})
    return as_upload(alg.finish_local(step, LocalResult(4, 0.0, 0.1)).upload, cid, 1 + 2 * cid)


def deltas(up: Upload) -> dict[str, Tensor]:
    return {k[len(DELTA_PREFIX) :]: v for k, v in up.payload.arrays.items() if k.startswith(DELTA_PREFIX)}


def test_qfedavg_delta_h_and_the_new_model() -> None:
    alg = make("qfedavg", context(), q=2.0)
    server = alg.init_server(const_model(0.0, 0.0))  # w = 0, η = 0.1: L = 10
    # client 0: w̄ = −0.02, F = 2: ΔW = 10·0.02 = 0.2, ‖ΔW‖² = 10·0.04 = 0.4
    #   Δ = 2²·0.2 = 0.8, h = 2·2¹·0.4 + 10·2² = 41.6
    # client 1: w̄ = 0.05, F = 0.5: ΔW = −0.5, ‖ΔW‖² = 2.5, Δ = 0.25·(−0.5) = −0.125,
    #   h = 2·0.5·2.5 + 10·0.25 = 5
    ups = [qffl_upload(alg, 0, -0.02, 2.0, 1.0), qffl_upload(alg, 1, 0.05, 0.5, 3.0)]
    assert_params(deltas(ups[0]), 0.8, rel=1e-5)
    assert ups[0].payload.config["h"] == pytest.approx(41.6, rel=1e-5)
    assert_params(deltas(ups[1]), -0.125, rel=1e-5)
    assert ups[1].payload.config["h"] == pytest.approx(5.0, rel=1e-5)
    assert ups[0].payload.num_params() == 12 and ups[0].payload.nbytes() == 4 * 12 + 8  # Δ + buffer, h
    before = snapshot(server)
    update = alg.aggregate(server, ups, info(1))
    assert_params(update.state["weights"], -(0.8 - 0.125) / (41.6 + 5.0), rel=1e-5)  # −0.0144850
    assert torch.allclose(update.state["weights"]["stat"], torch.full((2,), 2.5))  # (1·1 + 3·3)/4
    assert update.metrics["qffl_h_sum"] == pytest.approx(46.6, rel=1e-5)
    assert_unchanged(server, before)


def test_qfedavg_with_q_zero_is_uniform_fedavg() -> None:
    alg = make("qfedavg", context(), q=0.0)
    server = alg.init_server(const_model(0.0, 0.0))
    ups = [qffl_upload(alg, 0, -0.02, 2.0, 1.0), qffl_upload(alg, 1, 0.05, 0.5, 3.0)]
    assert ups[0].payload.config["h"] == pytest.approx(10.0) and ups[1].payload.config["h"] == pytest.approx(
        10.0
    )
    new = alg.aggregate(server, ups, info(1)).state["weights"]
    assert_params(new, (-0.02 + 0.05) / 2, rel=1e-5)  # the uniform mean of w̄_k, whatever n_k and F_k
    fedavg = make("fedavg", context())
    equal = [upload(u.cid, 1, const_state(y)) for u, y in zip(ups, (-0.02, 0.05), strict=True)]
    avg = fedavg.aggregate(server, equal, info(1)).state["weights"]
    for k in PARAM_NAMES:
        assert torch.allclose(new[k], avg[k], atol=1e-7)


def test_qfedavg_client_without_data_adds_nothing() -> None:
    alg = make("qfedavg", context(), q=1.0)
    server = alg.init_server(const_model(0.0, 0.0))
    real = qffl_upload(alg, 1, 0.05, 0.5, 3.0)
    step = step_for(
        const_model(0.0), const_state(0.0), 2, client=empty_view(2), **{LOSS_KEY: torch.tensor(0.0)}
    )
    empty = as_upload(alg.finish_local(step, LocalResult(0, float("nan"), 0.1)).upload, 2, 0)
    assert empty.payload.config == {"h": 0.0}
    assert_params(deltas(empty), 0.0)
    both = alg.aggregate(server, [real, empty], info(1)).state["weights"]
    alone = alg.aggregate(server, [real], info(1)).state["weights"]
    for k in PARAM_NAMES:
        assert torch.allclose(both[k], alone[k])
    # every client without data: Σ h = 0, the parameters stay
    assert_params(alg.aggregate(server, [empty], info(1)).state["weights"], 0.0)


# ============================================================================================== SCAFFOLD I
def analytic_gradient(x: dict[str, Tensor], v: ClientView) -> dict[str, Tensor]:
    """∇ of mean CE for logits = C (B u) + b: δ = (softmax − onehot)/n, ∇C = δᵀz, ∇b = Σδ, ∇B = (δC)ᵀu."""
    z = v.x @ x["body.weight"].T
    logits = z @ x["classifier.weight"].T + x["classifier.bias"]
    delta = (logits.softmax(1) - F.one_hot(v.y, 2).float()) / v.num_samples
    return {
        "body.weight": (delta @ x["classifier.weight"]).T @ v.x,
        "classifier.weight": delta.T @ z,
        "classifier.bias": delta.sum(0),
    }


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_scaffold_option_one_sets_the_control_variate_to_the_gradient_at_x(weight_decay: float) -> None:
    alg = make("scaffold", context(weight_decay=weight_decay), control_update="I")
    x = {**{n: 3.0 * d - 0.5 for n, d in offsets().items()}, "stat": torch.zeros(2)}
    server = alg.init_server(Tiny())
    server["weights"] = x
    server["c"] = {n: torch.full_like(v, 0.5) for n, v in server["c"].items()}
    payload = alg.broadcast(server, info(1, 0))
    state = {"c": {n: torch.full_like(v, 0.25) for n, v in server["c"].items()}}
    trained = const_model(-0.2)  # y_i: option I ignores it for c_i⁺
    held = snapshot({"model": dict(trained.state_dict()), "state": state, "payload": payload.arrays})
    step = LocalStep(trained, payload, state, view(0), info(1, 0))
    out = alg.finish_local(step, LocalResult(2, 0.0, 0.1))
    expected = {n: g + weight_decay * x[n] for n, g in analytic_gradient(x, view(0)).items()}
    for n, g in expected.items():
        assert torch.allclose(out.state["c"][n], g, atol=1e-6), n
        assert torch.allclose(out.upload.arrays[CONTROL_PREFIX + n], g - 0.25, atol=1e-6)  # Δc_i = c_i⁺ − c_i
    assert_unchanged({"model": dict(trained.state_dict()), "state": state, "payload": payload.arrays}, held)
    assert_params(out.upload.model_state(), -0.2)  # y_i uploads as in option II
    empty = alg.finish_local(
        LocalStep(trained, payload, state, empty_view(), info(1, 0)), LocalResult(0, 0.0, 0.1)
    )
    assert_params(empty.state["c"], 0.25)  # no data: c_i kept


def test_scaffold_default_is_option_two() -> None:
    assert ALGORITHMS.get("scaffold").Params().control_update == "II"


# ============================================================================================== learning
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "hyper", "below"),
    [
        ("fednova", {}, 0.05),
        # q-FedAvg's step Σ Δ_k / Σ h_k is shorter than FedAvg's (h_k adds q F^{q−1}‖ΔW_k‖²): slower
        ("qfedavg", {"q": 1.0}, 0.25),
        ("qfedavg", {"q": 0.0}, 0.05),
        ("scaffold", {"control_update": "I"}, 0.05),
    ],
)
def test_learns_on_digits_and_keeps_up_with_fedavg(name: str, hyper: dict, below: float) -> None:
    """Paired with the run's untrained model (0.10) and FedAvg's final accuracy on the same seed and
    partition (0.867), ending at most ``below`` under it. Measured at seed 0: FedNova 0.858, q-FedAvg
    0.706 (q = 1) and 0.858 (q = 0), SCAFFOLD (option I) 0.917."""
    raw = digits_run({"name": name, **hyper})
    assert_paired(run_paired(raw), baseline_accuracy(raw, {"name": "fedavg"}), below)


def test_the_paired_check_fails_a_run_that_does_not_learn() -> None:
    """tests/paired.py's check is not vacuous: FedAvg whose learning rate cannot move the weights gains
    nothing over its own untrained model, and a final accuracy under the baseline's margin is refused."""
    still = digits_run({"name": "fedavg"}, rounds=2, client={"epochs": 1, "lr": 1e-7})
    stuck = run_paired(still)
    assert abs(stuck.gain) < 0.05, stuck
    with pytest.raises(AssertionError, match="over the untrained model"):
        assert_paired(stuck)
    learned = Paired(final=0.8, untrained=0.1, summary={}, before={})
    assert_paired(learned, baseline=0.84, below=0.05)  # within the margin
    with pytest.raises(AssertionError, match="baseline 0.860"):
        assert_paired(learned, baseline=0.86, below=0.05)
