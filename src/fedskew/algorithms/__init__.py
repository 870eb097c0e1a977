"""Algorithms: one module per method; importing this package registers them all."""

from fedskew.algorithms import (  # noqa: F401
    cachefl,
    ccvr,
    clip_baselines,
    fedavg,
    fedbn,
    fedcos,
    feddecorr,
    feddyn,
    fedent,
    fedgen,
    fedlc,
    fednh,
    fednova,
    fedntd,
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
    qfedavg,
    scaffold,
)
from fedskew.algorithms.base import ALGORITHMS, Algorithm, HyperParams, Payload

__all__ = ["ALGORITHMS", "Algorithm", "HyperParams", "Payload"]
