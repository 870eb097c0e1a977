"""Quantity skew: labels IID, client sizes equal (``iid``) or heavy-tailed (``quantity``)."""

from __future__ import annotations

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import (
    check_labels,
    choose,
    make_rng,
    need,
    sizes_with_min,
    split_sizes,
    to_parts,
)
from fedskew.errors import ConfigError


def _w_lognormal(rng: np.random.Generator, n: int, sigma: float, exponent: float, beta: float) -> np.ndarray:
    return rng.lognormal(0.0, sigma, n)


def _w_powerlaw(rng: np.random.Generator, n: int, sigma: float, exponent: float, beta: float) -> np.ndarray:
    if exponent <= 1.0:
        raise ConfigError(
            f"partition 'quantity': exponent must be > 1 (density ∝ w^-exponent), got {exponent}"
        )
    return rng.pareto(exponent - 1.0, n) + 1.0  # Pareto on [1, inf) with density ∝ w^-exponent


def _w_dirichlet(rng: np.random.Generator, n: int, sigma: float, exponent: float, beta: float) -> np.ndarray:
    return rng.dirichlet(np.full(n, beta))  # NIID-Bench quantity skew


_SIZE_DISTRIBUTIONS = {"lognormal": _w_lognormal, "powerlaw": _w_powerlaw, "dirichlet": _w_dirichlet}


def _quantity_owner(
    n: int, num_clients: int, rng: np.random.Generator, weights: np.ndarray | None, min_size: int, scheme: str
) -> np.ndarray:
    need(
        num_clients * max(min_size, 1) <= n,
        scheme,
        f"{num_clients} clients x min_size {max(min_size, 1)} exceeds the {n} samples",
    )
    if weights is None:  # balanced: sizes differ by at most one
        sizes = np.full(num_clients, n // num_clients) + (np.arange(num_clients) < n % num_clients)
    else:
        sizes = sizes_with_min(weights, n, max(min_size, 1))
    return split_sizes(sizes, n, rng)


@PARTITIONERS.register("iid")
def iid(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    unbalanced_sigma: float = 0.0,
    min_size: int = 1,
) -> list[np.ndarray]:
    """IID: a uniform random split; equal sizes, or log-normal sizes when ``unbalanced_sigma`` > 0.

    Unbalanced sizes are ``min_size + (n - N·min_size)·w_i / Σw`` with ``w_i ~ LogNormal(0, σ²)``; labels
    stay IID either way. Every sample is used.
    """
    y = check_labels(labels, num_clients, num_classes, "iid")
    rng = make_rng(seed)
    weights = rng.lognormal(0.0, unbalanced_sigma, num_clients) if unbalanced_sigma > 0 else None
    return to_parts(_quantity_owner(len(y), num_clients, rng, weights, min_size, "iid"), num_clients)


@PARTITIONERS.register("quantity")
def quantity(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    distribution: str = "lognormal",
    sigma: float = 1.0,
    exponent: float = 3.0,
    beta: float = 0.5,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Quantity skew: labels IID, client sizes drawn from a heavy-tailed law (NIID-Bench §4.1).

    ``distribution``: ``lognormal`` (w ~ LogNormal(0, ``sigma``²)), ``powerlaw`` (Pareto on [1, ∞) with
    density ∝ w^-``exponent``) or ``dirichlet`` (w ~ Dir(``beta``·1_N), NIID-Bench's quantity skew).
    Client i receives ``min_size`` samples plus a share ∝ w_i of the rest. Every sample is used.
    """
    y = check_labels(labels, num_clients, num_classes, "quantity")
    rng = make_rng(seed)
    draw = choose(_SIZE_DISTRIBUTIONS, distribution, "distribution", "quantity")
    weights = draw(rng, num_clients, sigma, exponent, beta)
    return to_parts(_quantity_owner(len(y), num_clients, rng, weights, min_size, "quantity"), num_clients)
