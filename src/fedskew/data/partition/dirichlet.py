"""Label skew by Dirichlet draws: per class (Yurochkin et al. 2019, NIID-Bench) or per client (Hsu et al.)."""

from __future__ import annotations

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition.core import (
    assign_counts,
    check_labels,
    choose,
    largest_remainder,
    make_rng,
    need,
    to_parts,
)
from fedskew.errors import ConfigError, DataError


def _dirichlet_per_class(
    y: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    min_size: int,
    balance: bool,
    max_retries: int,
) -> np.ndarray:
    class_sizes = np.bincount(y, minlength=num_classes)
    n = len(y)
    need(
        num_clients * min_size <= n,
        "dirichlet",
        f"{num_clients} clients x min_size {min_size} exceeds {n} samples",
    )
    cap = n / num_clients
    conc = np.full(num_clients, alpha)
    best = 0
    for _ in range(max(max_retries, 1)):
        counts = np.zeros((num_clients, num_classes), dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c in range(num_classes):  # sequential over classes: the balance mask depends on earlier ones
            p = rng.dirichlet(conc)
            if balance:  # NIID-Bench: clients already holding >= n/N samples get no more
                q = p * (sizes < cap)
                p = q / q.sum() if q.sum() > 0 else p
            cuts = (np.cumsum(p) * class_sizes[c]).astype(np.int64)
            cuts[-1] = class_sizes[c]
            counts[:, c] = np.diff(cuts, prepend=0)
            sizes += counts[:, c]
        if sizes.min() >= min_size:
            return counts
        best = max(best, int(sizes.min()))
    raise DataError(
        f"partition 'dirichlet': no draw gave every client >= min_size={min_size} samples in {max_retries} "
        f"tries (best smallest client: {best}); lower min_size or num_clients, or raise alpha={alpha}"
    )


def _dirichlet_per_client(
    y: np.ndarray,
    num_clients: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    min_size: int,
    balance: bool,
    max_retries: int,
) -> np.ndarray:
    supply = np.bincount(y, minlength=num_classes)
    size = len(y) // num_clients
    need(
        size >= max(min_size, 1),
        "dirichlet",
        f"per_client mode gives each client {size} samples, below min_size={max(min_size, 1)}",
    )
    present = supply > 0
    probs = np.zeros((num_clients, num_classes))
    probs[:, present] = rng.dirichlet(np.full(int(present.sum()), alpha), size=num_clients)
    # counts follow the mix exactly (largest remainder), so alpha -> inf gives exactly IID proportions
    counts = largest_remainder(probs, np.full(num_clients, size))
    # Without replacement: an over-demanded class is shared out among its requesters (hypergeometric), and
    # the shortfall is redrawn from the client's own mix restricted to classes with samples left. Each pass
    # exhausts the classes it caps, so at most C + 1 passes are needed.
    for _ in range(num_classes + 1):
        for c in np.flatnonzero(counts.sum(0) > supply):
            counts[:, c] = rng.multivariate_hypergeometric(counts[:, c], int(supply[c]))
        deficit = size - counts.sum(1)
        if not deficit.any():
            return counts
        avail = (supply - counts.sum(0)) > 0
        w = probs * avail
        flat = w.sum(1) <= 1e-300  # the client's mix has (numerically) no mass left: uniform over the rest
        w[flat] = avail
        counts += largest_remainder(w, deficit)
    raise AssertionError("per_client Dirichlet allocation did not converge")  # unreachable: supply >= demand


_DIRICHLET_MODES = {"per_class": _dirichlet_per_class, "per_client": _dirichlet_per_client}


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    alpha: float = 0.5,
    min_size: int = 10,
    mode: str = "per_class",
    balance: bool = True,
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Label skew by Dirichlet(``alpha``); ``mode`` ``per_class`` (NIID-Bench) or ``per_client`` (Hsu et al.).

    ``per_class`` (Yurochkin et al. 2019; Li et al. NIID-Bench 2022, used by FedSKC, FedEnt, MP-FedCL): for
    each class c, ``q ~ Dir(α·1_N)`` over clients and class c's samples are cut at ``cumsum(q)·n_c``. With
    ``balance`` (NIID-Bench's trick) clients that already hold ``>= n/N`` samples get ``q_i = 0`` for the
    following classes. The whole draw is repeated until every client holds ``>= min_size`` samples, at most
    ``max_retries`` times. Uses every sample; client sizes vary.

    ``per_client`` (Hsu et al. 2019): each client draws its class mix ``p ~ Dir(α·1_C)``, all clients get
    ``⌊n/N⌋`` samples, drawn without replacement from the class pools (a client whose classes run dry is
    topped up from its mix over the classes that have samples left). Hsu et al. write ``Dir(α'·prior)``;
    with a uniform prior that is ``α = α'/C`` here. ``n mod N`` samples stay unused.

    Small α -> few classes per client; α -> ∞ -> IID.
    """
    y = check_labels(labels, num_clients, num_classes, "dirichlet")
    if alpha <= 0:
        raise ConfigError(f"partition 'dirichlet': alpha must be > 0, got {alpha}")
    alloc = choose(_DIRICHLET_MODES, mode, "mode", "dirichlet")
    rng = make_rng(seed)
    counts = alloc(
        y,
        num_clients,
        num_classes,
        rng,
        alpha=alpha,
        min_size=min_size,
        balance=balance,
        max_retries=max_retries,
    )
    return to_parts(assign_counts(y, counts, rng), num_clients)
