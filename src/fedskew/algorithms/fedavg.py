"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data").

The base :class:`~fedskew.algorithms.base.Algorithm` already *is* FedAvg: the server broadcasts the global
model, clients run local SGD on cross-entropy, and the server takes the sample-weighted mean
``w ← Σ_k (n_k / n) w_k`` of the uploaded model states (Alg. 1, FederatedAveraging).
"""

from __future__ import annotations

from fedskew.algorithms.base import (
    ALGORITHMS,
    Algorithm,
)


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    """FedAvg (McMahan et al. 2017): local SGD, sample-weighted model averaging."""
