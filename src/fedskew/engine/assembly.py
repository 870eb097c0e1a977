"""From a federated dataset to the engine's parts, each built only where it is used.

* :class:`ClientMeta`: what the algorithm's :class:`~fedskew.algorithms.base.Context` needs to know about
  the clients (their sample and class counts), without their samples. A server process keeps this and
  the evaluation data, never the clients' training sets (docs/deployment.md).
* :func:`construct_algorithm`: the algorithm and the :class:`~fedskew.engine.runtime.ModelCache` that
  builds its models, each given the other at construction.
* :func:`client_data`: the clients' training samples on the device (all clients, or a node's own), for a
  :class:`~fedskew.engine.runtime.ClientRuntime`.
* :func:`initial_server`: the server state every algorithm starts from.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fedskew.algorithms.base import Algorithm, Context, HyperParams, State
from fedskew.data.federated import FederatedData
from fedskew.engine.runtime import INIT_KEY, ClientData, Inputs, ModelCache
from fedskew.seeding import derive_seed
from fedskew.settings import ClientSection


@dataclass(frozen=True)
class ClientMeta:
    """The federation as an algorithm's context sees it: counts, shapes and the data pipeline's assets."""

    num_clients: int
    num_classes: int
    in_shape: tuple[int, ...]
    class_counts: Tensor  # [N, C] training samples per client and class (CPU)
    assets: Mapping[str, Any] = field(default_factory=dict)
    #: [N] training samples per client where they are not ``class_counts``' row sums (a node's view that
    #: discloses every client's size but not its histogram: :mod:`fedskew.engine.need_to_know`)
    sizes: Tensor | None = None

    @property
    def client_sizes(self) -> Tensor:
        """[N] training samples per client (the explicit ``sizes``, else the histograms' row sums)."""
        return self.class_counts.sum(1) if self.sizes is None else self.sizes

    @classmethod
    def of(cls, data: FederatedData) -> ClientMeta:
        ds = data.dataset
        return cls(
            num_clients=data.num_clients,
            num_classes=ds.num_classes,
            in_shape=ds.in_shape,
            class_counts=data.class_counts(),
            assets=ds.meta.get("assets", {}),
        )


@dataclass(frozen=True)
class ModelSpec:
    """How a run builds its models: the factory, the architecture key, the device, the memory layout and
    the seed of the initial model (see :class:`~fedskew.engine.runtime.ModelCache`)."""

    factory: Callable[[int | None], nn.Module]
    arch_key: Callable[[int | None], Hashable]
    device: torch.device
    memory_format: str
    seed: int


def construct_algorithm(
    algorithm_cls: type[Algorithm],
    params: HyperParams,
    meta: ClientMeta,
    spec: ModelSpec,
    client: ClientSection,
    rounds: int,
    seed: int,
) -> tuple[Algorithm, ModelCache]:
    """The algorithm, constructed from a context derived from the config alone (identical in every process
    of a run), and the model cache whose ``prepare`` is the algorithm's ``prepare_model``.

    The two need each other: the context builds models through the cache, and the cache prepares models
    with the algorithm. The cache is given, at construction, a ``prepare`` that applies the algorithm's
    once it exists. Models the algorithm builds inside its own constructor (FedPer's and FedNH's reading of
    the global architecture) are therefore unprepared: an algorithm cannot prepare a model before it is
    constructed. Every model built afterwards, through the context or the cache, is prepared.
    """
    algorithm: Algorithm | None = None

    def prepare(model: nn.Module) -> nn.Module:
        return model if algorithm is None else algorithm.prepare_model(model)

    models = ModelCache(spec.factory, spec.arch_key, spec.device, spec.memory_format, spec.seed, prepare)
    ctx = Context(
        num_clients=meta.num_clients,
        num_classes=meta.num_classes,
        in_shape=meta.in_shape,
        device=spec.device,
        client=client,
        client_sizes=meta.client_sizes,
        class_counts=meta.class_counts,
        rounds=rounds,
        seed=seed,
        build_model=models.build,
        initial_model=models.initial,
        arch_key=models.arch_key,
        assets=meta.assets,
    )
    algorithm = algorithm_cls(params, ctx)
    return algorithm, models


def client_data(data: FederatedData, device: torch.device, owned: list[int] | None = None) -> ClientData:
    """The clients' training samples on ``device`` as stored (normalised when read: see
    :class:`~fedskew.engine.runtime.Inputs`) and their index views. ``owned``: keep only these clients'
    samples (a Flower node); the other clients become empty views."""
    ds = data.dataset
    counts = data.class_counts()
    if owned is None:
        index = [t.to(device) for t in data.train_idx]
        return ClientData(
            Inputs(ds.x_train.to(device), ds.normaliser()), ds.y_train.to(device), index, counts
        )
    if sorted(owned) != list(owned):  # the kept samples are the owned clients' views, concatenated
        raise ValueError("owned clients must be listed in ascending order")
    keep = set(owned)
    picked = torch.cat([data.train_idx[c] for c in owned]) if owned else torch.zeros(0, dtype=torch.long)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    index, start = [], 0
    for c in range(data.num_clients):
        n = data.train_idx[c].numel() if c in keep else 0
        index.append(torch.arange(start, start + n, device=device) if c in keep else empty)
        start += n
    x, y = ds.x_train[picked].to(device), ds.y_train[picked].to(device)
    return ClientData(Inputs(x, ds.normaliser()), y, index, counts)


def initial_server(algorithm: Algorithm, models: ModelCache, seed: int) -> State:
    """The server state from the run's initial global model: the same model for every algorithm (the
    global generator is seeded from the run's seed first)."""
    torch.manual_seed(derive_seed(seed, INIT_KEY))
    return algorithm.init_server(models.model_for(None))
