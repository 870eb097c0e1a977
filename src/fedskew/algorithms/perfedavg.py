"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020, "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS), Algorithm 1 and its FO / HF versions (§4, §5).

The global model minimises the MAML objective F(w) = (1/n) Σ_i f_i(w − α∇f_i(w)) (Eq. 3). A client takes τ
local steps from the received w_k (Algorithm 1 lines 6–8), each on independent batches D, D', D'':

    w̃ = w − α ∇f̃_i(w; D),
    w ← w − β (I − α ∇²f̃_i(w; D'')) ∇f̃_i(w̃; D'),

and the server averages the clients' models uniformly (line 10). Per-FedAvg (FO) drops the Hessian term;
Per-FedAvg (HF) replaces the Hessian-vector product by the difference of gradients
(∇f̃_i(w + δv; D'') − ∇f̃_i(w − δv; D''))/(2δ).

In the engine, one mini-batch is one local step: ``local_loss`` cuts it in two (FO) or three (HF) parts D,
D', D'' (the batch is a random draw, so the parts are independent batches of B/2 or B/3 samples; a batch
too small to cut is used whole for each part), computes the meta-gradient g with ``torch.func`` on copies,
and returns the surrogate ⟨g, w⟩ (plus the detached f̃_i(w̃; D')), so that the engine's SGD step is line 8
exactly: the local phase runs at the learning rate β (``beta``), times the round's ``lr_decay`` /
``lr_schedule`` factor. ``variant: hf`` computes the Hessian-vector product exactly (forward-over-reverse,
``hvp: exact``, the quantity Algorithm 1 states) or by the paper's finite difference
(``hvp: finite_difference`` with δ).

Step sizes (docs/decisions.md, "Issue 52: Per-FedAvg's step sizes"): α, the inner and test-time step, is the
client's learning rate ``client.lr`` unless ``alpha`` is set, as in every implementation read (PFLlib
``clientperavg.py``: the inner and test-time steps at the client's ``learning_rate``; FL-bench
``src/client/perfedavg.py``: the inner step at ``optimizer.lr``; the pFedMe authors' Per-FedAvg, whose README
runs ``--learning_rate 0.005 --beta 0.001``). β, the outer (meta) step, is ``beta``, by default also
``client.lr`` (PFLlib's ``self.beta = self.learning_rate``); FL-bench's 1e-3 and the pFedMe authors' 0.001
(``beta: 0.001``) leave w untrained in a few dozen rounds. fedskew had α = 0.001 and β = ``client.lr``
before issue 52: ``{alpha: 0.001, beta: null}``. α is searched as ``client.lr`` (its search space), β by its
own.

Personalized model (§5: "one step of local stochastic gradient descent" at test time): the personalized
protocol evaluates each client with w − α ∇f̃_i(w; D), the model being evaluated w after one step on a
mini-batch D of the client's training data (:meth:`PerFedAvg.adapt_for_eval`; nothing kept); a client
without training data is evaluated with w. ``adapt: full`` takes the gradient over all its training data.
``eval_adapt: none`` scores w itself (what the α-step buys, as an ablation). ``eval_adapt: stale`` keeps the
former procedure: the client computes d_i = −α ∇f̃_i(w_k; D) at the model
w_k it received in its round, keeps it in its state, and is evaluated with w + d_i (the gradient one
participation old).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor
from torch.func import functional_call, grad, grad_and_value, jvp

from fedskew import numerics
from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    ClientView,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    State,
    count_weights,
    model_arrays,
    uniform_weights,
)
from fedskew.algorithms.scaffold import full_gradient
from fedskew.algorithms.work import Work
from fedskew.search_space import tunable

Weights = dict[str, Tensor]
_ADAPT_KEY = 0xADA7  # the generator stream of the test-time adaptation batch


def batch_parts(batch: Batch, k: int) -> list[tuple[Tensor, Tensor]]:
    """``k`` disjoint consecutive parts of the batch (sizes differ by at most one); the whole batch ``k``
    times when it has fewer than ``k`` samples."""
    if batch.y.shape[0] < k:
        return [(batch.x, batch.y)] * k
    return list(zip(torch.tensor_split(batch.x, k), torch.tensor_split(batch.y, k), strict=True))


def meta_gradient(
    loss: Callable[[Weights, Tensor, Tensor], Tensor],
    w: Weights,
    parts: list[tuple[Tensor, Tensor]],
    alpha: float,
    hvp: Literal["none", "exact", "finite_difference"],
    delta: float = 1e-3,
    hessian_loss: Callable[[Weights, Tensor, Tensor], Tensor] | None = None,
) -> tuple[Weights, Tensor]:
    """The Per-FedAvg direction at ``w`` and f̃(w̃; D'): ∇f̃(w̃; D') − α ∇²f̃(w; D'') ∇f̃(w̃; D') with
    w̃ = w − α∇f̃(w; D) (``hvp="none"``: the first-order direction ∇f̃(w̃; D')). ``parts`` = [D, D', D''];
    ``hessian_loss`` (default ``loss``) is the loss the Hessian-vector product differentiates."""
    (x0, y0), (x1, y1) = parts[0], parts[1]
    g0 = grad(loss)(w, x0, y0)
    adapted = {n: v - alpha * g0[n] for n, v in w.items()}
    g1, value = grad_and_value(loss)(adapted, x1, y1)
    if hvp == "none":
        return g1, value
    x2, y2 = parts[2]
    second = hessian_loss or loss

    def gradient(params: Weights) -> Weights:
        return grad(second)(params, x2, y2)

    if hvp == "exact":
        hv = jvp(gradient, (w,), (g1,))[1]
    else:
        plus = gradient({n: v + delta * g1[n] for n, v in w.items()})
        minus = gradient({n: v - delta * g1[n] for n, v in w.items()})
        hv = {n: (plus[n] - minus[n]) / (2 * delta) for n in w}
    return {n: g1[n] - alpha * hv[n] for n in w}, value


@ALGORITHMS.register("perfedavg")
class PerFedAvg(Algorithm):
    """Per-FedAvg (Fallah et al. 2020): FedAvg on the MAML objective; personal = one α-step of adaptation."""

    personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        alpha: float | None = Field(
            None,
            gt=0.0,
            description="inner and test-time step α (Eq. 3); null: client.lr, searched as client.lr (source: "
            "PFLlib clientperavg.py, FL-bench perfedavg.py, the pFedMe authors' Per-FedAvg: the client's "
            "learning rate)",
        )
        beta: float | None = tunable(
            None,
            low=1e-4,
            high=0.5,
            log=True,
            gt=0.0,
            description="outer (meta) step β of Alg. 1 line 8, the local phase's learning rate; null: "
            "client.lr (source: PFLlib clientperavg.py beta = learning_rate; FL-bench perfedavg and the "
            "pFedMe authors' README use 0.001, which leaves w untrained in a few dozen rounds)",
        )
        variant: Literal["hf", "fo"] = Field(
            "hf",
            description="hf: the Hessian term of Alg. 1 line 8 (three batch parts); fo: Per-FedAvg (FO), "
            "without it (two parts) (source: Fallah et al. 2020 §4–5)",
        )
        hvp: Literal["exact", "finite_difference"] = Field(
            "exact",
            description="hf's Hessian-vector product: exact (torch.func forward-over-reverse) or the paper's "
            "Per-FedAvg (HF) finite difference with δ (source: Fallah et al. 2020 §4)",
        )
        delta: float = Field(
            1e-3, gt=0.0, description="δ of the finite difference (source: Fallah et al. 2020 §5, δ = 0.001)"
        )
        weights: Literal["uniform", "samples"] = Field(
            "uniform", description="server mean: uniform over participants (Alg. 1 line 10) or by samples"
        )
        adapt: Literal["batch", "full"] = Field(
            "batch",
            description="test-time step: one mini-batch of client.batch_size (§5, one stochastic gradient "
            "step) or the client's whole training set",
        )
        eval_adapt: Literal["fresh", "stale", "none"] = Field(
            "fresh",
            description="fresh: the test-time step is taken at evaluation from the model being evaluated "
            "(§5); stale: in the client's round at the model it received, added to the current model later "
            "(fedskew before contract v4); none: w itself is scored (an ablation)",
        )

    p: Params

    @property
    def alpha(self) -> float:
        """α: ``alpha``, or the client's learning rate."""
        return self.ctx.client.lr if self.p.alpha is None else self.p.alpha

    def start_local(self, step: LocalStep) -> LocalPlan:
        """The local phase at β, the outer step (the engine's SGD step on the surrogate is line 8)."""
        beta = self.ctx.client.lr if self.p.beta is None else self.p.beta
        return LocalPlan([Phase(epochs=self.ctx.client.epochs, lr=beta)])

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        """Surrogate ⟨g, w⟩ with g the meta-gradient; its value is f̃(w̃; D')."""
        model = step.model
        named = dict(model.named_parameters())
        w = {n: q.detach() for n, q in named.items()}

        def loss(params: Weights, x: Tensor, y: Tensor) -> Tensor:  # the model's buffers, as a training step
            return F.cross_entropy(functional_call(model, params, (x,)), y)

        def hessian_loss(params: Weights, x: Tensor, y: Tensor) -> Tensor:  # running statistics: on copies
            buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
            # differentiated forward-over-reverse: the CPU-portable form (fedskew.numerics)
            return numerics.cross_entropy(functional_call(model, {**params, **buffers}, (x,)), y)

        hf = self.p.variant == "hf"
        parts = batch_parts(batch, 3 if hf else 2)
        hvp = self.p.hvp if hf else "none"
        g, value = meta_gradient(loss, w, parts, self.alpha, hvp, self.p.delta, hessian_loss)
        terms = [(g[n].detach() * q).sum() for n, q in named.items()]
        surrogate = sum(terms[1:], terms[0])
        return surrogate - surrogate.detach() + value.detach()

    def test_step(self, step: LocalStep, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """d_i = −α ∇f̃_i(weights; D) on a batch D of the client's training data (``adapt: full``: all of it)
        drawn from the (round, client) stream."""
        client, gen = step.client, step.info.generator(_ADAPT_KEY)
        idx = torch.randperm(client.num_samples, generator=gen).to(client.x.device)
        if self.p.adapt == "batch":
            idx = idx[: self.ctx.client.batch_size]
        view = ClientView(client.cid, client.x[idx], client.y[idx], client.class_counts)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        g = full_gradient(step.model, weights, view, len(idx), seed)
        return {n: -self.alpha * v for n, v in g.items()}

    def adapt_for_eval(self, step: LocalStep) -> Mapping[str, Tensor] | None:
        """§5: w + d_i with d_i the test-time step at the model being evaluated w."""
        if self.p.eval_adapt != "fresh" or step.client.num_samples == 0:
            return None
        w = step.model.state_dict()
        return {n: w[n] + d for n, d in self.test_step(step, w).items()}

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload w_{k+1,τ}; under ``eval_adapt: stale`` keep the test-time step d_i = −α∇f̃_i(w_k) taken at
        the received model."""
        state = dict(step.state)
        if self.p.eval_adapt == "stale" and step.client.num_samples > 0:
            state["adapt"] = self.test_step(step, step.payload.model_state())
        return LocalOutput(Payload(arrays=model_arrays(step.model.state_dict())), state)

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """w (adapted by :meth:`adapt_for_eval`); under ``stale`` w + d_i (w alone for the global protocol
        and for a client never trained)."""
        weights = payload.model_state()
        if state is None or "adapt" not in state:
            return weights
        return {**weights, **{n: weights[n] + d for n, d in state["adapt"].items()}}

    def _test_step_work(self, num_samples: int) -> Work:
        """One update (the α-step) on D: a batch of ``client.batch_size`` (``adapt: full``: every sample)."""
        if num_samples == 0:
            return Work()
        batch = num_samples if self.p.adapt == "full" else min(num_samples, self.ctx.client.batch_size)
        return Work(1, batch)

    def eval_work(self, num_samples: int) -> Work:
        """:mod:`fedskew.algorithms.work`: the test-time step at each evaluation (``eval_adapt: fresh``)."""
        return self._test_step_work(num_samples) if self.p.eval_adapt == "fresh" else Work()

    def extra_work(self, num_samples: int, local: Work) -> Mapping[str, Work]:
        """:mod:`fedskew.algorithms.work`: ``eval_adapt: stale`` takes the test-time step in the round."""
        return {"stale_test_step": self._test_step_work(num_samples)} if self.p.eval_adapt == "stale" else {}

    def mean_weights(self, counts: Sequence[int]) -> Tensor:
        return uniform_weights(counts) if self.p.weights == "uniform" else count_weights(counts)
