"""FedGen (Zhu, Hong, Zhou 2021, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning",
ICML), Algorithm 1, Eqs. (4)–(6).

The server keeps a conditional generator ``G_w(ε, y)`` of *features* (the input of the models' head):
``[ε, onehot(y)] → Linear → BatchNorm → ReLU → Linear → R^d`` (the authors' ``Generator``), ε ~ N(0, I).
After receiving the round's models θ_k it (1) averages them (FedAvg) and (2) trains G for ``generator_steps``
Adam steps on the ensemble of the uploaded heads (Eq. 4/5):

    min_w  E_{y~R̂(y)} E_{ε} [ ℓ( Σ_k w_{k,y} g(G_w(ε, y); θ_k^p), y ) ],   w_{k,y} = n_{k,y} / Σ_j n_{j,y},

the per-label weights from the uploaders' label counts and R̂(y) ∝ Σ_k n_{k,y} (:func:`label_weights`,
:func:`teacher_loss`). The generator (weights and BatchNorm statistics) travels to the next round's clients
(counted in ``bytes_down``), which then minimise (Eq. 6)

    L = CE(f(x), y) + α · E_{ŷ~R̂, z=G_w(ε, ŷ)} CE(head(z), ŷ),

the generator frozen in eval mode; R̂ there is the label distribution of the whole federation
(``Context.class_counts``). Generated batches are drawn in :meth:`FedGen.init_scratch` from the round's
client stream (one batch of ``gen_batch_size`` per local step), so ``local_loss`` only indexes them.

Round 1: the generator is untrained, so no client regularises (the code: ``regularization=glob_iter > 0``);
a generator is sent only once the server has trained it. Adam's moments persist across rounds in the server
state, and its learning rate decays by ``generator_lr_decay`` per round (the code's ExponentialLR).

Options for the authors' code (zhuangdizhu/FedGen), defaults are the paper's:

* ``teacher="weighted_ce"``: Σ_k mean_b w_{k,y_b} CE(g_k(z_b), y_b) instead of the ensemble's CE;
* ``diversity``: weight η of the code's diversity loss exp(−mean(d_ε ⊙ d_z)) (code: 1; not in Eq. 4);
* ``server_labels="uniform"``: y uniform over the labels some uploader holds (code's ``qualified_labels``);
* ``noise="uniform"``: ε ~ U[0, 1) (the code's ``torch.rand``);
* ``regularizer="code"``: the client adds α_t·(B_gen/B)·CE_gen (labels uniform over the federation's
  labels) + β_t·KL(softmax(head(G(ε, y))) ‖ softmax(f(x))) on the real batch's labels, with
  α_t = max(1e-4, α·decay^(t−1)), same for β (the code's ``exp_lr_scheduler``; its MNIST config α=β=10).

Deviations: label counts are the clients' training-set counts (the code counts the labels drawn during the
round, plus one); the code's ``early_stop`` (no regularisation after 20 local epochs) is not reproduced.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew import numerics
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    Context,
    HyperParams,
    LocalPlan,
    LocalStep,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    clone_state,
    embedding_dim,
    load_state,
    sample_weights,
    weighted_average,
)
from fedskew.algorithms.batching import batches_per_epoch
from fedskew.algorithms.helpers import frozen
from fedskew.algorithms.layouts import UploadLayout, specs_of
from fedskew.models.base import FedModel, HeadView
from fedskew.search_space import tunable
from fedskew.seeding import derive_seed
from fedskew.update_rules import adam_l2_update

#: payload prefix of the generator's state (weights and BatchNorm statistics)
GEN_PREFIX = "generator."
#: ``RoundInfo.generator`` keys of FedGen's streams
SERVER_KEY, CLIENT_KEY, INIT_KEY = 71, 72, 73
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # the code's Adam


class Generator(nn.Module):
    """G_w(ε, y): ``[ε, onehot(y)] → Linear → BatchNorm1d → ReLU → Linear`` to the feature space."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.fc = nn.Linear(noise_dim + num_classes, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, out_dim)

    def forward(self, eps: Tensor, y: Tensor) -> Tensor:
        onehot = F.one_hot(y, self.num_classes).to(eps.dtype)
        return self.out(F.relu(self.bn(self.fc(torch.cat([eps, onehot], dim=1)))))


def label_weights(counts: Tensor) -> Tensor:
    """``w[k, y] = n_{k,y} / Σ_j n_{j,y}`` from the uploaders' label counts ``[K, C]`` (0 for a label no
    uploader holds)."""
    counts = counts.double()
    return counts / counts.sum(0, keepdim=True).clamp_min(1.0)


def teacher_loss(logits: Tensor, weights: Tensor, y: Tensor, form: str = "ensemble") -> Tensor:
    """The generator's objective on a batch: ``logits [K, B, C]`` of the K uploaded heads on G's samples,
    ``weights [K, C]`` from :func:`label_weights`, labels ``y [B]``.

    ``ensemble`` (Eq. 4): CE of ``Σ_k w_{k,y_b} logits_k[b]``; ``weighted_ce`` (the code):
    ``Σ_k mean_b w_{k,y_b} CE(logits_k[b], y_b)``."""
    w = weights[:, y].to(logits.dtype)  # [K, B]
    if form == "ensemble":
        return F.cross_entropy((w[:, :, None] * logits).sum(0), y)
    per = torch.stack([F.cross_entropy(lk, y, reduction="none") for lk in logits])  # [K, B]
    return (w * per).mean(1).sum()


def diversity_loss(eps: Tensor, z: Tensor) -> Tensor:
    """The code's ``DiversityLoss('l1')``: ``exp(−mean_{ij} d2(ε_i, ε_j) · d1(z_i, z_j))``, d2 the mean
    squared and d1 the mean absolute difference."""
    noise = (eps[None] - eps[:, None]).pow(2).mean(2)
    layer = (z[None] - z[:, None]).abs().mean(2)
    return numerics.exp(-(noise * layer).mean())


def draw_noise(shape: tuple[int, ...], gen: torch.Generator, kind: str) -> Tensor:
    """ε ~ N(0, I) (paper §3.2) or U[0, 1) (the code's ``torch.rand``)."""
    return torch.randn(shape, generator=gen) if kind == "normal" else torch.rand(shape, generator=gen)


def local_steps(n: int, batch_size: int, epochs: int) -> int:
    """The engine's number of local steps over ``epochs`` epochs (:func:`batches_per_epoch`)."""
    return batches_per_epoch(n, batch_size) * epochs


def decayed(value: float, decay: float, round_idx: int) -> float:
    """The code's ``exp_lr_scheduler``: ``max(1e-4, value · decay^(t−1))`` in round t."""
    return max(1e-4, value * decay ** (round_idx - 1))


def generator_state(payload: Payload) -> Mapping[str, Tensor]:
    """The generator entries of a payload, prefix stripped."""
    return {k[len(GEN_PREFIX) :]: v for k, v in payload.arrays.items() if k.startswith(GEN_PREFIX)}


@ALGORITHMS.register("fedgen")
class FedGen(Algorithm):
    """FedGen (Zhu et al. 2021): FedAvg plus a server-trained feature generator that regularises clients."""

    mean_aggregation = False  # the mean plus a generator trained on the server
    vectorizable = False
    #: clients draw ŷ from the federation's label distribution (Eq. 6's R̂, :meth:`_label_prior`): the class
    #: totals, which the context holds only as every client's histogram (docs/decisions.md, issue 51 item 6)
    federation_counts = "classes"

    class Params(HyperParams):
        alpha: float = tunable(
            1.0,
            low=0.1,
            high=10.0,
            log=True,
            ge=0.0,
            description="weight α of the generated-sample risk (Eq. 6 adds it with unit weight; with "
            "regularizer=code the initial α_t, the code's generative_alpha: 10 for MNIST; search: fedskew, "
            "[0.1, 10] log)",
        )
        beta: float = Field(
            10.0, ge=0.0, description="regularizer=code only: initial β_t (code: generative_beta 10, MNIST)"
        )
        regularizer: Literal["paper", "code"] = Field(
            "paper",
            description="client term: Eq. 6, or the code's decayed α_t·(B_gen/B)·CE_gen + β_t·KL on the "
            "real batch's labels",
        )
        coef_decay: float = Field(0.98, gt=0.0, le=1.0, description="regularizer=code: α_t, β_t decay")
        gen_batch_size: int = Field(32, ge=1, description="generated samples per local step (code: 32)")
        noise_dim: int = Field(32, ge=1, description="noise size (code GENERATORCONFIGS['mnist']: 32)")
        hidden_dim: int = Field(256, ge=1, description="generator hidden width (code, MNIST: 256)")
        noise: Literal["normal", "uniform"] = Field(
            "normal", description="ε ~ N(0, I) (paper §3.2) or U[0, 1) (code's torch.rand)"
        )
        generator_steps: int = Field(
            50, ge=0, description="generator Adam steps per round (code: ensemble_epochs 50 = 10 x 5 iters)"
        )
        generator_batch_size: int = Field(32, ge=2, description="labels per generator step (code: 32)")
        generator_lr: float = Field(3e-4, gt=0.0, description="generator Adam lr (code, MNIST: 3e-4)")
        generator_weight_decay: float = Field(
            1e-2, ge=0.0, description="generator Adam L2 weight decay (code, MNIST: 1e-2)"
        )
        generator_lr_decay: float = Field(
            0.98, gt=0.0, le=1.0, description="per-round lr decay (code: ExponentialLR gamma 0.98)"
        )
        teacher: Literal["ensemble", "weighted_ce"] = Field(
            "ensemble", description="generator loss: CE of the weighted ensemble (Eq. 4) or code's sum"
        )
        diversity: float = Field(
            0.0, ge=0.0, description="weight η of the diversity loss (not in Eq. 4; code: ensemble_eta 1)"
        )
        server_labels: Literal["prior", "uniform"] = Field(
            "prior", description="generator labels ~ R̂(y) of the uploaders (paper) or uniform (code)"
        )

    p: Params
    #: generator modules per feature size (server training, clients' frozen copies) and the teachers' model
    working_buffers = frozenset({"generators", "teachers"})

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        self.generators: dict[Hashable, Generator] = {}
        self.teachers: dict[Hashable, nn.Module] = {}

    # ---------------------------------------------------------------- modules
    def gen_module(self, dim: int, role: str) -> Generator:
        """The cached generator module for feature size ``dim`` (``role``: server or client), built without
        touching the global random stream (its weights are always loaded before use)."""
        key = (role, dim)
        if key not in self.generators:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.ctx.seed, INIT_KEY))
                p = self.p
                self.generators[key] = Generator(p.noise_dim, self.ctx.num_classes, p.hidden_dim, dim)
        return self.generators[key]

    def teacher_model(self) -> nn.Module:
        """A frozen global-architecture model whose head evaluates the uploaded heads (functional_call)."""
        if None not in self.teachers:
            with torch.random.fork_rng(devices=[]):
                model = self.ctx.build_model(None).to(self.ctx.device)
            self.teachers[None] = frozen(model)
        return self.teachers[None]

    def prepare_model(self, model: nn.Module) -> nn.Module:
        embedding_dim(model, self.name)  # a one-line error for a model without features()
        return model

    # ---------------------------------------------------------------- server
    def init_server(self, model: nn.Module) -> State:
        server, dim = super().init_server(model), embedding_dim(model, self.name)
        with torch.random.fork_rng(devices=[]):  # the run's initial generator, from the seed alone
            torch.manual_seed(derive_seed(self.ctx.seed, INIT_KEY))
            fresh = Generator(self.p.noise_dim, self.ctx.num_classes, self.p.hidden_dim, dim)
        state = clone_state(fresh.to(self.ctx.device).state_dict())
        zeros = {n: torch.zeros_like(p) for n, p in fresh.named_parameters()}
        server["generator"] = state
        server["adam"] = {"m": zeros, "v": dict(zeros), "step": 0}
        return server

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """The global model; to a training client also the generator, once the server has trained it."""
        payload = super().broadcast(server, info)
        if info.cid is not None and server["adam"]["step"] > 0:
            payload.arrays.update({GEN_PREFIX + k: v for k, v in server["generator"].items()})
        return payload

    def upload_layout(self, broadcast: Payload, info: RoundInfo) -> UploadLayout:
        """The model it was sent (the generator is only read)."""
        return UploadLayout(specs_of(broadcast.arrays, lambda k: not k.startswith(GEN_PREFIX)))

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """FedAvg, then ``generator_steps`` generator updates on the uploaded heads (Eq. 4/5)."""
        weights = weighted_average([u.payload.model_state() for u in uploads], sample_weights(uploads))
        gen_state, adam, metrics = self._train_generator(server, uploads, info)
        return ServerUpdate({**server, "weights": weights, "generator": gen_state, "adam": adam}, metrics)

    def _teachers(self, uploads: list[Upload]) -> tuple[nn.Module, list[dict[str, Tensor]]]:
        model = cast(FedModel, self.teacher_model())
        heads = []
        for u in uploads:
            state = u.payload.model_state()
            heads.append({"model." + n: v.to(self.ctx.device) for n, v in state.items() if model.is_head(n)})
        return HeadView(model), heads

    def _train_generator(
        self, server: State, uploads: list[Upload], info: RoundInfo
    ) -> tuple[dict[str, Tensor], dict, dict[str, float]]:
        p, device = self.p, self.ctx.device
        counts = self.ctx.class_counts[torch.tensor([u.cid for u in uploads])].double()  # [K, C]
        prior = counts.sum(0) if p.server_labels == "prior" else (counts.sum(0) > 0).double()
        if p.generator_steps == 0 or float(prior.sum()) == 0.0:
            return server["generator"], server["adam"], {}
        weights = label_weights(counts).to(device)
        view, heads = self._teachers(uploads)
        gen = self.gen_module(server["generator"]["out.weight"].shape[0], "server").to(device)
        load_state(gen, server["generator"])
        gen.train()
        adam = dict(server["adam"])
        lr = p.generator_lr * p.generator_lr_decay ** (info.round - 1)
        stream, losses = info.generator(SERVER_KEY), []
        for _ in range(p.generator_steps):
            y = torch.multinomial(prior, p.generator_batch_size, replacement=True, generator=stream)
            eps = draw_noise((y.shape[0], p.noise_dim), stream, p.noise).to(device)
            y = y.to(device)
            z = gen(eps, y)
            logits = torch.stack([functional_call(view, h, (z,)) for h in heads])
            loss = teacher_loss(logits, weights, y, p.teacher)
            losses.append(loss.detach())
            if p.diversity > 0:
                loss = loss + p.diversity * diversity_loss(eps, z)
            gen.zero_grad(set_to_none=True)
            loss.backward()
            adam = self._adam_step(gen, adam, lr)
        gen.zero_grad(set_to_none=True)
        metrics = {"generator_loss": float(torch.stack(losses).mean())}
        return clone_state(gen.state_dict()), adam, metrics

    def _adam_step(self, gen: nn.Module, adam: dict, lr: float) -> dict:
        """One Adam step (torch's, L2 weight decay added to the gradient: :func:`adam_l2_update`) with new
        moment tensors."""
        t, wd = adam["step"] + 1, self.p.generator_weight_decay
        params = dict(gen.named_parameters())
        grads = {n: cast(Tensor, q.grad) for n, q in params.items()}
        with torch.no_grad():
            m, v = adam_l2_update(params, grads, (adam["m"], adam["v"]), t, lr, ADAM_BETAS, ADAM_EPS, wd)
        return {"m": m, "v": v, "step": t}

    # ---------------------------------------------------------------- client
    def start_local(self, step: LocalStep) -> LocalPlan:
        """Load the received generator into the frozen client copy (``derived["generator"]``)."""
        plan = super().start_local(step)
        state = generator_state(step.payload)
        if not state:  # round 1 (untrained generator): plain cross-entropy
            return plan
        gen = self.gen_module(state["out.weight"].shape[0], "client").to(step.client.x.device)
        load_state(gen, state)
        return LocalPlan(plan.phases, derived={"generator": frozen(gen)})

    def _label_prior(self) -> Tensor:
        total = self.ctx.class_counts.sum(0).double()
        return total if self.p.regularizer == "paper" else (total > 0).double()

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """One generated batch per local step, ``gen_z [K, B_gen, d]`` with labels ``gen_y`` (ŷ ~ R̂), from
        the client's stream; for ``regularizer=code`` also the noise of the real batches' generated twins."""
        if "generator" not in step.derived or step.client.num_samples == 0:
            return {}
        p, device, gen = self.p, step.client.x.device, step.derived["generator"]
        cfg, stream = self.ctx.client, step.info.generator(CLIENT_KEY)
        steps = max(1, local_steps(step.client.num_samples, cfg.batch_size, cfg.epochs))
        n = steps * p.gen_batch_size
        y = torch.multinomial(self._label_prior(), n, replacement=True, generator=stream)
        eps = draw_noise((y.shape[0], p.noise_dim), stream, p.noise)
        with torch.no_grad():
            z = gen(eps.to(device), y.to(device))
        scratch = {
            "gen_z": z.reshape(steps, p.gen_batch_size, -1),
            "gen_y": y.to(device).reshape(steps, p.gen_batch_size),
            "counter": torch.zeros((), dtype=torch.long),
        }
        if p.regularizer == "code":
            shape = (steps, self.ctx.client.batch_size, p.noise_dim)
            scratch["kd_eps"] = draw_noise(shape, stream, p.noise).to(device)
        return scratch

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model, scratch = cast(FedModel, step.model), step.scratch
        logits = model(batch.x)
        loss = F.cross_entropy(logits, batch.y)
        if "gen_z" not in scratch:
            return loss
        k = int(scratch["counter"]) % scratch["gen_z"].shape[0]
        scratch["counter"].add_(1)
        gen_loss = F.cross_entropy(model.head(scratch["gen_z"][k]), scratch["gen_y"][k])
        if self.p.regularizer == "paper":
            return loss + self.p.alpha * gen_loss
        return loss + self._code_terms(step, logits, batch, gen_loss, k)

    def _code_terms(self, step: LocalStep, logits: Tensor, batch: Batch, gen_loss: Tensor, k: int) -> Tensor:
        """The code's α_t·(B_gen/B)·CE_gen + β_t·KL(p_gen ‖ p_real) (``userpFedGen.train``)."""
        p, t = self.p, step.info.round
        model = cast(FedModel, step.model)
        with torch.no_grad():
            eps = step.scratch["kd_eps"][k][: batch.y.shape[0]]
            target = F.softmax(model.head(step.derived["generator"](eps, batch.y)), dim=1)
        kl = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
        ratio = p.gen_batch_size / self.ctx.client.batch_size
        return decayed(p.alpha, p.coef_decay, t) * ratio * gen_loss + decayed(p.beta, p.coef_decay, t) * kl


__all__ = ["FedGen", "Generator", "diversity_loss", "label_weights", "teacher_loss"]
