"""The algorithm contract (v2): what a federated method supplies, and what it may touch.

An algorithm is one small module. It declares typed hyper-parameters (defaults from its paper), what the
server sends (:meth:`Algorithm.broadcast`), the client's local loss on one batch
(:meth:`Algorithm.local_loss`), what the client uploads after training (:meth:`Algorithm.finish_local`)
and how the server aggregates (:meth:`Algorithm.aggregate`). A runtime (the embedded engine, Flower) owns
the round loop, the optimizer and the model instances; an algorithm never writes either.

Rules every hook follows (checked for every registered algorithm by the contract tests):

* **Pure hooks.** A hook never mutates what it was handed (payload, server state, client state, scratch
  mapping, the model's structure): it returns new values. ``aggregate`` returns the new server state,
  ``start_local`` and ``finish_local`` return the client's new state. A runtime commits a round only once
  every hook of it succeeded, so an interrupt or an error leaves the previous round's state intact.
* **Setup from the context.** Everything an algorithm derives from the federation (parameter names,
  splits, class counts) is computed from the :class:`Context` it is constructed with, never stored on
  ``self`` by a hook, so a client process and a server process built from the same config agree.
* **Round information is given.** Hooks receive a :class:`RoundInfo` (round number, client id, seeds);
  algorithms never count rounds nor send the round number over the network.
* **Messages.** A :class:`Payload` has ``arrays`` (tensors on the wire: counted in ``bytes_up/down`` and
  ``params_up/down``), ``config`` (small values the receiver needs: counted, 8 bytes each) and ``metrics``
  (diagnostics: logged, never counted); they map one-to-one onto Flower's ``ArrayRecord``,
  ``ConfigRecord`` and ``MetricRecord``.

State (server and client) is a plain ``dict`` of tensors and small Python values, so a runtime can keep
client state compactly on CPU, checkpoint it with ``torch.save(..., weights_only=True)``-loadable types and
ship it over Flower. See docs/design.md for the round transaction and the executors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from fedskew.errors import ConfigError
from fedskew.registry import Registry
from fedskew.seeding import derive_seed
from fedskew.settings import ClientSection

#: payload arrays whose names start with this prefix are model state (parameters and buffers)
MODEL_PREFIX = "model."

State = dict[str, Any]


class AlgorithmRegistry(Registry):
    """The algorithm registry: registering a class under a name also sets its ``name``."""

    def register(self, name: str) -> Callable[[Any], Any]:
        add = super().register(name)

        def deco(cls: Any) -> Any:
            cls.name = name
            return add(cls)

        return deco


#: name -> Algorithm subclass
ALGORITHMS: Registry = AlgorithmRegistry("algorithm")


class ContractError(RuntimeError):
    """An algorithm broke the contract (e.g. wrote into its scratch mapping outside ``init_scratch``)."""


class HyperParams(BaseModel):
    """Base class of an algorithm's hyper-parameters: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Payload:
    """One message: ``arrays`` (named tensors), ``config`` (small values the receiver needs) and ``metrics``
    (diagnostics). Maps onto Flower's ArrayRecord, ConfigRecord and MetricRecord."""

    arrays: dict[str, Tensor] = field(default_factory=dict)
    config: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes on the wire: tensor storage plus 8 bytes per config value (metrics are not counted)."""
        return sum(t.numel() * t.element_size() for t in self.arrays.values()) + 8 * len(self.config)

    def num_params(self) -> int:
        """Communicated floating-point tensor values: the papers' "# communicated parameters" (class ids and
        sample counts sent as integer tensors are metadata and not counted)."""
        return sum(t.numel() for t in self.arrays.values() if t.is_floating_point())

    def model_state(self) -> dict[str, Tensor]:
        """The model entries, with :data:`MODEL_PREFIX` stripped."""
        n = len(MODEL_PREFIX)
        return {k[n:]: v for k, v in self.arrays.items() if k.startswith(MODEL_PREFIX)}

    def is_finite(self) -> bool:
        """No NaN / Inf in arrays or config. A finite sum implies finite elements (NaN and Inf propagate), so
        one reduction per tensor decides the common case; only a non-finite sum (possibly a float overflow of
        finite values) is checked element by element."""
        floats = [t for t in self.arrays.values() if t.is_floating_point()]
        ok = all(math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all()) for t in floats)
        return ok and all(math.isfinite(v) for v in self.config.values())


def model_arrays(state: Mapping[str, Tensor], keys: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """Prefix (cloned) model state entries for a payload, optionally keeping only the keys ``keys`` accepts.

    Cloned: the runtime reuses one model instance across clients, so an upload must not alias it.
    """
    return {MODEL_PREFIX + k: v.detach().clone() for k, v in state.items() if keys is None or keys(k)}


def server_arrays(weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Prefix the server's model weights for a broadcast payload, without copying them.

    A server state is never changed in place (hooks return new values) and no hook changes its payload,
    so every client's payload may share the server's tensors: one copy of the model per client less.
    """
    return {MODEL_PREFIX + k: v for k, v in weights.items()}


def clone_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Detached copies of a model's state entries (personal weights kept in client state)."""
    return {k: v.detach().clone() for k, v in state.items()}


@dataclass
class Context:
    """What an algorithm knows about the federation when it is constructed: the same on every process of a
    run, derived from the config alone."""

    num_clients: int
    num_classes: int
    in_shape: tuple[int, ...]
    device: torch.device
    client: ClientSection
    client_sizes: Tensor  # [N] training samples per client
    class_counts: Tensor  # [N, C] training samples per client and class
    rounds: int
    seed: int
    build_model: Callable[[int | None], nn.Module]  # build_model(cid) -> fresh model (None: the global one)
    #: initial_model(cid) -> the run's deterministic initial model in client cid's architecture (the global
    #: initial model itself when the architectures match). None: fall back to ``build_model``.
    initial_model: Callable[[int | None], nn.Module] | None = None
    #: arch_key(cid) -> a key equal for clients whose models have the same architecture
    arch_key: Callable[[int | None], Hashable] = lambda cid: None
    #: what the data pipeline derived for the method, the same on every process (vision-language methods:
    #: the synthetic cache ``cache_x``/``cache_y``, the class embeddings ``text`` and, with a text tower,
    #: ``prompt_encoder(n_ctx)`` building the frozen prompt-learning text encoder)
    assets: Mapping[str, Any] = field(default_factory=dict)

    def model_template(self, cid: int | None) -> nn.Module:
        """A new model of ``cid``'s architecture with the run's initial weights (names, shapes)."""
        return (self.initial_model or self.build_model)(cid)

    def initial_state(self, cid: int | None) -> dict[str, Tensor]:
        """A fresh copy of the initial weights of ``cid``'s model (personal models start here)."""
        return clone_state(self.model_template(cid).state_dict())

    def zero_params(self, cid: int | None) -> dict[str, Tensor]:
        """Zeros shaped like the trainable parameters of ``cid``'s model (control variates, gradient
        memories)."""
        return {n: torch.zeros_like(p.detach()) for n, p in self.model_template(cid).named_parameters()}


@dataclass(frozen=True)
class RoundInfo:
    """Where a hook runs: the round (1-based), the client (``None``: the server or global evaluation) and
    the run's seed, from which per-(round, client) randomness is derived independently of execution order."""

    round: int
    cid: int | None
    seed: int

    def generator(self, key: int) -> torch.Generator:
        """A CPU generator seeded from ``(seed, round, cid, key)``; ``key`` separates a method's streams."""
        cid = -1 if self.cid is None else self.cid
        return torch.Generator().manual_seed(derive_seed(self.seed, self.round, cid, key))


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
class LocalPlan:
    """What :meth:`Algorithm.start_local` decides: the training phases, and the client state that
    ``local_loss`` and ``finish_local`` see (a new dict when the hook derived something, e.g. FedEnt's η)."""

    phases: list[Phase]
    state: State


@dataclass
class LocalResult:
    """What the engine reports back after the optimizer loop."""

    steps: int
    loss: float  # mean training loss of the last epoch
    lr: float  # learning rate of the last phase


@dataclass
class LocalOutput:
    """What :meth:`Algorithm.finish_local` returns: the upload and the client's new state."""

    upload: Payload
    state: State


@dataclass
class Upload:
    cid: int
    num_samples: int
    payload: Payload


class Scratch(Mapping[str, Tensor]):
    """The read-only mapping ``local_loss`` gets: exactly the tensors :meth:`Algorithm.init_scratch` made.

    Its keys cannot change after ``init_scratch`` (a write raises :class:`ContractError` in every engine
    mode, since the vectorized engine stacks these tensors over clients before the first batch); the
    tensors themselves may be accumulated into in place (FedProto's last-epoch prototype sums)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Tensor] | None = None) -> None:
        object.__setattr__(self, "_items", dict(items or {}))

    def __getitem__(self, key: str) -> Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __setitem__(self, key: str, value: Any) -> None:
        raise ContractError(
            f"scratch is read-only outside init_scratch (wrote '{key}'): create every tensor the loss "
            "needs in init_scratch and update it in place"
        )

    def __setattr__(self, key: str, value: Any) -> None:
        raise ContractError("scratch is read-only outside init_scratch")


class Algorithm:
    """Base class: defaults give FedAvg behaviour, so a method overrides only what it changes.

    ``name`` is set by the registry (``@ALGORITHMS.register("name")``).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[HyperParams]] = HyperParams
    #: the model used to evaluate a client depends on the client (personal models, local heads, ...)
    personalized_eval: ClassVar[bool] = False
    #: there is no global model (``local``): the config must ask for ``eval.protocol=personalized``
    requires_personalized_eval: ClassVar[bool] = False
    #: clients may have different architectures (``model.per_client`` changing parameter shapes): nothing
    #: is averaged across clients' models
    heterogeneous_models: ClassVar[bool] = False
    #: ``local_loss`` is a pure function of (model, batch, payload, state, scratch) with no data-dependent
    #: Python branching, so ``engine.mode=vectorized`` may train the round's clients at once under vmap
    vectorizable: ClassVar[bool] = False
    #: what ``local_loss`` reads besides the model, the batch and ``scratch``: the vectorized engine stacks
    #: only these over clients, so payloads (or states) that differ in shape between clients do not stop it
    #: when the loss does not read them (FedProto: dense tensors from :meth:`init_scratch` instead)
    loss_reads: ClassVar[frozenset[str]] = frozenset({"payload", "state"})

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        self.p = params
        self.ctx = ctx

    # ---------------------------------------------------------------- construction
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model the runtime trains, from a model it has just built (called once per instance, before
        any hook sees it): a method that trains parameters outside the architecture adds them here."""
        return model

    # ---------------------------------------------------------------- server side
    def init_server(self, model: nn.Module) -> State:
        """Server state from the initial global model (same init for every algorithm and seed)."""
        return {"weights": clone_state(model.state_dict())}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        """Payload sent to client ``info.cid`` (``None``: for global evaluation)."""
        return Payload(arrays=server_arrays(server["weights"]))

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> State:
        """FedAvg (McMahan et al. 2017): the new server state, the sample-weighted mean of the uploads."""
        weights = weighted_average([u.payload.model_state() for u in uploads], sample_weights(uploads))
        return {**server, "weights": weights}

    def round_metrics(self, server: State) -> dict[str, float]:
        """Method-specific diagnostics appended to ``metrics.jsonl`` each evaluated round."""
        return {}

    # ---------------------------------------------------------------- client side
    def init_client(self, cid: int) -> State:
        """A client's state before its first round (from the context only: a client process has no server
        state). Kept by the runtime across rounds, on the node that owns the client."""
        return {}

    def model_weights(self, payload: Payload, state: State) -> Mapping[str, Tensor]:
        """The weights a client trains from, loaded by the runtime into its model (a subset of keys keeps the
        model's other entries)."""
        return payload.model_state()

    def start_local(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView, info: RoundInfo
    ) -> LocalPlan:
        """Plan local training (``model`` already holds :meth:`model_weights`; read it, do not change it)."""
        return LocalPlan([Phase(epochs=self.ctx.client.epochs, lr=self.ctx.client.lr)], state)

    def init_scratch(
        self, model: nn.Module, payload: Payload, state: State, client: ClientView, info: RoundInfo
    ) -> dict[str, Tensor]:
        """Tensors that ``local_loss`` finds in ``scratch`` from the first batch on (after ``start_local``):
        per-round constants derived from the payload and accumulators updated in place. The same names and
        shapes for every client of an architecture, so the vectorized engine can stack them."""
        return {}

    def local_loss(
        self, model: nn.Module, batch: Batch, payload: Payload, state: State, scratch: Scratch
    ) -> Tensor:
        """Loss on one batch; the engine back-propagates it and steps the optimizer."""
        return F.cross_entropy(model(batch.x), batch.y)

    def finish_local(
        self,
        model: nn.Module,
        payload: Payload,
        state: State,
        client: ClientView,
        scratch: Scratch,
        result: LocalResult,
        info: RoundInfo,
    ) -> LocalOutput:
        """After training: the upload and the client's new state."""
        return LocalOutput(Payload(arrays=model_arrays(model.state_dict())), state)

    # ---------------------------------------------------------------- evaluation
    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The weights a client (or the server, ``state=None``) is evaluated with."""
        return self.model_weights(payload, state)  # type: ignore[arg-type]

    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """Named heads of class scores; the first is the primary metric. ``"logits"`` feeds the loss."""
        return {"logits": model(x)}


# -------------------------------------------------------------------- shared helpers
def sample_weights(uploads: list[Upload]) -> Tensor:
    """Aggregation weights proportional to local sample counts (FedAvg's n_k / n); equal weights when every
    upload comes from a client without data (``min_size: 0`` partitions), whose upload is the model it got."""
    n = torch.tensor([float(u.num_samples) for u in uploads], dtype=torch.float64)
    total = n.sum()
    return n / total if total > 0 else torch.full_like(n, 1.0 / len(n))


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
