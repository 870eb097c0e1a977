"""Partitioners: pure functions ``(labels, num_clients, seed) -> per-client index arrays``.

Every scheme is registered in :data:`fedskew.data.base.PARTITIONERS` under its public name and has the
signature ``fn(labels, num_clients, seed, *, num_classes, domains=None, **params) -> list[np.ndarray]``.
All ``params`` are keyword-only with defaults (configs are validated against the signature). The result is
``num_clients`` disjoint, sorted ``int64`` arrays of indices into ``labels``; a scheme may leave samples
unused where it says so (``nway_kshot``, ``longtail``, ``dirichlet`` in ``per_client`` mode, ...).

Label-based schemes first decide a count matrix ``counts[client, class]`` and then hand out the samples of
each class, shuffled, with :func:`_assign_counts`; so no scheme loops over samples in Python. The same
``seed`` always gives the same partition, whatever algorithm later trains on it. Infeasible requests raise
:class:`~fedskew.errors.DataError` naming the reason. Background and pictures: ``docs/partitions.md``.

Besides the schemes this module holds :func:`apply_partition` (validated dispatch from a config dict),
:func:`client_test_split` (per-client test sets matching each client's label distribution) and
:func:`validation_split` (per-client validation sets carved from training indices).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedskew.data.base import PARTITIONERS
from fedskew.errors import ConfigError, DataError, did_you_mean

#: partitioner arguments that the caller fills in (never set from a config)
RESERVED = frozenset({"num_classes", "domains"})


# ----------------------------------------------------------------------------------------------- helpers
def _rng(seed: int) -> np.random.Generator:
    if int(seed) < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed}")
    return np.random.default_rng(int(seed))


def child_seed(seed: int, tag: int) -> int:
    """An independent integer seed derived from ``(seed, tag)``: sub-steps never share a stream."""
    return int(np.random.SeedSequence([int(seed), int(tag)]).generate_state(1, np.uint32)[0])


def _check(labels: np.ndarray, num_clients: int, num_classes: int, scheme: str) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"partition '{scheme}': labels must be 1-D, got shape {y.shape}")
    y = y.astype(np.int64, copy=False)
    if num_clients < 1:
        raise DataError(f"partition '{scheme}': num_clients must be >= 1, got {num_clients}")
    if num_classes < 1:
        raise DataError(f"partition '{scheme}': num_classes must be >= 1, got {num_classes}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(
            f"partition '{scheme}': labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]"
        )
    return y


def _need(cond: bool, scheme: str, why: str) -> None:
    if not cond:
        raise DataError(f"partition '{scheme}': {why}")


def _to_parts(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """``owner[i]`` = client of sample i (-1 = unused) -> sorted index arrays, one per client."""
    order = np.argsort(owner, kind="stable")  # stable: indices stay ascending inside each client
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    order = order[len(owner) - int(counts.sum()) :].astype(np.int64)
    return [a.copy() for a in np.split(order, np.cumsum(counts)[:-1])]


def _class_blocks(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Indices grouped by class, shuffled inside each class; plus each class's start and size."""
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    sizes = np.bincount(labels, minlength=num_classes)
    return order, np.cumsum(sizes) - sizes, sizes


def _assign_counts(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Owner array giving client i ``counts[i, c]`` random samples of class c, without replacement.

    ``counts.sum(0)`` must not exceed the class sizes; leftover samples get owner -1.
    """
    num_clients, num_classes = counts.shape
    order, start, _ = _class_blocks(labels, num_classes, rng)
    per_class = counts.T.ravel()  # class-major: (c0: clients...), (c1: clients...), ...
    take = counts.sum(0)
    owners = np.repeat(np.tile(np.arange(num_clients), num_classes), per_class)
    offset = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    owner = np.full(len(labels), -1, dtype=np.int64)
    owner[order[np.repeat(start, take) + offset]] = owners
    return owner


def _largest_remainder(weights: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Integer rows proportional to ``weights`` (rows ``[R, K]``) that sum exactly to ``totals`` ``[R]``."""
    w = np.asarray(weights, dtype=np.float64)
    s = w.sum(-1, keepdims=True)
    w = np.divide(w, s, out=np.zeros_like(w), where=s > 0)
    raw = w * np.asarray(totals, dtype=np.float64)[..., None]
    base = np.floor(raw).astype(np.int64)
    missing = np.asarray(totals, dtype=np.int64) - base.sum(-1)
    rank = np.argsort(np.argsort(base - raw, axis=-1, kind="stable"), axis=-1, kind="stable")
    return base + (rank < missing[..., None])


def _sizes(weights: np.ndarray, total: int, min_size: int) -> np.ndarray:
    """Client sizes ``>= min_size`` summing to ``total``, the surplus split in proportion to ``weights``."""
    n = len(weights)
    return min_size + _largest_remainder(weights[None], np.array([total - n * min_size]))[0]


def _split_sizes(owner_sizes: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Owner array for a uniformly random split of ``n`` samples into the given sizes."""
    owner = np.full(n, -1, dtype=np.int64)
    owner[rng.permutation(n)[: int(owner_sizes.sum())]] = np.repeat(np.arange(len(owner_sizes)), owner_sizes)
    return owner


def _choose(table: Mapping[str, Any], name: str, option: str, scheme: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"partition '{scheme}': unknown {option} '{name}'{did_you_mean(name, table)}; "
            f"valid: {', '.join(table)}"
        ) from None


# ----------------------------------------------------------------------------------------------- dispatch
def partition_options(fn: Callable[..., Any]) -> list[str]:
    """The keyword options a partitioner accepts from a config (its signature minus reserved names)."""
    return [
        n
        for n, p in inspect.signature(fn).parameters.items()
        if p.kind is p.KEYWORD_ONLY and n not in RESERVED
    ]


def check_parts(parts: Sequence[np.ndarray], n: int, num_clients: int, scheme: str) -> list[np.ndarray]:
    """Validate a partitioner's output: ``num_clients`` disjoint sorted in-range int64 arrays."""
    if len(parts) != num_clients:
        raise DataError(f"partition '{scheme}' returned {len(parts)} clients, expected {num_clients}")
    out = [np.asarray(p, dtype=np.int64) for p in parts]
    flat = np.concatenate(out) if out else np.zeros(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n):
        raise DataError(f"partition '{scheme}' returned indices outside [0, {n})")
    if flat.size != np.unique(flat).size:
        raise DataError(f"partition '{scheme}' returned overlapping clients")
    return [p if p.size < 2 or bool(np.all(p[1:] > p[:-1])) else np.sort(p) for p in out]


def apply_partition(
    spec: Mapping[str, Any],
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    where: str = "data.partition",
) -> list[np.ndarray]:
    """Run the scheme ``spec = {"name": ..., **options}``, rejecting unknown options (with did-you-mean).

    ``where`` is the config path used in error messages (nested specs pass e.g. ``data.partition.then``).
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"config key '{where}' must be a mapping like {{name: dirichlet, alpha: 0.5}}")
    options = dict(spec)
    name = options.pop("name", None)
    if name is None:
        raise ConfigError(f"config key '{where}.name' is required; valid: {', '.join(PARTITIONERS.names())}")
    fn = PARTITIONERS.get(str(name))
    allowed = partition_options(fn)
    for key in options:
        if key not in allowed:
            raise ConfigError(
                f"config key '{where}.{key}': unknown option of partition '{name}'"
                f"{did_you_mean(key, allowed)}; allowed: {', '.join(allowed) or '(none)'}"
            )
    parts = fn(labels, num_clients, seed, num_classes=num_classes, domains=domains, **options)
    return check_parts(parts, len(labels), num_clients, str(name))


# ----------------------------------------------------------------------------------------------- quantity
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
    _need(
        num_clients * max(min_size, 1) <= n,
        scheme,
        f"{num_clients} clients x min_size {max(min_size, 1)} exceeds the {n} samples",
    )
    if weights is None:  # balanced: sizes differ by at most one
        sizes = np.full(num_clients, n // num_clients) + (np.arange(num_clients) < n % num_clients)
    else:
        sizes = _sizes(weights, n, max(min_size, 1))
    return _split_sizes(sizes, n, rng)


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
    y = _check(labels, num_clients, num_classes, "iid")
    rng = _rng(seed)
    weights = rng.lognormal(0.0, unbalanced_sigma, num_clients) if unbalanced_sigma > 0 else None
    return _to_parts(_quantity_owner(len(y), num_clients, rng, weights, min_size, "iid"), num_clients)


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
    y = _check(labels, num_clients, num_classes, "quantity")
    rng = _rng(seed)
    draw = _choose(_SIZE_DISTRIBUTIONS, distribution, "distribution", "quantity")
    weights = draw(rng, num_clients, sigma, exponent, beta)
    return _to_parts(_quantity_owner(len(y), num_clients, rng, weights, min_size, "quantity"), num_clients)


# ----------------------------------------------------------------------------------------------- dirichlet
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
    _need(
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
    _need(
        size >= max(min_size, 1),
        "dirichlet",
        f"per_client mode gives each client {size} samples, below min_size={max(min_size, 1)}",
    )
    present = supply > 0
    probs = np.zeros((num_clients, num_classes))
    probs[:, present] = rng.dirichlet(np.full(int(present.sum()), alpha), size=num_clients)
    # counts follow the mix exactly (largest remainder), so alpha -> inf gives exactly IID proportions
    counts = _largest_remainder(probs, np.full(num_clients, size))
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
        counts += _largest_remainder(w, deficit)
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
    y = _check(labels, num_clients, num_classes, "dirichlet")
    if alpha <= 0:
        raise ConfigError(f"partition 'dirichlet': alpha must be > 0, got {alpha}")
    alloc = _choose(_DIRICHLET_MODES, mode, "mode", "dirichlet")
    rng = _rng(seed)
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
    return _to_parts(_assign_counts(y, counts, rng), num_clients)


# ----------------------------------------------------------------------------------------------- pathological
@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """McMahan et al. 2017 (FedAvg) shards: sort by label, cut into N·s equal shards, s random shards each.

    With MNIST, 100 clients and s = 2 this is the paper's 200 shards of 300 images. Shard sizes differ by at
    most one when N·s does not divide n; every sample is used.
    """
    y = _check(labels, num_clients, num_classes, "shards")
    _need(shards_per_client >= 1, "shards", f"shards_per_client must be >= 1, got {shards_per_client}")
    total = num_clients * shards_per_client
    _need(total <= len(y), "shards", f"{total} shards (N x shards_per_client) exceed the {len(y)} samples")
    rng = _rng(seed)
    order = np.lexsort((rng.random(len(y)), y))  # by label; ties (same class) in random order
    shard_sizes = np.full(total, len(y) // total) + (np.arange(total) < len(y) % total)
    shard_owner = rng.permutation(total) // shards_per_client
    owner = np.empty(len(y), dtype=np.int64)
    owner[order] = np.repeat(shard_owner, shard_sizes)
    return _to_parts(owner, num_clients)


@PARTITIONERS.register("classes_per_client")
def classes_per_client(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    k: int = 2,
) -> list[np.ndarray]:
    """Each client holds exactly ``k`` classes (the "#C = k" skew of NIID-Bench / FedProx / pFedMe).

    Clients pick their classes in turn among the classes held by the fewest clients so far (random ties), so
    each class is held by ⌊Nk/C⌋ or ⌈Nk/C⌉ clients and every class is used when N·k ≥ C. A class's samples
    are split equally (±1) among its holders.
    """
    y = _check(labels, num_clients, num_classes, "classes_per_client")
    class_sizes = np.bincount(y, minlength=num_classes)
    present = np.flatnonzero(class_sizes)
    _need(
        1 <= k <= len(present),
        "classes_per_client",
        f"k={k} classes per client, but the labels have {len(present)} classes (need 1 <= k <= classes)",
    )
    rng = _rng(seed)
    holders = np.zeros(len(present))
    mask = np.zeros((num_clients, num_classes), dtype=bool)
    for i in range(num_clients):  # per client (not per sample): least-held classes first
        pick = np.argpartition(holders + rng.random(len(present)), k - 1)[:k]
        holders[pick] += 1
        mask[i, present[pick]] = True
    held = mask.sum(0)
    short = np.flatnonzero(mask.any(0) & (class_sizes < held))
    if short.size:
        c = int(short[0])
        raise DataError(
            f"partition 'classes_per_client': class {c} has {class_sizes[c]} samples for {held[c]} clients "
            "that must hold it; lower k or num_clients"
        )
    # equal split of each class among its holders; the +1 remainders go to random holders
    rank = np.argsort(np.argsort(np.where(mask, rng.random(mask.shape), np.inf), axis=0), axis=0)
    base, extra = np.divmod(class_sizes, np.maximum(held, 1))
    counts = mask * (base + (rank < extra))
    return _to_parts(_assign_counts(y, counts.astype(np.int64), rng), num_clients)


def _shots_uniform(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    return rng.integers(k - s + 1, k + s + 1, n) if s > 0 else np.full(n, k)


def _shots_mnist_code(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    if s < 2:
        raise ConfigError(
            f"partition 'nway_kshot': shot_noise 'mnist_code' draws k from [k-s+1, k+s-2], empty for "
            f"stdev={s}; use stdev >= 2 or shot_noise 'uniform'"
        )
    return rng.integers(k - s + 1, k + s - 1, n)


def _shots_gaussian(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    return np.maximum(np.rint(rng.normal(k, s, n)), 1).astype(np.int64)


def _shots_none(rng: np.random.Generator, n: int, k: int, s: int) -> np.ndarray:
    return np.full(n, k)


_SHOT_NOISE = {
    "uniform": _shots_uniform,
    "mnist_code": _shots_mnist_code,
    "gaussian": _shots_gaussian,
    "none": _shots_none,
}


@PARTITIONERS.register("nway_kshot")
def nway_kshot(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    n: int = 3,
    stdev: int = 2,
    k: int = 100,
    shot_noise: str = "uniform",
    max_retries: int = 100,
) -> list[np.ndarray]:
    """FedProto's n-way k-shot tasks (Tan et al. 2022, §5; spec §4.2 and §6 A8).

    Client i holds ``n_i ~ U{max(2, n−stdev), …, min(C−1, n+stdev)}`` classes (uniform integers, as the
    FedProto code; the lower bound 2 and upper bound C−1 are the code's clips), drawn uniformly without
    replacement, and ``k_i`` samples of each. ``shot_noise``: ``uniform`` ``k_i ~ U{k−stdev+1, …, k+stdev}``
    (spec A8's recommendation; FedProto's CIFAR-10/FEMNIST code), ``mnist_code`` ``U{k−stdev+1, …,
    k+stdev−2}`` (FedProto's MNIST code path, empty for stdev < 2), ``gaussian`` ``round(N(k, stdev²))`` or
    ``none`` (exactly k). Samples are drawn without replacement across clients; the rest stay unused. If a
    draw asks for more samples of a class than exist, the draw is repeated (``max_retries``).
    """
    y = _check(labels, num_clients, num_classes, "nway_kshot")
    lo, hi = max(2, n - stdev), min(num_classes - 1, n + stdev)
    _need(
        lo <= hi,
        "nway_kshot",
        f"n={n} ± stdev={stdev} ways gives no valid class count in [2, num_classes-1={num_classes - 1}]",
    )
    _need(k >= 1 and stdev >= 0, "nway_kshot", f"need k >= 1 and stdev >= 0, got k={k}, stdev={stdev}")
    draw_shots = _choose(_SHOT_NOISE, shot_noise, "shot_noise", "nway_kshot")
    supply = np.bincount(y, minlength=num_classes)
    rng = _rng(seed)
    worst = (0, 0, 0)
    for _ in range(max(max_retries, 1)):
        ways = rng.integers(lo, hi + 1, num_clients)
        shots = draw_shots(rng, num_clients, k, stdev)
        rank = np.argsort(rng.random((num_clients, num_classes)), axis=1).argsort(axis=1)
        counts = (rank < ways[:, None]) * shots[:, None]
        demand = counts.sum(0)
        if np.all(demand <= supply):
            return _to_parts(_assign_counts(y, counts.astype(np.int64), rng), num_clients)
        c = int(np.argmax(demand - supply))
        worst = max(worst, (int(demand[c] - supply[c]), c, int(demand[c])))
    raise DataError(
        f"partition 'nway_kshot': each of {max_retries} draws asked for more samples of a class than exist "
        f"(e.g. {worst[2]} of class {worst[1]}, which has {supply[worst[1]]}); lower k, n or num_clients"
    )


# ----------------------------------------------------------------------------------------------- composed
@PARTITIONERS.register("longtail")
def longtail(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    rho: float = 100.0,
    n_max: int | None = None,
    then: dict | None = None,
) -> list[np.ndarray]:
    """Global long tail (CIFAR-LT, Cao et al. 2019 LDAM), then any other scheme (``then``, default iid).

    Class c keeps ``n_c = ⌊n_max · ρ^(−c/(C−1))⌋`` random samples (head = class 0, ``ρ = n_max/n_min``);
    ``n_max`` defaults to the smallest class size, so the profile is exact on any dataset. The kept pool is
    then split by ``then`` (e.g. ``{"name": "dirichlet", "alpha": 0.2}``, FedSKC's CIFAR-10-LT setting:
    subsample first, then partition, spec §6 X5). The test set is left balanced.
    """
    y = _check(labels, num_clients, num_classes, "longtail")
    if rho < 1:
        raise ConfigError(f"partition 'longtail': rho must be >= 1 (head/tail ratio), got {rho}")
    sizes = np.bincount(y, minlength=num_classes)
    top = int(sizes.min()) if n_max is None else int(n_max)
    c = np.arange(num_classes, dtype=np.float64)
    target = (top * (1.0 / rho) ** (c / max(num_classes - 1, 1))).astype(np.int64)  # LDAM's int() floor
    short = np.flatnonzero(target > sizes)
    if short.size:
        c = int(short[0])
        raise DataError(
            f"partition 'longtail': class {c} needs {target[c]} samples for n_max={top}, rho={rho} but has "
            f"{sizes[c]}; lower n_max"
        )
    rng = _rng(seed)
    kept = np.flatnonzero(_assign_counts(y, target[None], rng) == 0)
    inner = apply_partition(
        then or {"name": "iid"},
        y[kept],
        num_clients,
        child_seed(seed, 1),
        num_classes=num_classes,
        domains=None if domains is None else np.asarray(domains)[kept],
        where="data.partition.then",
    )
    return [kept[p] for p in inner]


def _cap_per_class(
    parts: list[np.ndarray], labels: np.ndarray, num_classes: int, cap: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Keep at most ``cap`` random samples of each class in each client."""
    owner = np.full(len(labels), -1, dtype=np.int64)
    for i, p in enumerate(parts):
        owner[p] = i
    used = np.flatnonzero(owner >= 0)
    group = owner[used] * num_classes + labels[used]
    order = np.lexsort((rng.random(len(used)), group))
    sizes = np.bincount(group, minlength=len(parts) * num_classes)
    rank = np.arange(len(used)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    owner[used[order[rank >= cap]]] = -1
    return _to_parts(owner, len(parts))


@PARTITIONERS.register("domain")
def domain(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    *,
    num_classes: int,
    domains: np.ndarray | None = None,
    label_skew: dict | None = None,
    max_per_class: int | None = None,
) -> list[np.ndarray]:
    """Feature skew: one domain per client (FedBN / FedPCL / MP-FedCL); optional label skew inside domains.

    Client i belongs to domain ``i mod D`` (so with N = D client i holds domain i, MP-FedCL's order). A
    domain's samples are split over its clients IID, or by ``label_skew`` (a scheme spec such as
    ``{"name": "dirichlet", "alpha": 0.5}``) applied inside each domain. ``max_per_class`` keeps at most that
    many samples per class per client (MP-FedCL's Digit-5: 10 per class).
    """
    y = _check(labels, num_clients, num_classes, "domain")
    _need(
        domains is not None, "domain", "needs per-sample domain tags, but the dataset has none (domain_train)"
    )
    dom = np.asarray(domains, dtype=np.int64)
    _need(dom.shape == y.shape, "domain", f"domains has shape {dom.shape}, labels {y.shape}")
    ids = np.unique(dom)
    _need(
        num_clients >= len(ids),
        "domain",
        f"{num_clients} clients for {len(ids)} domains (need clients >= domains)",
    )
    client_domain = np.arange(num_clients) % len(ids)
    parts: list[np.ndarray] = [np.zeros(0, np.int64)] * num_clients
    for j, d in enumerate(ids):  # per domain: a handful of iterations
        idx = np.flatnonzero(dom == d)
        clients = np.flatnonzero(client_domain == j)
        try:
            sub = apply_partition(
                label_skew or {"name": "iid"},
                y[idx],
                len(clients),
                child_seed(seed, j),
                num_classes=num_classes,
                where="data.partition.label_skew",
            )
        except DataError as err:
            raise DataError(f"partition 'domain', domain {int(d)}: {err}") from None
        for cid, p in zip(clients, sub, strict=True):
            parts[cid] = idx[p]
    if max_per_class is not None:
        parts = _cap_per_class(parts, y, num_classes, int(max_per_class), _rng(seed))
    return parts


# ----------------------------------------------------------------------------------------------- splits
def validation_split(
    parts: Sequence[np.ndarray], val_fraction: float, seed: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Carve ``round(val_fraction · n_i)`` random samples (keeping >= 1 for training) out of each client.

    Returns ``(train, val)`` per client, both sorted. Validation is for best-round selection; test never is.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    if val_fraction == 0.0:
        return parts, [np.zeros(0, np.int64) for _ in parts]
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    n_val = np.minimum(np.rint(val_fraction * sizes).astype(np.int64), np.maximum(sizes - 1, 0))
    owner = np.repeat(np.arange(len(parts)), sizes)
    order = np.lexsort((_rng(seed).random(len(owner)), owner))
    rank = np.arange(len(owner)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    is_val = np.zeros(len(owner), dtype=bool)
    is_val[order[rank < n_val[owner[order]]]] = True
    flags = np.split(is_val, np.cumsum(sizes)[:-1])
    pairs = list(zip(parts, flags, strict=True))
    return [p[~f] for p, f in pairs], [p[f] for p, f in pairs]


def _trim_to_pool(target: np.ndarray, exact: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Undo rounding-up where a class's total demand exceeds its pool: the clients rounded up the most
    give back one sample each (rounding adds less than one per client, so one pass suffices)."""
    excess = np.maximum(target.sum(0) - pool, 0)
    if not excess.any():
        return target
    surplus = np.where(target > 0, target - exact, -np.inf)
    rank = np.argsort(np.argsort(-surplus, axis=0, kind="stable"), axis=0, kind="stable")
    return target - ((rank < excess[None]) & (target > 0))


def client_test_split(
    train_labels_per_client: Sequence[np.ndarray],
    test_labels: np.ndarray,
    seed: int,
    *,
    per_class: int | None = None,
    fraction: float | None = None,
    size: int | None = None,
    disjoint: bool = True,
    whole: bool = False,
    num_classes: int | None = None,
    train_domains_per_client: Sequence[np.ndarray] | None = None,
    test_domains: np.ndarray | None = None,
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Per-client test sets from the global test set, matching each client's training label distribution.

    Personalized evaluation as in FedProto (spec §4.3) and MP-FedCL (spec §5.2). Client i's target count
    for class c (or, with domains, for each (domain, class) pair it trains on) is:

    * ``per_class=m``: m for every class the client holds (FedProto: 40 on MNIST, 15 on CIFAR-10/FEMNIST);
    * ``size=s``: s samples in proportion to its training histogram (largest-remainder rounding);
    * ``fraction=f``: ``round(f · n_i)`` samples in proportion to its training histogram;
    * default: ``round(f* · n_i)`` samples in proportion to its training histogram with
      ``f* = min(1, min_c pool_c / Σ_i n_ic)``: the largest proportional test sets that the pool can serve
      disjointly (where rounding up would overdraw a class, the clients rounded up the most give one back);
    * ``whole=True``: every client is tested on the whole test set (a personal-model method scored on the
      balanced global test set, as FedSKC's Table I does for FedProto).

    Test sets are disjoint across clients (``disjoint=True``) for every class whose pool covers the total
    demand; for a class that it does not, each client draws its own sample (without replacement, at most the
    whole pool) independently of the others, so clients may share test samples of that class. Returns
    ``(indices per client, info)`` with ``info = {"disjoint": bool, "shared_classes": [...], "fraction": f,
    "rule": ...}``; ``shared_classes`` lists the classes (or ``(domain, class)`` pairs) sampled independently.
    """
    y_test = np.asarray(test_labels, dtype=np.int64)
    train = [np.asarray(t, dtype=np.int64) for t in train_labels_per_client]
    N = len(train)
    C = int(num_classes or max([int(y_test.max(initial=-1))] + [int(t.max(initial=-1)) for t in train]) + 1)
    C = max(C, 1)
    if (train_domains_per_client is None) != (test_domains is None):
        raise ConfigError(
            "client_test_split: give both train_domains_per_client and test_domains, or neither"
        )
    if sum(x is not None for x in (per_class, fraction, size)) + bool(whole) > 1:
        raise ConfigError("data.test: set at most one of per_class, fraction, size, whole")
    if whole:
        everything = np.arange(len(y_test), dtype=np.int64)
        info_whole = {"fraction": None, "rule": "whole", "disjoint": False, "shared_classes": []}
        return [everything.copy() for _ in train], info_whole
    # keys: class, or (domain, class) flattened when domains are given
    if test_domains is not None and train_domains_per_client is not None:
        d_test = np.asarray(test_domains, dtype=np.int64)
        d_train = [np.asarray(d, dtype=np.int64) for d in train_domains_per_client]
        D = int(max([int(d_test.max(initial=-1))] + [int(d.max(initial=-1)) for d in d_train]) + 1)
        test_keys = d_test * C + y_test
        train_keys = [d * C + t for d, t in zip(d_train, train, strict=True)]
    else:
        D, test_keys, train_keys = 1, y_test, train
    K = D * C
    owner_train = np.repeat(np.arange(N), [len(t) for t in train])
    flat_keys = np.concatenate(train_keys) if train_keys else np.zeros(0, np.int64)
    hist = np.bincount(owner_train * K + flat_keys, minlength=N * K).reshape(N, K)
    pool = np.bincount(test_keys, minlength=K)
    sizes = hist.sum(1)
    info: dict[str, Any] = {"fraction": None}
    if per_class is not None:
        target = (hist > 0) * int(per_class)
        info["rule"] = f"per_class={per_class}"
    elif size is not None:
        target = _largest_remainder(hist, np.where(sizes > 0, int(size), 0))
        info["rule"] = f"size={size}"
    elif fraction is not None:
        if not fraction > 0:
            raise ConfigError(f"data.test.fraction must be > 0, got {fraction}")
        target = _largest_remainder(hist, np.rint(fraction * sizes).astype(np.int64))
        info["rule"], info["fraction"] = f"fraction={fraction}", float(fraction)
    else:
        demand = hist.sum(0)
        ratio = np.divide(pool, demand, out=np.full(K, np.inf), where=demand > 0)
        f = float(min(1.0, ratio.min(initial=np.inf)))
        target = _trim_to_pool(_largest_remainder(hist, np.rint(f * sizes).astype(np.int64)), f * hist, pool)
        info["rule"], info["fraction"] = "proportional, largest disjoint", f
    rng = _rng(seed)
    over = target.sum(0) > pool if disjoint else target.sum(0) > 0
    owner = _assign_counts(test_keys, np.where(over[None], 0, target), rng)
    parts = _to_parts(owner, N)
    shared = np.flatnonzero(over)
    if shared.size:
        blocks, start, block_size = _class_blocks(test_keys, K, rng)
        extra: list[list[np.ndarray]] = [[] for _ in range(N)]
        for key in shared:  # independent draws: per (class, client), never per sample
            members = blocks[start[key] : start[key] + block_size[key]]
            for i in np.flatnonzero(target[:, key]):
                take = min(int(target[i, key]), len(members))
                extra[i].append(rng.choice(members, take, replace=False))
        parts = [np.sort(np.concatenate([p, *e])) if e else p for p, e in zip(parts, extra, strict=True)]
    info["disjoint"] = bool(shared.size == 0)
    info["shared_classes"] = [int(k) if D == 1 else (int(k // C), int(k % C)) for k in shared]
    return parts, info
