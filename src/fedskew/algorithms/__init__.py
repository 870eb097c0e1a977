"""Algorithms: one module per method; importing this package registers them all."""

from fedskew.algorithms import fedavg, feddyn, fedopt, fedprox, local, moon, scaffold  # noqa: F401
from fedskew.algorithms.base import ALGORITHMS, Algorithm, HyperParams, Payload

__all__ = ["ALGORITHMS", "Algorithm", "HyperParams", "Payload"]
