"""Algorithms: one module per method; importing this package registers them all."""

from fedskew.algorithms import (  # noqa: F401
    cachefl,
    clip_baselines,
    fedavg,
    fedcos,
    feddyn,
    fedent,
    fednh,
    fedopt,
    fedper,
    fedproto,
    fedprox,
    fedrcl,
    fedrep,
    fedskc,
    local,
    moon,
    mpfedcl,
    scaffold,
)
from fedskew.algorithms.base import ALGORITHMS, Algorithm, HyperParams, Payload

__all__ = ["ALGORITHMS", "Algorithm", "HyperParams", "Payload"]
