"""pFedMe (T. Dinh, Tran, Nguyen 2020, "Personalized Federated Learning with Moreau Envelopes", NeurIPS),
Algorithm 1.

Client i minimises the Moreau envelope F_i(w) = min_θ f_i(θ) + λ/2 ‖θ − w‖² (Eq. 2–3). In round t it sets
w_{i,0} = w^t and, for each local round r (one mini-batch D_i):

* solve h̃_i(θ; w_{i,r}, D_i) = f̃_i(θ; D_i) + λ/2 ‖θ − w_{i,r}‖² (Eq. 7) approximately, with K steps of
  gradient descent at the personal learning rate: θ ← θ − p_lr (∇f̃_i(θ; D_i) + λ(θ − w_{i,r}));
* w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ̂_i(w_{i,r}))                                        (line 8).

The server mixes w^{t+1} = (1 − β) w^t + β Σ_{i∈S} w_{i,R} / S (line 10).

In the engine, one mini-batch is one local round r: ``local_loss`` runs the K inner steps on a copy
(``torch.func``, functional in θ, w detached) and returns a surrogate whose gradient in w is λ(w − θ̂), so
the engine's SGD step at η = ``client.lr`` is exactly line 8. The value it reports is f̃_i at the last inner
iterate, the personalized model's loss on the batch. The number of local rounds R is the number of local
mini-batches (``client.epochs`` passes), not a separate count.

The inner solver starts, as the authors' code (``userpFedMe.py``: one θ for the whole round, set to w^t at
its start), from the previous batch's θ̂ (``inner_init: warm``); ``local`` restarts it from w_{i,r} at every
batch (the paper does not say). The code's inner step also has an ℓ2 term ``mu · θ`` (``inner_mu``; 0, as
Eq. 7). The personalized model is θ̂ of the round's last batch (the paper's "PM"), kept in the client
state with the trained model's buffers; the authors' code, through aliasing, evaluates w_{i,R} instead
(``personal_model: local``; CharlieDinh/pFedMe issue #5). A client never trained is evaluated with w.
The paper averages uniformly over S (``weights: uniform``); its code by training samples (``samples``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    Context,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    MeanInfo,
    Payload,
    ServerUpdate,
    State,
    count_weights,
    model_arrays,
    uniform_weights,
)
from fedskew.algorithms.work import Work
from fedskew.search_space import tunable

#: scratch prefix of the inner solver's iterate θ (one tensor per parameter)
THETA = "theta."


def inner_solve(
    model: nn.Module,
    theta: Mapping[str, Tensor],
    anchor: Mapping[str, Tensor],
    batch: Batch,
    steps: int,
    lr: float,
    lam: float,
    mu: float = 0.0,
) -> tuple[dict[str, Tensor], Tensor]:
    """``steps`` gradient steps on f̃(θ; batch) + λ/2 ‖θ − anchor‖² + μ/2 ‖θ‖² from ``theta``, on copies (the
    model's parameters are substituted; its buffers are used as in a training step). Returns θ̂ and f̃ at the
    last iterate a gradient was taken at (``nan`` for ``steps = 0``)."""

    def ce(params: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(functional_call(model, params, (batch.x,)), batch.y)

    theta = {n: t.detach() for n, t in theta.items()}
    value = torch.full((), float("nan"), device=batch.x.device)
    for _ in range(steps):
        g, value = grad_and_value(ce)(theta)
        theta = {n: t - lr * (g[n] + lam * (t - anchor[n]) + mu * t) for n, t in theta.items()}
    return theta, value.detach()


@ALGORITHMS.register("pfedme")
class PFedMe(Algorithm):
    """pFedMe (Dinh et al. 2020): local steps on Moreau envelopes; personal models θ̂ from an inner solver."""

    personalized_eval: ClassVar[bool] = True

    class Params(HyperParams):
        lam: float = tunable(
            15.0,
            low=1.0,
            high=50.0,
            log=True,
            gt=0.0,
            description="λ of the Moreau envelope (source: Dinh et al. 2020 §5: 15 on MNIST; search: "
            "fedskew, [1, 50] log)",
        )
        K: int = tunable(
            5,
            low=1,
            high=10,
            integer=True,
            ge=1,
            description="inner gradient steps per batch (source: Dinh et al. 2020 §5: 5; search: fedskew, "
            "[1, 10])",
        )
        personal_lr: float = tunable(
            0.1,
            low=0.01,
            high=0.5,
            log=True,
            gt=0.0,
            description="learning rate of the inner solver (source: Dinh et al. 2020 §5 on MNIST; the "
            "authors' result file `Mnist_pFedMe_0.005_1_15_5u_20b_20_5_0.1_avg.h5`; search: fedskew, "
            "[0.01, 0.5] log)",
        )
        beta: float = Field(
            1.0, gt=0.0, description="server mixing β (source: Dinh et al. 2020 Alg. 1 line 10 and §5, β = 1)"
        )
        weights: Literal["uniform", "samples"] = Field(
            "uniform",
            description="mean over S: uniform (Alg. 1 line 10) or by training samples (authors' code)",
        )
        inner_init: Literal["warm", "local"] = Field(
            "warm",
            description="inner solver start: the previous batch's θ̂, w^t at the round's start (authors' "
            "code), or w_{i,r} at every batch",
        )
        inner_mu: float = Field(
            0.0, ge=0.0, description="ℓ2 weight μ in the inner step (Eq. 7: 0; the authors' optimizer: 0.001)"
        )
        personal_model: Literal["theta", "local"] = Field(
            "theta",
            description="model kept for personalized evaluation: θ̂ of the last batch (paper) or the local "
            "model w_{i,R} (what the authors' code evaluates)",
        )

    p: Params

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        #: parameter names of the global model (β mixes parameters; buffers are averaged)
        self.params = frozenset(n for n, _ in ctx.model_template(None).named_parameters())

    # ---------------------------------------------------------------- client
    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """θ starts at the received w^t (the code's ``set_parameters``)."""
        return {THETA + n: p.detach().clone() for n, p in step.model.named_parameters()}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        """K inner steps on θ (kept in scratch), then λ/2 ‖w − θ̂‖² whose gradient is λ(w − θ̂)."""
        named = dict(step.model.named_parameters())
        w = {n: p.detach() for n, p in named.items()}
        start = w if self.p.inner_init == "local" else {n: step.scratch[THETA + n] for n in named}
        p = self.p
        theta, value = inner_solve(step.model, start, w, batch, p.K, p.personal_lr, p.lam, p.inner_mu)
        with torch.no_grad():
            for n, t in theta.items():
                step.scratch[THETA + n].copy_(t)
        terms = [(q - theta[n]).pow(2).sum() for n, q in named.items()]
        moreau = 0.5 * p.lam * sum(terms[1:], terms[0])
        return moreau - moreau.detach() + value  # gradient λ(w − θ̂), value f̃(θ̂)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """Upload w_{i,R}; keep the personalized model (θ̂ or w_{i,R}) with the trained buffers."""
        sd = step.model.state_dict()
        personal = {k: v.detach().clone() for k, v in sd.items()}
        if self.p.personal_model == "theta":
            personal.update({n: step.scratch[THETA + n].detach().clone() for n in self.params})
        return LocalOutput(Payload(arrays=model_arrays(sd)), {**step.state, "personal": personal})

    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None or "personal" not in state:
            return payload.model_state()
        return {**payload.model_state(), **state["personal"]}

    def extra_work(self, num_samples: int, local: Work) -> Mapping[str, Work]:
        """:mod:`fedskew.algorithms.work`: the inner solver's K updates of θ on each batch of the loop."""
        return {"inner_steps": local.times(self.p.K)}

    # ---------------------------------------------------------------- server
    def mean_weights(self, counts: Sequence[int]) -> Tensor:
        return uniform_weights(counts) if self.p.weights == "uniform" else count_weights(counts)

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        """w^{t+1} = (1 − β) w^t + β mean_S(w_{i,R}) on the parameters; buffers: the mean."""
        old, beta = server["weights"], self.p.beta
        avg = mean.model_state()
        new = {k: (1 - beta) * old[k] + beta * v if k in self.params else v for k, v in avg.items()}
        return ServerUpdate({**server, "weights": new})
