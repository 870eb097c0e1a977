"""The classic baselines' defining updates, on a tiny linear model with hand-computed numbers.

Each test calls an algorithm's hooks directly (no engine). Expected values are written out from the papers'
update rules with literal numbers, so a wrong sign, factor or weighting makes a test fail.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fedskew.algorithms.fedavg
import fedskew.algorithms.feddyn
import fedskew.algorithms.fedopt
import fedskew.algorithms.fedprox
import fedskew.algorithms.local
import fedskew.algorithms.moon
import fedskew.algorithms.scaffold  # noqa: F401  (the imports register the algorithms)
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    Context,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    RoundInfo,
    Scratch,
    Upload,
    load_state,
    model_arrays,
)
from fedskew.algorithms.moon import model_contrastive_loss
from fedskew.algorithms.scaffold import CONTROL_PREFIX
from fedskew.errors import ConfigError
from fedskew.models.base import FedModel
from fedskew.settings import ClientSection

PARAM_NAMES = ("body.weight", "classifier.weight", "classifier.bias")
NUM_PARAMS = 4 + 4 + 2  # body 2x2, classifier 2x2 + 2


class Tiny(FedModel):
    """features = a 2x2 linear map, head = a 2-class linear classifier, plus one float buffer."""

    embed_dim = 2

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.classifier = nn.Linear(2, 2)
        self.register_buffer("stat", torch.zeros(2))

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def head(self, z: Tensor) -> Tensor:
        return self.classifier(z)


@pytest.fixture
def ctx() -> Context:
    torch.manual_seed(0)
    built: list[int | None] = []

    def build(cid: int | None) -> nn.Module:
        built.append(cid)
        return Tiny()

    c = Context(
        num_clients=4,
        num_classes=2,
        in_shape=(2,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, batch_size=2, lr=0.1),
        client_sizes=torch.tensor([1, 3, 2, 2]),
        class_counts=torch.ones(4, 2, dtype=torch.long),
        rounds=3,
        seed=0,
        build_model=build,
    )
    c.built = built  # type: ignore[attr-defined]  (lets tests count model builds)
    return c


def make(name: str, ctx: Context, **params: float) -> Algorithm:
    cls = ALGORITHMS.get(name)
    return cls(cls.Params(**params), ctx)


def const_state(value: float, stat: float = 0.0) -> dict[str, Tensor]:
    """A Tiny state dict with every parameter entry equal to ``value``."""
    state = {k: torch.full_like(v, value) for k, v in Tiny().state_dict().items()}
    state["stat"] = torch.full((2,), stat)
    return state


def const_model(value: float, stat: float = 0.0) -> Tiny:
    m = Tiny()
    load_state(m, const_state(value, stat))
    return m


def upload(cid: int, n: int, state: dict[str, Tensor], extra: dict[str, Tensor] | None = None) -> Upload:
    arrays = {**model_arrays({k: v.clone() for k, v in state.items()}), **(extra or {})}
    return Upload(cid=cid, num_samples=n, payload=Payload(arrays=arrays))


def info(round_idx: int = 1, cid: int | None = None) -> RoundInfo:
    """Where a hook runs (``cid=None``: the server, or a broadcast for global evaluation)."""
    return RoundInfo(round=round_idx, cid=cid, seed=0)


def snapshot(tree: object) -> object:
    """A deep copy of a nested dict / list of tensors and small values (to check a hook did not mutate it)."""
    if isinstance(tree, Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(snapshot(v) for v in tree)
    return tree


def assert_unchanged(tree: object, before: object) -> None:
    """``tree`` still equals its :func:`snapshot` ``before``: same keys, bit-identical tensors."""
    if isinstance(before, Tensor):
        assert isinstance(tree, Tensor) and torch.equal(tree, before)
    elif isinstance(before, dict):
        assert isinstance(tree, dict) and set(tree) == set(before)
        for k in before:
            assert_unchanged(tree[k], before[k])
    elif isinstance(before, (list, tuple)):
        assert len(tree) == len(before)  # type: ignore[arg-type]
        for a, b in zip(tree, before, strict=True):  # type: ignore[call-overload]
            assert_unchanged(a, b)
    else:
        assert tree == before


def assert_params(weights: dict[str, Tensor], value: float, rel: float = 1e-6) -> None:
    for k in PARAM_NAMES:
        assert torch.allclose(weights[k], torch.full_like(weights[k], value), rtol=rel, atol=1e-9), (
            k,
            weights[k],
        )


def view(cid: int = 0) -> ClientView:
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.3, -0.7]])
    return ClientView(cid=cid, x=x, y=torch.tensor([0, 1, 1]), class_counts=torch.tensor([1, 2]))


def batch() -> Batch:
    v = view()
    return Batch(v.x, v.y)


def local_step(
    model: nn.Module, payload: Payload, state: dict, cid: int = 0, round_idx: int = 1
) -> LocalStep:
    """The step the engine hands the client hooks (nothing derived, empty scratch: before ``start_local``)."""
    return LocalStep(model=model, payload=payload, state=state, client=view(cid), info=info(round_idx, cid))


def with_scratch(alg: Algorithm, step: LocalStep) -> LocalStep:
    """``step`` with the read-only scratch the engine hands ``local_loss``: what ``init_scratch`` made."""
    return step.replace(scratch=Scratch(alg.init_scratch(step)))


def loss_grads(
    alg: Algorithm, model: nn.Module, payload: Payload, state: dict
) -> tuple[float, dict[str, Tensor]]:
    step = with_scratch(alg, local_step(model, payload, state))
    model.zero_grad(set_to_none=True)
    loss = alg.local_loss(step, batch())
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def finish(
    alg: Algorithm, model: nn.Module, payload: Payload, state: dict, steps: int, cid: int = 0
) -> LocalOutput:
    """``finish_local`` after ``steps`` local steps at η_l = 0.1 (``model`` holds the trained weights)."""
    step = with_scratch(alg, local_step(model, payload, state, cid))
    return alg.finish_local(step, LocalResult(steps, 0.0, 0.1))


def ce_grads(model: nn.Module) -> tuple[float, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    b = batch()
    loss = F.cross_entropy(model(b.x), b.y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def offsets() -> dict[str, Tensor]:
    """Distinct per-entry offsets d (so a wrong element-wise factor shows)."""
    shapes = {n: p.shape for n, p in Tiny().named_parameters()}
    return {n: torch.arange(1, s.numel() + 1, dtype=torch.float32).reshape(s) / 10 for n, s in shapes.items()}


# ---------------------------------------------------------------------------------------------- registry
def test_registered_with_paper_defaults() -> None:
    for name in (
        "local",
        "fedavg",
        "fedprox",
        "fedavgm",
        "fedadam",
        "fedyogi",
        "fedadagrad",
        "feddyn",
        "scaffold",
        "moon",
    ):
        assert ALGORITHMS.get(name).name == name
    adam = ALGORITHMS.get("fedadam").Params()
    assert (adam.beta1, adam.beta2, adam.tau) == (0.9, 0.99, 1e-3)
    moon = ALGORITHMS.get("moon").Params()
    assert (moon.mu, moon.tau) == (5.0, 0.5)
    assert ALGORITHMS.get("fedprox").Params().mu == 0.01
    assert ALGORITHMS.get("scaffold").Params().server_lr == 1.0
    assert "beta2" not in ALGORITHMS.get("fedadagrad").Params.model_fields
    with pytest.raises(ValueError):
        ALGORITHMS.get("fedadam").Params(beta3=0.5)


# ---------------------------------------------------------------------------------------------- FedAvg
def test_fedavg_sample_weighted_average(ctx: Context) -> None:
    alg = make("fedavg", ctx)
    server = alg.init_server(Tiny())
    before = snapshot(server)
    ups = [upload(0, 1, const_state(1.0, 2.0)), upload(1, 3, const_state(5.0, 6.0))]
    uploads_before = [snapshot(u.payload.arrays) for u in ups]
    new = alg.aggregate(server, ups, info(1)).state
    assert_params(new["weights"], 0.25 * 1.0 + 0.75 * 5.0)  # 4.0
    assert torch.allclose(new["weights"]["stat"], torch.full((2,), 5.0))
    assert_unchanged(server, before)  # aggregate returns a new server state
    for u, b in zip(ups, uploads_before, strict=True):
        assert_unchanged(u.payload.arrays, b)


def test_fedavg_uploads_without_data(ctx: Context) -> None:
    """Clients without data (``min_size: 0`` partitions) get weight 0; a round of only such clients averages
    their uploads equally (each is the model it was sent) instead of dividing by zero."""
    alg = make("fedavg", ctx)
    server = alg.init_server(Tiny())
    mixed = [upload(0, 0, const_state(9.0, 9.0)), upload(1, 2, const_state(3.0, 4.0))]
    assert_params(alg.aggregate(server, mixed, info(1)).state["weights"], 3.0)
    empty = [upload(0, 0, const_state(2.0, 2.0)), upload(1, 0, const_state(4.0, 4.0))]
    assert_params(alg.aggregate(server, empty, info(1)).state["weights"], 3.0)


# ---------------------------------------------------------------------------------------------- FedProx
def test_fedprox_proximal_gradient_is_mu_times_distance(ctx: Context) -> None:
    alg = make("fedprox", ctx, mu=0.3)
    model = Tiny()
    d = offsets()
    w_global = {n: p.detach() - d[n] for n, p in model.named_parameters()}
    payload = Payload(arrays=model_arrays(w_global))
    before = snapshot(payload.arrays)
    loss, grads = loss_grads(alg, model, payload, {})
    ce, ce_g = ce_grads(model)
    for n in grads:
        assert torch.allclose(grads[n] - ce_g[n], 0.3 * d[n], atol=1e-6), n  # ∇ μ/2‖w − w_g‖² = μ (w − w_g)
    sq = sum(float((v**2).sum()) for v in d.values())  # Σ d² = 0.3 + 0.3 + 0.05 = 0.65
    assert sq == pytest.approx(0.65)
    assert loss == pytest.approx(ce + 0.5 * 0.3 * 0.65, rel=1e-6)
    assert_unchanged(payload.arrays, before)  # the anchor is read, never written


# ---------------------------------------------------------------------------------------------- FedOpt
# Round 1: uploads 2.0 (n=1) and 2/3 (n=3) -> weighted mean 1.0, Δ1 = 1 from w0 = 0.
# Round 2: one upload w1 + 0.05 -> Δ2 = 0.05.  η = 0.1, β1 = 0.9, β2 = 0.99, τ = 1e-3, v_{-1} = τ² = 1e-6.
# m1 = 0.1·1 = 0.1; m2 = 0.9·0.1 + 0.1·0.05 = 0.095.
ADAPTIVE_CASES = {
    # Adam: v1 = 0.99e-6 + 0.01·1 = 0.01000099; v2 = 0.99·v1 + 0.01·0.0025 = 0.0099259801
    "fedadam": (0.01000099, 0.0099259801),
    # Yogi: v1 = 1e-6 − 0.01·1·sign(1e-6 − 1) = 0.010001; v2 = v1 − 0.01·0.0025·sign(v1 − 0.0025) = 0.009976
    "fedyogi": (0.010001, 0.009976),
    # Adagrad: v1 = 1e-6 + 1 = 1.000001; v2 = v1 + 0.0025 = 1.002501
    "fedadagrad": (1.000001, 1.002501),
}


@pytest.mark.parametrize("name", sorted(ADAPTIVE_CASES))
def test_adaptive_server_step(ctx: Context, name: str) -> None:
    alg = make(name, ctx, server_lr=0.1, tau=1e-3)
    server0 = alg.init_server(const_model(0.0))
    before = snapshot(server0)
    server = alg.aggregate(
        server0, [upload(0, 1, const_state(2.0, 8.0)), upload(1, 3, const_state(2 / 3))], info(1)
    ).state
    assert_unchanged(server0, before)  # the slots m, v of the old state are not updated in place
    v1, v2 = ADAPTIVE_CASES[name]
    w1 = 0.1 * 0.1 / (math.sqrt(v1) + 1e-3)
    assert_params(server["weights"], w1, rel=1e-5)
    assert_params(server["m"], 0.1, rel=1e-5)
    assert_params(server["v"], v1, rel=1e-5)
    assert torch.allclose(server["weights"]["stat"], torch.full((2,), 2.0))  # buffer: plain weighted mean
    server = alg.aggregate(server, [upload(0, 2, const_state(w1 + 0.05, 2.0))], info(2)).state
    assert_params(server["m"], 0.095, rel=1e-5)
    assert_params(server["v"], v2, rel=1e-5)
    assert_params(server["weights"], w1 + 0.1 * 0.095 / (math.sqrt(v2) + 1e-3), rel=1e-5)


def test_fedavgm_server_momentum(ctx: Context) -> None:
    alg = make("fedavgm", ctx, server_lr=0.5, momentum=0.9)
    server = alg.init_server(const_model(0.0))
    server = alg.aggregate(
        server, [upload(0, 1, const_state(2.0, 8.0)), upload(1, 3, const_state(2 / 3))], info(1)
    ).state
    assert_params(server["weights"], 0.5)  # m1 = Δ1 = 1; w1 = 0 + 0.5·1
    assert torch.allclose(server["weights"]["stat"], torch.full((2,), 2.0))
    before = snapshot(server)
    new = alg.aggregate(server, [upload(0, 2, const_state(0.55))], info(2)).state
    assert_params(new["m"], 0.95, rel=1e-5)  # m2 = 0.9·1 + 0.05
    assert_params(new["weights"], 0.975, rel=1e-5)  # w2 = 0.5 + 0.5·0.95
    assert_unchanged(server, before)


# ---------------------------------------------------------------------------------------------- FedDyn
def test_feddyn_local_gradient_and_memory_update(ctx: Context) -> None:
    alg = make("feddyn", ctx, alpha=0.2)
    model = Tiny()
    d = offsets()
    prev = {n: p.detach() - d[n] for n, p in model.named_parameters()}  # θ^{t−1} = θ − d
    payload = Payload(arrays=model_arrays(prev))
    g = {n: -3.0 * v for n, v in offsets().items()}  # ∇L_k(θ_k^{t−1}), distinct from d
    state = {"grad": dict(g)}
    _, grads = loss_grads(alg, model, payload, state)
    _, ce_g = ce_grads(model)
    for n in grads:  # ∇[CE − ⟨g, θ⟩ + α/2‖θ − θ^{t−1}‖²] = ∇CE − g + α d
        assert torch.allclose(grads[n], ce_g[n] - g[n] + 0.2 * d[n], atol=1e-6), n
    before = snapshot({"state": state, "payload": payload.arrays})
    out = finish(alg, model, payload, state, steps=2)
    for n in g:  # ∇L_k(θ_k^t) = g − α (θ_k^t − θ^{t−1}) = −3d − 0.2 d
        assert torch.allclose(out.state["grad"][n], -3.2 * d[n], atol=1e-6), n
    assert_unchanged({"state": state, "payload": payload.arrays}, before)  # the new state is a new dict
    # the model only (10 parameters + the 2-float buffer), float32, no config values: 4·12 = 48 bytes
    assert out.upload.num_params() == NUM_PARAMS + 2
    assert out.upload.nbytes() == 4 * (NUM_PARAMS + 2)


def test_feddyn_server_h_and_model(ctx: Context) -> None:
    alg = make("feddyn", ctx, alpha=0.1)
    server = alg.init_server(const_model(0.0))
    grad0 = alg.init_client(0)["grad"]  # from the context alone: zeros shaped like the parameters
    assert set(grad0) == set(PARAM_NAMES)
    assert all(torch.equal(grad0[n], torch.zeros_like(server["h"][n])) for n in PARAM_NAMES)
    # |P| = 2 of m = 4; unweighted mean (1 + 3)/2 = 2 despite n = 1, 3.
    old, before = server, snapshot(server)
    server = alg.aggregate(
        server, [upload(0, 1, const_state(1.0, 1.0)), upload(1, 3, const_state(3.0, 3.0))], info(1)
    ).state
    assert_params(server["h"], -0.1)  # h = 0 − 0.1·(1/4)·(1 + 3)
    assert_params(server["weights"], 3.0)  # θ = 2 − (−0.1)/0.1
    assert torch.allclose(server["weights"]["stat"], torch.full((2,), 2.0))
    assert_unchanged(old, before)  # h and θ of the previous state are not updated in place
    server = alg.aggregate(server, [upload(2, 2, const_state(3.5))], info(2)).state
    assert_params(server["h"], -0.1 - 0.1 * 0.25 * 0.5, rel=1e-5)  # h = −0.1 − 0.1·(1/4)·(3.5 − 3) = −0.1125
    assert_params(server["weights"], 3.5 + 1.125, rel=1e-5)  # θ = 3.5 − (−0.1125)/0.1


# ---------------------------------------------------------------------------------------------- SCAFFOLD
def test_scaffold_correction_gradient_and_bytes(ctx: Context) -> None:
    alg = make("scaffold", ctx)
    server = alg.init_server(Tiny())
    server["c"] = {n: v.clone() for n, v in offsets().items()}  # c = d
    c_i = {n: -2.0 * v for n, v in offsets().items()}  # c_i = −2d
    payload = alg.broadcast(server, info(1, 0))
    # x (10 parameters + the 2-float buffer) and c (10): 22 float32 values, no config values
    assert payload.num_params() == 2 * NUM_PARAMS + 2
    assert payload.nbytes() == 4 * (2 * NUM_PARAMS + 2)
    evaluation = alg.broadcast(server, info(1, None))  # evaluation: the model only
    assert evaluation.num_params() == NUM_PARAMS + 2 and evaluation.nbytes() == 4 * (NUM_PARAMS + 2)
    model = Tiny()
    state = {"c": c_i}
    load_state(model, alg.model_weights(payload, state))
    before = snapshot({"state": state, "payload": payload.arrays})
    _, grads = loss_grads(alg, model, payload, state)  # the correction comes from init_scratch
    _, ce_g = ce_grads(model)
    for n in grads:  # g − c_i + c = g + 3d
        assert torch.allclose(grads[n], ce_g[n] + 3.0 * offsets()[n], atol=1e-6), n
    assert_unchanged({"state": state, "payload": payload.arrays}, before)


def test_scaffold_control_variate_update(ctx: Context) -> None:
    alg = make("scaffold", ctx, server_lr=0.5)
    server = alg.init_server(const_model(0.0))  # x = 0
    server["c"] = {n: torch.full_like(v, 0.5) for n, v in server["c"].items()}  # c = 0.5
    state = alg.init_client(0)
    assert_params(state["c"], 0.0)
    state = {"c": {n: torch.full_like(v, 0.25) for n, v in state["c"].items()}}  # c_i = 0.25
    payload = alg.broadcast(server, info(1, 0))
    model = const_model(-0.2)  # y_i after K = 2 steps of η_l = 0.1
    out = finish(alg, model, payload, state, steps=2)
    assert_params(out.state["c"], 0.75)  # c_i⁺ = 0.25 − 0.5 + (0 − (−0.2)) / (2·0.1)
    assert_params(state["c"], 0.25)  # the committed state is left to the runtime
    up = out.upload
    dc = {k[len(CONTROL_PREFIX) :]: v for k, v in up.arrays.items() if k.startswith(CONTROL_PREFIX)}
    assert_params(dc, 0.5)  # Δc_i = c_i⁺ − c_i
    # y_i (10 parameters + the 2-float buffer) and Δc_i (10): counted, 4 bytes each, no config values
    assert up.num_params() == 2 * NUM_PARAMS + 2
    assert up.nbytes() == 4 * (2 * NUM_PARAMS + 2)

    ups = [
        upload(0, 1, const_state(-0.2, 1.0), {CONTROL_PREFIX + n: v for n, v in dc.items()}),
        upload(
            1, 3, const_state(0.6, 3.0), {CONTROL_PREFIX + n: torch.full_like(v, 1.5) for n, v in dc.items()}
        ),
    ]
    before = snapshot(server)
    new = alg.aggregate(server, ups, info(1)).state
    assert_params(new["weights"], 0.5 * (-0.2 + 0.6) / 2)  # x + η_g·mean Δy = 0 + 0.5·0.2 = 0.1
    assert_params(new["c"], 0.5 + (2 / 4) * (0.5 + 1.5) / 2)  # c + |S|/N·mean Δc = 1.0
    assert torch.allclose(new["weights"]["stat"], torch.full((2,), 2.0))
    assert_unchanged(server, before)


def test_scaffold_effective_steps_divide_by_the_momentum_normaliser(ctx: Context) -> None:
    """Under momentum ρ = 0.5 and K = 2 steps a unit gradient moves y by η‖a‖₁ = η (2 − 0.5·0.75/0.5)/0.5
    = 2.5η, so ``control_steps: effective`` recovers the gradient where K η reads 1.25 times it."""
    moving = dataclasses.replace(ctx, client=ctx.client.model_copy(update={"momentum": 0.5}))
    server = make("scaffold", moving).init_server(const_model(0.0))  # x = 0, c = 0
    state = {"c": {n: torch.zeros_like(v) for n, v in server["c"].items()}}
    for control_steps, want in (("local", 1.25), ("effective", 1.0)):
        alg = make("scaffold", moving, control_steps=control_steps)
        payload = alg.broadcast(server, info(1, 0))
        out = finish(alg, const_model(-0.25), payload, state, steps=2)  # x − y = 2.5 η with η = 0.1, g = 1
        assert_params(out.state["c"], want)


# ---------------------------------------------------------------------------------------------- MOON
def test_moon_contrastive_term_on_hand_made_embeddings() -> None:
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[2.0, 0.0], [1.0, 0.0]])  # cos = 1 and 1/√2
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, -1.0]])  # cos = 0 and −1
    # ℓ = −log(e^{s_g/τ} / (e^{s_g/τ} + e^{s_p/τ})) = log(1 + e^{(s_p − s_g)/τ}), τ = 0.5
    row1 = math.log1p(math.exp((0.0 - 1.0) / 0.5))  # 0.126928
    row2 = math.log1p(math.exp((-1.0 - 1 / math.sqrt(2)) / 0.5))  # 0.032373
    assert row1 == pytest.approx(0.126928, abs=1e-6)
    got = model_contrastive_loss(z, z_glob, z_prev, tau=0.5)
    assert float(got) == pytest.approx((row1 + row2) / 2, rel=1e-5)
    swapped = model_contrastive_loss(z, z_prev, z_glob, tau=0.5)  # the roles are not symmetric
    assert float(swapped) == pytest.approx(
        (math.log1p(math.exp(2.0)) + math.log1p(math.exp(3.4142136))) / 2, rel=1e-5
    )


def test_moon_local_loss_uses_global_positive_and_previous_negative(ctx: Context) -> None:
    alg = make("moon", ctx, mu=2.0, tau=0.5)
    local, glob, prev = Tiny(), Tiny(), Tiny()  # three different random models
    payload = Payload(arrays=model_arrays(glob.state_dict()))
    b = batch()

    # first participation: no previous model -> plain CE (the contrastive term has zero gradient there)
    state: dict = {}
    load_state(local, alg.model_weights(payload, state))  # what the runtime does before start_local
    held = snapshot(local.state_dict())
    step = local_step(local, payload, state)
    plan = alg.start_local(step)
    assert_unchanged(dict(local.state_dict()), held)  # start_local reads the model, never changes it
    assert not plan.derived  # no previous model: no reference networks loaded
    step = with_scratch(alg, step.replace(derived=plan.derived))
    first = float(alg.local_loss(step, b).detach())
    with torch.no_grad():
        ce_global = float(F.cross_entropy(glob(b.x), b.y))
    assert first == pytest.approx(ce_global, rel=1e-6)  # the client trains from the global model

    load_state(local, {k: v + 0.3 for k, v in glob.state_dict().items()})
    out = alg.finish_local(step, LocalResult(1, 0.0, 0.1))
    # the model only (10 parameters + the 2-float buffer), float32, no config values
    assert out.upload.num_params() == NUM_PARAMS + 2 and out.upload.nbytes() == 4 * (NUM_PARAMS + 2)
    assert "prev" not in state and "prev" not in step.state  # the new state is returned, not written
    stored = {k: v.clone() for k, v in out.state["prev"].items()}
    load_state(local, prev.state_dict())  # the engine reuses the model instance: state must not alias it
    assert all(torch.equal(stored[k], out.state["prev"][k]) for k in stored)
    assert torch.allclose(out.state["prev"]["body.weight"], glob.body.weight + 0.3)

    state = {"prev": {k: v.clone() for k, v in prev.state_dict().items()}}
    load_state(local, alg.model_weights(payload, state))  # the global model, loaded by the runtime
    attributes = set(vars(alg))
    plan = alg.start_local(local_step(local, payload, state, round_idx=2))
    # the loaded references travel in the per-round channel; on ``self`` only the declared cache changes
    cached = alg.reference_nets[ctx.arch_key(0)]
    assert all(a is b for a, b in zip(plan.derived["references"], cached, strict=True))
    assert set(vars(alg)) == attributes and alg.working_buffers == {"reference_nets"}
    load_state(local, {k: v * 0.5 for k, v in glob.state_dict().items()})  # pretend training moved it
    step = with_scratch(alg, local_step(local, payload, state, round_idx=2).replace(derived=plan.derived))
    loss = alg.local_loss(step, b)
    with torch.no_grad():
        z = local.features(b.x)
        expected = F.cross_entropy(local.head(z), b.y) + 2.0 * model_contrastive_loss(
            z, glob.features(b.x), prev.features(b.x), 0.5
        )
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in local.parameters())
    n_builds = len(ctx.built)  # type: ignore[attr-defined]
    alg.start_local(local_step(local, payload, state, cid=1, round_idx=2))
    assert len(ctx.built) == n_builds == 2  # type: ignore[attr-defined]  (frozen models built once, cached)


# ---------------------------------------------------------------------------------------------- Local
def test_local_sends_nothing_and_keeps_personal_weights(ctx: Context) -> None:
    ctx.initial_model = lambda cid: const_model(1.0)  # the run's initial model (built by the engine)
    alg = make("local", ctx)
    assert alg.personalized_eval and not alg.mean_aggregation
    init = const_model(1.0)
    server = alg.init_server(init)
    states = {cid: alg.init_client(cid) for cid in (0, 1)}
    assert_params(states[0]["weights"], 1.0)
    assert states[0]["weights"]["body.weight"].data_ptr() != server["weights"]["body.weight"].data_ptr()
    model = Tiny()
    for cid, trained in ((0, 7.0), (1, -2.0)):
        payload = alg.broadcast(server, info(1, cid))
        assert payload.nbytes() == 0
        load_state(model, alg.model_weights(payload, states[cid]))
        assert_params(dict(model.state_dict()), 1.0)  # starts from its own (initial) weights
        step = local_step(model, payload, states[cid], cid)
        plan = alg.start_local(step)
        assert not plan.derived
        load_state(model, const_state(trained))  # "training"
        out = alg.finish_local(step.replace(derived=plan.derived), LocalResult(1, 0.0, 0.1))
        assert out.upload.nbytes() == 0
        assert_params(states[cid]["weights"], 1.0)  # not mutated: the runtime commits ``out.state``
        states[cid] = out.state
    assert_params(states[0]["weights"], 7.0)
    assert_params(states[1]["weights"], -2.0)
    update = alg.aggregate(server, [Upload(0, 1, Payload()), Upload(1, 3, Payload())], info(1))
    assert not update.metrics
    server = update.state
    assert_params(server["weights"], 1.0)
    load_state(model, alg.model_weights(alg.broadcast(server, info(2, 0)), states[0]))
    assert_params(dict(model.state_dict()), 7.0)  # next round resumes client 0's personal model
    load_state(model, alg.eval_weights(alg.broadcast(server, info(2, 1)), states[1]))
    assert_params(dict(model.state_dict()), -2.0)
    with pytest.raises(ConfigError, match=r"eval\.protocol=personalized"):
        alg.eval_weights(alg.broadcast(server, info(2, None)), None)
