"""The algorithm contract.

An algorithm is one small module. It declares typed hyper-parameters (defaults from its paper), what the
server sends (:meth:`Algorithm.broadcast`), the client's local loss on one batch
(:meth:`Algorithm.local_loss`), what the client uploads after training (:meth:`Algorithm.finish_local`)
and how the server aggregates (:meth:`Algorithm.aggregate`). The engine owns the round loop and the
optimizer; an algorithm never writes either.

Server state and client state are plain ``dict``s of tensors (and small Python values), so the engine can
keep client state compactly on CPU, checkpoint both with ``torch.save`` and ship them over Flower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.registry import Registry

#: name -> Algorithm subclass
ALGORITHMS: Registry = Registry("algorithm")

#: payload tensors whose names start with this prefix are model state (parameters and buffers)
MODEL_PREFIX = "model."

State = dict[str, Any]


class HyperParams(BaseModel):
    """Base class of an algorithm's hyper-parameters: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Payload:
    """What crosses the network: named tensors plus scalars (maps onto Flower's ArrayRecord +
    ConfigRecord/MetricRecord)."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes on the wire: tensor storage plus 8 bytes per scalar."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + 8 * len(self.scalars)

    def num_floats(self) -> int:
        """Number of communicated values, integer metadata included."""
        return sum(t.numel() for t in self.tensors.values()) + len(self.scalars)

    def num_params(self) -> int:
        """Communicated floating-point tensor values: the papers' "# communicated parameters" (class ids and
        sample counts sent as integer tensors are metadata and not counted)."""
        return sum(t.numel() for t in self.tensors.values() if t.is_floating_point())

    def model_state(self) -> dict[str, Tensor]:
        """The model entries, with :data:`MODEL_PREFIX` stripped."""
        n = len(MODEL_PREFIX)
        return {k[n:]: v for k, v in self.tensors.items() if k.startswith(MODEL_PREFIX)}

    def is_finite(self) -> bool:
        """No NaN / Inf anywhere. A finite sum implies finite elements (NaN and Inf propagate), so one
        reduction per tensor decides the common case; only a non-finite sum (possibly a float overflow of
        finite values) is checked element by element."""
        floats = [t for t in self.tensors.values() if t.is_floating_point()]
        ok = all(math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all()) for t in floats)
        return ok and all(math.isfinite(v) for v in self.scalars.values())


def model_tensors(
    state: Mapping[str, Tensor], keys: Callable[[str], bool] | None = None
) -> dict[str, Tensor]:
    """Prefix (cloned) model state entries for a payload, optionally keeping only the keys ``keys`` accepts.

    Cloned: the engine reuses one model instance across clients, so an upload must not alias it.
    """
    return {MODEL_PREFIX + k: v.detach().clone() for k, v in state.items() if keys is None or keys(k)}


@dataclass
class ClientConfig:
    """Local-training settings (config section ``client``)."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    fraction: float = 1.0
    lr_decay: float = 1.0


@dataclass
class Context:
    """What an algorithm knows about the federation when it is constructed."""

    num_clients: int
    num_classes: int
    in_shape: tuple[int, ...]
    device: torch.device
    client: ClientConfig
    client_sizes: Tensor  # [N] training samples per client
    class_counts: Tensor  # [N, C] training samples per client and class
    rounds: int
    seed: int
    build_model: Callable[[int | None], nn.Module]  # build_model(cid) -> fresh model (None: the global one)
    #: initial_model(cid) -> the run's deterministic initial model in client cid's architecture (the global
    #: initial model itself when the architectures match). None: fall back to ``build_model``.
    initial_model: Callable[[int | None], nn.Module] | None = None

    def initial_state(self, cid: int | None) -> dict[str, Tensor]:
        """A fresh copy of the initial weights of ``cid``'s model (personal models start here)."""
        build = self.initial_model or self.build_model
        return {k: v.detach().clone() for k, v in build(cid).state_dict().items()}


@dataclass
class ClientView:
    """One client's local data as seen by hooks: full tensors on the training device."""

    cid: int
    x: Tensor
    y: Tensor
    class_counts: Tensor  # [C]

    @property
    def num_samples(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Batch:
    x: Tensor
    y: Tensor
    epoch: int = 0
    last_epoch: bool = True


@dataclass
class Phase:
    """A stretch of local training: ``epochs`` passes with learning rate ``lr`` over the parameters whose
    names ``trainable`` accepts (``None``: all)."""

    epochs: int
    lr: float
    trainable: Callable[[str], bool] | None = None
    momentum: float | None = None  # None: the client config's


@dataclass
class LocalResult:
    """What the engine reports back after the optimizer loop."""

    steps: int
    loss: float  # mean training loss of the last epoch
    lr: float  # learning rate of the last phase


@dataclass
class Upload:
    cid: int
    num_samples: int
    payload: Payload


class Algorithm:
    """Base class: defaults give FedAvg behaviour, so a method overrides only what it changes."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[HyperParams]] = HyperParams
    #: the model used to evaluate a client depends on the client (personal models, local heads, ...)
    personalized_eval: ClassVar[bool] = False
    #: there is no global model (``local``): the config must ask for ``eval.protocol=personalized``
    requires_personalized_eval: ClassVar[bool] = False
    #: ``local_loss`` is a pure function of (model, batch, payload, state, scratch): no per-client modules set
    #: up in ``start_local``, no data-dependent Python branching, and ``scratch`` holds only the tensors that
    #: :meth:`init_scratch` made (updated in place, e.g. accumulators), so ``engine.mode=vectorized`` may
    #: train the round's clients at once (fedskew.engine.vectorized)
    vectorizable: ClassVar[bool] = False
    #: what ``local_loss`` reads besides the model, the batch and ``scratch``: the vectorized engine stacks
    #: only these over clients, so payloads (or states) that differ in shape between clients do not stop it
    #: when the loss does not read them (FedProto: dense tensors from :meth:`init_scratch` instead)
    loss_reads: ClassVar[frozenset[str]] = frozenset({"payload", "state"})

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        self.p = params
        self.ctx = ctx

    # ---------------------------------------------------------------- server side
    def init_server(self, model: nn.Module) -> State:
        """Server state from the initial global model (same init for every algorithm and seed)."""
        return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}

    def broadcast(self, server: State, cid: int | None) -> Payload:
        """Payload sent to client ``cid`` (``None``: for global evaluation)."""
        return Payload(tensors=model_tensors(server["weights"]))

    def aggregate(self, server: State, uploads: list[Upload], round_idx: int) -> State:
        """FedAvg (McMahan et al. 2017): sample-weighted mean of the uploaded model states."""
        server["weights"] = weighted_average(
            [u.payload.model_state() for u in uploads], sample_weights(uploads)
        )
        return server

    # ---------------------------------------------------------------- client side
    def init_client(self, cid: int, server: State) -> State:
        """Per-client state kept by the engine across rounds (on CPU between rounds)."""
        return {}

    def load_model(self, model: nn.Module, payload: Payload, state: State | None) -> None:
        """Load the weights a client trains from / is evaluated with."""
        load_state(model, payload.model_state())

    def start_local(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView
    ) -> list[Phase]:
        """Prepare local training; return the phases the engine's optimizer loop runs."""
        self.load_model(model, payload, state)
        return [Phase(epochs=self.ctx.client.epochs, lr=self.ctx.client.lr)]

    def init_scratch(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView
    ) -> dict[str, Tensor]:
        """Tensors that ``local_loss`` finds in ``scratch`` from the first batch on (after ``start_local``):
        per-round constants derived from the payload and accumulators updated in place. The same names and
        shapes for every client of an architecture, so the vectorized engine can stack them."""
        return {}

    def local_loss(
        self, model: nn.Module, batch: Batch, payload: Payload, state: State, scratch: dict
    ) -> Tensor:
        """Loss on one batch; the engine back-propagates it and steps the optimizer."""
        return F.cross_entropy(model(batch.x), batch.y)

    def finish_local(
        self,
        model: nn.Module,
        payload: Payload,
        state: State,
        client: ClientView,
        scratch: dict,
        result: LocalResult,
    ) -> Payload:
        """After training: update ``state`` in place and return the upload."""
        return Payload(tensors=model_tensors(model.state_dict()))

    # ---------------------------------------------------------------- evaluation
    def load_eval(self, model: nn.Module, payload: Payload, state: State | None) -> None:
        """Load the model a client (or the server, ``state=None``) is evaluated with."""
        self.load_model(model, payload, state)

    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """Named heads of class scores; the first is the primary metric. ``"logits"`` feeds the loss."""
        return {"logits": model(x)}

    def round_metrics(self, server: State) -> dict[str, float]:
        """Method-specific diagnostics appended to ``metrics.jsonl`` each evaluated round."""
        return {}


# -------------------------------------------------------------------- shared helpers
def sample_weights(uploads: list[Upload]) -> Tensor:
    """Aggregation weights proportional to local sample counts (FedAvg's n_k / n)."""
    n = torch.tensor([float(u.num_samples) for u in uploads], dtype=torch.float64)
    return n / n.sum()


def weighted_average(states: list[Mapping[str, Tensor]], weights: Tensor) -> dict[str, Tensor]:
    """``sum_k w_k * state_k`` for every entry; integer buffers (BatchNorm counters) are rounded back.

    Floating entries accumulate in place in their own dtype (no stacked float64 copy of every model).
    """
    w = weights.tolist()
    out: dict[str, Tensor] = {}
    for key, ref in states[0].items():
        if ref.is_floating_point():
            acc = states[0][key].mul(w[0])
            for s, wk in zip(states[1:], w[1:], strict=True):
                acc.add_(s[key], alpha=wk)
            out[key] = acc
        else:
            avg = sum(float(wk) * s[key].double() for s, wk in zip(states, w, strict=True))
            out[key] = avg.round().to(ref.dtype)
    return out


def load_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy ``state`` into ``model`` in place (no new tensors; a subset of keys is allowed)."""
    if not state:
        return
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def flat_params(model: nn.Module) -> Tensor:
    """All trainable parameters as one vector (a view-free concatenation, keeps autograd)."""
    return torch.cat([p.reshape(-1) for p in model.parameters()])


def embedding_dim(model: nn.Module, algorithm: str) -> int:
    """The model's embedding size ``d`` (prototype methods), or a one-line error naming the algorithm."""
    dim = int(getattr(model, "embed_dim", 0))
    if dim <= 0:
        raise ConfigError(f"{algorithm} needs a model with features()/embed_dim (see `fedskew list`)")
    return dim


def param_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]
