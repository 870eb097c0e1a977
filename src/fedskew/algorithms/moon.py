"""MOON (Li, He, Song 2021, "Model-Contrastive Federated Learning", CVPR), Eq. (3)–(4), Alg. 1.

Local loss on a batch, with z the local model's representation, z_glob that of the received (frozen) global
model and z_prev that of the client's previous local model (frozen):

    ℓ = CE(head(z), y) + μ ℓ_con,
    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

sim the cosine similarity, averaged over the batch. Aggregation is FedAvg's.

Deviations / choices:

* MOON's network ends its base encoder with a projection head and contrasts the projection; here z is our
  models' ``features()`` output (the representation, followed directly by the classifier). A model whose
  ``features`` ends in a projection MLP reproduces the paper's architecture.
* At a client's first participation there is no previous local model. The reference code's model pool is
  then empty and the contrastive term contributes nothing; using the global model as the previous one gives
  the same gradient (z_prev = z_glob makes ℓ_con ≡ log 2). We omit the term in that case, which saves two
  frozen forward passes, so the reported training loss is plain CE there.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import cast

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    Batch,
    Context,
    HyperParams,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    clone_state,
    load_state,
)
from fedskew.algorithms.helpers import frozen
from fedskew.models.base import FedModel
from fedskew.search_space import tunable


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """MOON's ℓ_con (Eq. 3), mean over the batch: a 2-way cross-entropy whose positive is the global
    representation and whose negative is the previous local one."""
    sims = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], 1)
    target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return F.cross_entropy(sims / tau, target)


@ALGORITHMS.register("moon")
class Moon(Algorithm):
    """MOON (Li et al. 2021): model-contrastive loss between local, global and previous representations."""

    vectorizable = False

    class Params(HyperParams):
        mu: float = tunable(
            5.0,
            low=0.1,
            high=10.0,
            log=True,
            ge=0.0,
            description="weight μ of the model-contrastive loss (source: Li et al. 2021 §4.1, μ=5 for "
            "CIFAR-10; they use 1 for CIFAR-100 / Tiny-ImageNet, as FedSKC's baseline setup; search: the "
            "range of {0.1, 1, 5, 10}, the grid issue 52 cites for MOON, log)",
        )
        tau: float = Field(0.5, gt=0.0, description="temperature τ (source: Li et al. 2021 §4.1, τ=0.5)")

    p: Params
    #: the frozen reference networks per architecture (see :meth:`references`)
    working_buffers = frozenset({"reference_nets"})

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        # Frozen reference models per architecture (clients' models may differ: ``model.per_client``), built
        # on first use and reloaded per client (no per-batch copies). A working buffer, not state: the
        # networks a round uses reach ``local_loss`` through the plan's ``derived``.
        self.reference_nets: dict[Hashable, tuple[nn.Module, nn.Module]] = {}

    def references(self, cid: int) -> tuple[nn.Module, nn.Module]:
        """The (global, previous) reference networks in client ``cid``'s architecture."""
        key = self.ctx.arch_key(cid)
        if key not in self.reference_nets:
            build = self.ctx.build_model
            # frozen references: running BatchNorm statistics, no dropout
            self.reference_nets[key] = (frozen(build(cid)), frozen(build(cid)))
        return self.reference_nets[key]

    def start_local(self, step: LocalStep) -> LocalPlan:
        """Load the received global model and the client's previous one into the frozen references of its
        architecture, handed to ``local_loss`` as ``step.derived["references"]``."""
        plan = super().start_local(step)
        if "prev" not in step.state:  # first participation: no reference (see the module docstring)
            return plan
        global_net, prev_net = self.references(step.cid)
        load_state(global_net, step.payload.model_state())
        load_state(prev_net, step.state["prev"])
        return LocalPlan(plan.phases, derived={"references": (global_net, prev_net)})

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        model = cast(FedModel, step.model)
        z = model.features(batch.x)
        loss = F.cross_entropy(model.head(z), batch.y)
        if "prev" not in step.state or self.p.mu == 0.0:  # first participation: see the module docstring
            return loss
        if "references" not in step.derived:
            raise RuntimeError("moon: local_loss called before start_local loaded the reference models")
        global_net, prev_net = step.derived["references"]
        with torch.no_grad():
            z_glob = global_net.features(batch.x)
            z_prev = prev_net.features(batch.x)
        return loss + self.p.mu * model_contrastive_loss(z, z_glob, z_prev, self.p.tau)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        # The trained model becomes next participation's "previous" one; cloned because the engine reuses
        # ``model`` for the next client.
        out = super().finish_local(step, result)
        return LocalOutput(out.upload, {**step.state, "prev": clone_state(step.model.state_dict())})
