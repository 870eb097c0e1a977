"""FedBN (Li, Jiang, Zhang, Kamp, Dou 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR), Algorithm 1.

FedAvg in which every BatchNorm layer stays on its client: the server averages all other parameters
``w ← Σ_k (n_k/Σn) w_k`` (Algorithm 1, line 8: "excluding BN parameters"), and each client keeps its BN
affine parameters (γ, β) *and* running statistics (mean, variance, batch counter) across rounds. A client is
trained and evaluated with the received shared layers and its own BN layers; there is no global model
(Algorithm 1 has none: the paper evaluates each client on its own test set), so evaluation is per client.

Choices (docs/decisions.md, "FedBN"):

* A client that has not been sampled yet holds the initial model's BN layers (the paper initialises every
  client from the same model and every client takes part in every round, so the case does not arise there).
* Which entries are "BN": every state entry of a ``torch.nn`` BatchNorm module (``_BatchNorm``: 1-d, 2-d,
  3-d, and SyncBatchNorm). GroupNorm / LayerNorm have no running statistics and are shared, as in the paper,
  which names only BN.
* A model without BatchNorm has no personal layer: FedBN is then FedAvg evaluated per client (a warning says
  so once).

Engine modes: the sequential loop and the worker processes load the client's BN entries with the shared ones
before training (``model_weights``) and return the trained ones in the client's state, so running statistics
are updated exactly as in ``torch.nn.BatchNorm`` training mode and never mixed across clients. Under
``engine.mode=vectorized`` running statistics cannot be updated under ``vmap``, so FedBN is not vectorizable:
the engine trains it in the sequential loop (with a log line), which gives the same numbers.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from torch import nn

from fedskew.algorithms.base import ALGORITHMS, HyperParams
from fedskew.algorithms.fedper import FedPer

log = logging.getLogger(__name__)


def batchnorm_names(model: nn.Module) -> set[str]:
    """State-dict names of every BatchNorm entry of ``model`` (γ, β, running mean / var, batch counter)."""
    out: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            out |= {f"{prefix}.{k}" if prefix else k for k in module.state_dict()}
    return out


@ALGORITHMS.register("fedbn")
class FedBN(FedPer):
    """FedBN (Li et al. 2021): FedAvg on every layer but BatchNorm, which each client keeps."""

    personal_what: ClassVar[str] = "BatchNorm layers"
    #: the loss is plain cross-entropy, but FedBN's models have BatchNorm, whose running statistics cannot
    #: be updated under vmap: ``engine.mode=vectorized`` runs FedBN in the sequential loop
    vectorizable = False

    class Params(HyperParams):
        """FedBN has no hyper-parameter beyond FedAvg's (the local SGD settings are the client config's)."""

    def personal_layers(self, model: nn.Module) -> set[str]:
        names = batchnorm_names(model)
        if not names:
            log.warning("fedbn: the model has no BatchNorm layer, so FedBN is FedAvg evaluated per client")
        return names
