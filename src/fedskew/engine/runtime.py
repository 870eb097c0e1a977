"""The client side of a run, fixed for its whole length: data placement, model instances, the algorithm.

A :class:`ClientRuntime` is everything :func:`fedskew.engine.client.train_client` needs besides a round's
payload and a client's state. It is built only where clients train: by the embedded engine for its
executor (forked worker processes inherit it) and by a Flower ClientApp on its node, from the same config
(:mod:`fedskew.engine.assembly`). A server that only aggregates and evaluates never builds one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fedskew.algorithms.base import Algorithm, ClientView, State
from fedskew.engine.types import tree_to
from fedskew.seeding import derive_seed
from fedskew.settings import ClientSection

INIT_KEY = 0xC0FFEE  # seed key of the initial model


def _identity(model: nn.Module) -> nn.Module:
    return model


@dataclass(frozen=True)
class Inputs:
    """Training inputs as stored (uint8 images, float features), normalised when rows are read.

    Why not a normalised copy: float32 is four times the uint8 images, and the engine only ever reads a
    client's rows (1.25 GB of the 1.97 GB a 100,000-client MNIST-sized federation held after set-up,
    ``benchmarks/load.py``). The normalisation is element-wise, so rows read here equal the rows of a
    normalised copy bit for bit.
    """

    raw: Tensor
    normalise: Callable[[Tensor], Tensor]

    def __getitem__(self, idx: Any) -> Tensor:
        return self.normalise(self.raw[idx])

    def __len__(self) -> int:
        return int(self.raw.shape[0])

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    @property
    def device(self) -> torch.device:
        return self.raw.device


@dataclass
class ClientData:
    """Training samples on the training device and clients as index views into them."""

    x: Inputs
    y: Tensor
    index: list[Tensor]
    class_counts: Tensor  # [N, C] (CPU)

    def view(self, cid: int) -> ClientView:
        idx = self.index[cid]
        return ClientView(cid=cid, x=self.x[idx], y=self.y[idx], class_counts=self.class_counts[cid])

    def size(self, cid: int) -> int:
        return int(self.index[cid].numel())


class ModelCache:
    """Builds models on the device in the engine's memory layout and keeps one instance per architecture.

    ``prepare`` (the algorithm's :meth:`~fedskew.algorithms.base.Algorithm.prepare_model`, given at
    construction, see :func:`fedskew.engine.assembly.construct_algorithm`) is applied to every model built,
    so the global model, clients' models and algorithms' reference models agree.
    """

    def __init__(
        self,
        factory: Callable[[int | None], nn.Module],
        arch_key: Callable[[int | None], Hashable],
        device: torch.device,
        memory_format: str,
        seed: int,
        prepare: Callable[[nn.Module], nn.Module] = _identity,
    ) -> None:
        self.factory, self.arch_key, self.device = factory, arch_key, device
        self.memory_format = memory_format  # "contiguous" | "channels_last" (resolved: fedskew.engine.modes)
        self.seed, self.prepare = seed, prepare
        self._instances: dict[Hashable, nn.Module] = {}
        #: per architecture: the initial model before ``prepare`` and the CPU random state after building it
        self._initial: dict[Hashable, tuple[nn.Module, Tensor]] = {}

    def build(self, cid: int | None) -> nn.Module:
        """A new model for ``cid`` on the device, in the engine's memory format (values unchanged)."""
        return self.prepare(self._laid_out(cid))

    def _laid_out(self, cid: int | None) -> nn.Module:
        model = self.factory(cid).to(self.device)
        if self.memory_format == "channels_last" and any(isinstance(m, nn.Conv2d) for m in model.modules()):
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # stub lacks it
        return model

    def initial(self, cid: int | None) -> nn.Module:
        """A new model of ``cid``'s architecture with the run's initial weights: built from the seed of the
        global initial model, so a client whose architecture matches starts from exactly that model.

        The architecture's unprepared model and the random state after it are kept, and each call prepares a
        copy from that state: the same model as building it afresh, at a fraction of the cost
        (never-trained clients' initial states are rebuilt on every request, since the state store keeps
        none; building and initialising were most of a personalized evaluation of untrained clients)."""
        key = self.arch_key(cid)
        if key not in self._initial:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.seed, INIT_KEY))
                self._initial[key] = (self._laid_out(cid), torch.get_rng_state())
        raw, after = self._initial[key]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(after)  # what prepare_model draws, it draws as right after the build
            return self.prepare(copy.deepcopy(raw))

    def model_for(self, cid: int | None) -> nn.Module:
        """The reusable working instance of ``cid``'s architecture (built once; the engine loads weights)."""
        key = self.arch_key(cid)
        if key not in self._instances:
            self._instances[key] = self.build(cid)
        return self._instances[key]


@dataclass
class ClientRuntime:
    """The algorithm, the clients' data and models, the local-training settings, the run's seed and its
    number of rounds (what ``client.lr_schedule`` anneals over)."""

    algorithm: Algorithm
    data: ClientData
    models: ModelCache
    client: ClientSection
    seed: int
    rounds: int
    device: torch.device
    on_client_error: str = "drop_non_finite"  # engine.on_client_error (fedskew.engine.policy)
    precision: str = "fp32"  # engine.precision: the forward passes' autocast (fedskew.engine.device)

    def initial_state(self, cid: int) -> State:
        """The client's state before its first round, on CPU (from the algorithm's context alone)."""
        return tree_to(self.algorithm.init_client(cid), "cpu")
