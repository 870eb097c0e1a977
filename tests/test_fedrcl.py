"""FedRCL: the relaxed contrastive loss against a hand computation, its SupCon limit, multi-level feature
collection, gradient routing, the algorithm's hooks, and learning on digits."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.base import (
    ALGORITHMS,
    Batch,
    ClientView,
    Context,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    Scratch,
    Upload,
    model_arrays,
)
from fedskew.algorithms.fedrcl import (
    DIAG_KEYS,
    collect_features,
    level_names,
    relaxed_contrastive_loss,
    supervised_contrastive_loss,
)
from fedskew.models.base import MODELS
from fedskew.settings import ClientSection
from tests.paired import assert_paired, baseline_accuracy, digits_run, run_paired


def rcl_by_hand(z: torch.Tensor, y: list[int], tau: float, lam: float, w: float) -> float:
    """Per anchor i with P_i ≠ ∅: −(1/|P_i|) Σ_p log(e^{s_ip/τ} / Σ_{a≠i} e^{s_ia/τ})
    + w · (−log(e^{1/τ} / (e^{1/τ} + Σ_{j∈P_i, s_ij>λ} e^{s_ij/τ}))); mean over those anchors."""
    zn = [[c / math.sqrt(sum(c * c for c in v)) for c in v] for v in z.tolist()]
    s = [[sum(a * b for a, b in zip(u, v, strict=True)) for v in zn] for u in zn]
    per_anchor = []
    for i in range(len(y)):
        pos = [j for j in range(len(y)) if j != i and y[j] == y[i]]
        if not pos:
            continue
        denom = sum(math.exp(s[i][a] / tau) for a in range(len(y)) if a != i)
        scl = -sum(math.log(math.exp(s[i][p] / tau) / denom) for p in pos) / len(pos)
        over = [j for j in pos if s[i][j] > lam]
        pen = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + sum(math.exp(s[i][j] / tau) for j in over)))
        per_anchor.append(scl + w * pen)
    return sum(per_anchor) / len(per_anchor)


# ------------------------------------------------------------------------------------------------- loss
def test_loss_matches_hand_computation_with_and_without_active_penalty() -> None:
    tau, lam = 0.5, 0.7
    y = [0, 0, 1, 1, 2]  # anchor 4 has no positive and is left out
    # class 0: two nearly parallel vectors (cos ≈ 0.995 > λ: penalty active); class 1: cos = 0 (inactive)
    z = torch.tensor(
        [[1.0, 0.1, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [-1.0, -1.0, 0.0]],
        dtype=torch.float64,
    )
    got = relaxed_contrastive_loss(z, torch.tensor(y), tau=tau, threshold=lam, penalty_weight=0.8)
    assert float(got) == pytest.approx(rcl_by_hand(z, y, tau, lam, 0.8), rel=1e-10)
    # the penalty is active for class 0 only: it changes the loss
    base = relaxed_contrastive_loss(z, torch.tensor(y), tau=tau, threshold=lam, penalty_weight=0.0)
    s01 = float(F.cosine_similarity(z[0], z[1], dim=0))
    assert s01 > lam
    penalty = math.log1p(math.exp((s01 - 1) / tau))  # D(0) = D(1); D(2) = D(3) = 0; mean over 4 anchors
    assert float(got - base) == pytest.approx(0.8 * 2 * penalty / 4, rel=1e-9)


def test_penalty_inactive_when_every_positive_is_below_threshold() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    # λ = 1 can never be exceeded: the penalty vanishes whatever its weight
    on = relaxed_contrastive_loss(z, y, tau=0.1, threshold=1.0, penalty_weight=5.0)
    assert float(on) == pytest.approx(rcl_by_hand(z, y.tolist(), 0.1, 1.0, 5.0), rel=1e-10)
    assert float(on) == pytest.approx(float(supervised_contrastive_loss(z, y, tau=0.1)), rel=1e-12)
    # λ = −1: every positive pair is penalised (the hand formula again)
    all_on = relaxed_contrastive_loss(z, y, tau=0.1, threshold=-1.0, penalty_weight=1.0)
    assert float(all_on) == pytest.approx(rcl_by_hand(z, y.tolist(), 0.1, -1.0, 1.0), rel=1e-10)


def test_zero_penalty_weight_is_supcon() -> None:
    """w = 0: Khosla et al.'s L_out, −mean_{p∈P_i} log softmax_{a≠i}(s_ia/τ)[p], averaged over anchors."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(10, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    zn = F.normalize(z, dim=1)
    logits = (zn @ zn.T / 0.05).fill_diagonal_(float("-inf"))
    logp = logits.log_softmax(1)
    ref = []
    for i in range(10):
        pos = [j for j in range(10) if j != i and y[j] == y[i]]
        if pos:
            ref.append(-logp[i, pos].mean())
    expected = torch.stack(ref).mean()
    got = relaxed_contrastive_loss(z, y, tau=0.05, threshold=0.0, penalty_weight=0.0)
    assert float(got) == pytest.approx(float(expected), rel=1e-10)
    assert float(supervised_contrastive_loss(z, y, tau=0.05)) == pytest.approx(float(expected), rel=1e-10)


def test_no_positive_in_batch_gives_zero_with_graph() -> None:
    z = torch.randn(3, 4, requires_grad=True)
    loss = relaxed_contrastive_loss(z, torch.tensor([0, 1, 2]))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(z.grad, torch.zeros_like(z))


# ----------------------------------------------------------------------------------------------- levels
def test_levels_of_cnn_fedproto_and_resnet8() -> None:
    cnn = MODELS.get("cnn_fedproto")((1, 28, 28), 10)
    x = torch.randn(5, 1, 28, 28)
    z, levels = collect_features(cnn, x)
    assert level_names(cnn) == ["body.0.2", "body.0.6", "body.2"]  # conv block 1, conv block 2, fc 50
    assert [tuple(h.shape) for h in levels] == [(5, 10), (5, 20), (5, 50)]
    assert z.shape == (5, 50)
    # pre-activation: the last level is the fc output before its ReLU, the embedding is after it
    assert torch.allclose(F.relu(levels[-1]), z)
    z_post, post = collect_features(cnn.eval(), x, pre_activation=False)
    assert torch.allclose(post[-1], z_post) and bool((post[0] >= 0).all())

    net = MODELS.get("resnet8")((3, 32, 32), 10, width=8).eval()
    xr = torch.randn(3, 3, 32, 32)
    z, levels = collect_features(net, xr)
    assert level_names(net) == ["stem", "layer1", "layer2", "layer3"]
    assert [tuple(h.shape) for h in levels] == [(3, 8), (3, 8), (3, 16), (3, 32)]
    # post-activation, the last level (ReLU of the last stage, then pooled) is the embedding
    _, post = collect_features(net, xr, pre_activation=False)
    assert torch.allclose(post[-1], z, atol=1e-6)
    # selections: the embedding only, and indices
    z_e, only = collect_features(net, xr, layers="embedding")
    assert len(only) == 1 and only[0] is z_e
    _, picked = collect_features(net, xr, layers=[0, 3])
    assert [h.shape[1] for h in picked] == [8, 32]
    with pytest.raises(ValueError, match="4 levels"):
        collect_features(net, xr, layers=[7])


def test_feature_hooks_are_removed_after_the_pass(monkeypatch) -> None:
    """Every forward hook ``collect_features`` registers is removed again after the pass."""
    handles = []
    register = torch.nn.Module.register_forward_hook

    def recording(self, hook, *args, **kwargs):
        handle = register(self, hook, *args, **kwargs)
        handles.append(handle)
        return handle

    monkeypatch.setattr(torch.nn.Module, "register_forward_hook", recording)
    for net, x in (
        (MODELS.get("resnet8")((3, 32, 32), 10, width=8).eval(), torch.randn(2, 3, 32, 32)),
        (MODELS.get("cnn_fedproto")((1, 28, 28), 10).eval(), torch.randn(2, 1, 28, 28)),
    ):
        handles.clear()
        collect_features(net, x)
        assert handles  # the levels were captured by hooks
        assert all(h.id not in h.hooks_dict_ref() for h in handles)


# ----------------------------------------------------------------------------------------------- hooks
def _ctx(num_classes: int = 10) -> Context:
    return Context(
        num_clients=2,
        num_classes=num_classes,
        in_shape=(1, 28, 28),
        device=torch.device("cpu"),
        client=ClientSection(),
        client_sizes=torch.tensor([5, 3]),
        class_counts=torch.ones(2, num_classes, dtype=torch.long),
        rounds=1,
        seed=0,
        build_model=lambda cid: MODELS.get("cnn_fedproto")((1, 28, 28), num_classes),
    )


def _view(x: torch.Tensor, y: torch.Tensor, cid: int = 0) -> ClientView:
    return ClientView(cid, x, y, torch.bincount(y, minlength=10))


def test_local_loss_is_ce_plus_beta_times_mean_over_levels_and_gradients_route() -> None:
    torch.manual_seed(0)
    cls = ALGORITHMS.get("fedrcl")
    assert cls.Params().model_dump() == {
        "beta": 1.0,
        "tau": 0.05,
        "threshold": 0.7,
        "penalty_weight": 1.0,
        "layers": "all",
        "layer_reduction": "mean",
        "pre_activation": True,
    }
    alg = cls(cls.Params(beta=0.5, tau=0.2, threshold=0.3), _ctx())
    model = MODELS.get("cnn_fedproto")((1, 28, 28), 10, dropout=0.0)
    x, y = torch.randn(6, 1, 28, 28), torch.tensor([0, 0, 1, 1, 1, 2])
    step = LocalStep(model=model, payload=Payload(), state={}, client=_view(x, y), info=RoundInfo(1, 0, 0))
    step = step.replace(scratch=Scratch(alg.init_scratch(step)))
    scratch = step.scratch
    loss = alg.local_loss(step, Batch(x, y))
    with torch.no_grad():
        z, levels = collect_features(model, x)
        rcl = [relaxed_contrastive_loss(h, y, 0.2, 0.3, 1.0) for h in levels]
        expected = F.cross_entropy(model.head(z), y) + 0.5 * torch.stack(rcl).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert set(scratch["diag"].shape) == {5}

    # gradient routing: the contrastive term reaches every body parameter and never the classifier
    model.zero_grad()
    _, levels = collect_features(model, x)
    torch.stack([relaxed_contrastive_loss(h, y, 0.2, 0.3) for h in levels]).mean().backward()
    for name, p in model.named_parameters():
        if name.startswith("classifier."):
            assert p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    # the first conv block's level depends only on conv1: conv2/fc get nothing from level 0's loss
    model.zero_grad()
    _, levels = collect_features(model, x)
    relaxed_contrastive_loss(levels[0], y, 0.2, 0.3).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["body.0.0.weight"].abs().sum() > 0
    assert grads["body.0.3.weight"] is None and grads["body.1.weight"] is None


def test_penalty_gradient_pushes_only_over_similar_positives_apart() -> None:
    # anchor pairs: (0, 1) at cos 0.96 > λ, (2, 3) at cos 0.6 < λ; penalty alone (SCL subtracted)
    a = torch.tensor([[1.0, 0.0], [0.96, 0.28], [0.0, 1.0], [0.8, 0.6]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1])
    za = a.clone().requires_grad_(True)
    pen = relaxed_contrastive_loss(za, y, 0.1, 0.7, 1.0) - relaxed_contrastive_loss(za, y, 0.1, 0.7, 0.0)
    pen.backward()
    g = za.grad
    assert g[2:].abs().max() < 1e-12  # class 1 is below λ: no penalty gradient
    # descending the gradient lowers the similarity of the over-similar pair
    step = a - 0.01 * g
    assert float(F.cosine_similarity(step[0], step[1], dim=0)) < float(F.cosine_similarity(a[0], a[1], dim=0))


def test_aggregate_is_fedavg_and_diagnostics_are_logged() -> None:
    torch.manual_seed(0)
    cls = ALGORITHMS.get("fedrcl")
    alg = cls(cls.Params(), _ctx())
    model = MODELS.get("cnn_fedproto")((1, 28, 28), 10, dropout=0.0)
    server = alg.init_server(model)
    payload = alg.broadcast(server, RoundInfo(1, 0, 0))
    x, y = torch.randn(8, 1, 28, 28), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    view, info = _view(x, y), RoundInfo(1, 0, 0)
    state: dict = {}
    step = LocalStep(model=model, payload=payload, state=state, client=view, info=info)
    plan = alg.start_local(step)
    step = step.replace(derived=plan.derived)
    step = step.replace(scratch=Scratch(alg.init_scratch(step)))
    alg.local_loss(step, Batch(x, y))
    out = alg.finish_local(step, LocalResult(1, 0.0, 0.1))
    assert out.state == {}  # FedRCL keeps no client state
    up = out.upload
    # diagnostics are metrics (logged, not counted): the upload is the model alone
    assert set(up.metrics) == set(DIAG_KEYS) == {"rcl_scl", "rcl_penalty", "rcl_active_pairs", "rcl_pos_sim"}
    assert up.config == {}
    assert up.nbytes() == 4 * sum(v.numel() for v in model.state_dict().values())
    # the diagnostics of the one (last-epoch) batch, by hand: SCL mean over the levels, pair statistics of
    # the last level (τ = 0.05, λ = 0.7)
    with torch.no_grad():
        _, levels = collect_features(model, x)
        scl = torch.stack([supervised_contrastive_loss(h, y, 0.05) for h in levels]).mean()
        zn = F.normalize(levels[-1], dim=1)
        sim = zn @ zn.T
        pos = (y[:, None] == y[None, :]) & ~torch.eye(8, dtype=torch.bool)
    assert up.metrics["rcl_scl"] == pytest.approx(float(scl), rel=1e-5)
    assert up.metrics["rcl_active_pairs"] == pytest.approx(float((pos & (sim > 0.7)).sum() / pos.sum()))
    assert up.metrics["rcl_pos_sim"] == pytest.approx(float(sim[pos].mean()), rel=1e-5)
    other = {k: v + 1.0 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    ups = [
        Upload(0, 3, up),
        Upload(1, 1, Payload(arrays=model_arrays(other), metrics=dict(up.metrics, rcl_scl=0.0))),
    ]
    update = alg.aggregate(server, ups, RoundInfo(1, None, 0))
    # aggregate returns a new state, without the diagnostics (the round's metrics)
    assert set(update.state) == set(server) == {"weights"}
    w = model.state_dict()["classifier.1.weight"]
    assert torch.allclose(update.state["weights"]["classifier.1.weight"], w + 0.25, atol=1e-6)
    assert set(update.metrics) == set(DIAG_KEYS)
    assert update.metrics["rcl_scl"] == pytest.approx(0.75 * up.metrics["rcl_scl"])


def test_no_batch_run_uploads_no_diagnostics() -> None:
    """epochs = 0 (no batch): the upload carries the received model and no diagnostics to average."""
    cls = ALGORITHMS.get("fedrcl")
    alg = cls(cls.Params(), _ctx())
    model = MODELS.get("cnn_fedproto")((1, 28, 28), 10)
    payload = alg.broadcast(alg.init_server(model), RoundInfo(1, 0, 0))
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 0, 1, 1])
    view, info = _view(x, y), RoundInfo(1, 0, 0)
    step = LocalStep(model=model, payload=payload, state={}, client=view, info=info)
    step = step.replace(scratch=Scratch(alg.init_scratch(step)))
    out = alg.finish_local(step, LocalResult(0, float("nan"), 0.1))
    assert out.upload.metrics == {}
    assert all(torch.equal(v, payload.arrays[k]) for k, v in out.upload.arrays.items())


# ---------------------------------------------------------------------------------------------- learning
def test_fedrcl_learns_on_digits_and_beats_fedavg(tmp_path) -> None:
    """Paired with the run's untrained model (0.10) and FedAvg on the same seed and partition: measured at
    seed 0, FedRCL 0.939 and FedAvg 0.867."""
    raw = digits_run({"name": "fedrcl"})  # mlp_mpfedcl: three levels (512, 512, 256)
    paired = run_paired(raw, tmp_path / "rcl")
    assert_paired(paired, baseline_accuracy(raw, {"name": "fedavg"}), below=-0.03)  # at least 0.03 above
    summary = paired.summary
    record = json.loads((tmp_path / "rcl" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= record["rcl_active_pairs"] <= 1.0 and record["rcl_scl"] > 0.0
    # the diagnostics are metrics, not counted: 8 rounds x 5 clients upload the float32 MLP only,
    # (64·512 + 512) + (512·512 + 512) + (512·256 + 256) + (256·10 + 10) = 429,834 parameters
    assert summary["bytes_up"] == 8 * 5 * 4 * 429_834
