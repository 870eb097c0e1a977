"""The algorithm contract (v4): what a federated method supplies, and what it may touch.

An algorithm is one small module. It declares typed hyper-parameters (defaults from its paper), what the
server sends (:meth:`Algorithm.broadcast`), the client's local loss on one batch
(:meth:`Algorithm.local_loss`), what the client uploads after training (:meth:`Algorithm.finish_local`)
and how the server aggregates: a weighted mean that the engine computes (:meth:`Algorithm.mean_weights`)
followed by :meth:`Algorithm.server_step`, or :meth:`Algorithm.aggregate` for a method that is not a mean.
A runtime (the embedded engine, Flower) owns the round loop, the optimizer and the model instances; an
algorithm never writes either.

The hooks, by side (docs/design.md has the table):

* server: ``init_server(model)``, ``broadcast(server, info)``, ``mean_weights(counts)`` and
  ``server_step(server, mean, info)`` (a mean method: the engine computes the mean, folded as uploads
  arrive, and robust rules / DP replace it) or ``aggregate(server, uploads, info)`` (any other method) →
  :class:`ServerUpdate` (new state + the round's diagnostics);
* client: ``init_client(cid)``, ``model_weights(payload, state)``, and four hooks over one
  :class:`LocalStep` value (model, payload, state, client data, round, per-round ``derived`` channel,
  ``scratch``): ``start_local(step)`` → :class:`LocalPlan`, ``init_scratch(step)``,
  ``local_loss(step, batch)``, ``finish_local(step, result)`` → :class:`LocalOutput`. The runtime loads
  ``model_weights`` (no data access) before ``start_local``, and the plan's optional ``start_weights``
  (weights that depend on the client's data: FedALA, FedFomo) after it, before ``init_scratch``: local
  training starts from those;
* evaluation: ``eval_weights(payload, state)``, ``adapt_for_eval(step)`` (personalization on the client's
  training data, personalized protocol), ``predict(model, x, payload, state)``;
* construction: ``prepare_model(model)``.

Rules every hook follows (checked for every registered algorithm by the contract tests):

* **Pure hooks.** A hook never mutates what it was handed (payload, server state, client state, scratch
  mapping, the model's weights in ``start_local``): it returns new values. A runtime commits a round only
  once every hook of it succeeded, so an interrupt or an error leaves the previous round's state intact.
* **No state on self.** Everything an algorithm derives from the federation is computed from the
  :class:`Context` it is constructed with; a hook never changes the algorithm object, except the caches it
  declares in :attr:`Algorithm.working_buffers` (values that are pure functions of the context); the
  embedded engine refuses a round whose hooks, run in its own process, added any other attribute.
* **Round information is given.** Hooks receive a :class:`RoundInfo`; algorithms never count rounds nor send
  the round number over the network. Diagnostics travel in :attr:`ServerUpdate.metrics` and an upload's
  ``metrics``, per-round client values in :attr:`LocalPlan.derived`: neither is persisted.
* **Messages.** See :mod:`fedskew.algorithms.messages`.

State (server and client) is a plain ``dict`` of tensors and small Python values (per-client server state:
a :class:`ServerTable`), so a runtime can keep
client state compactly on CPU, spill it to disk, checkpoint it with ``torch.save(..., weights_only=True)``-
loadable types and ship it over Flower. See docs/design.md for the round transaction and the executors.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from fedskew.algorithms.messages import (
    MODEL_PREFIX,
    Payload,
    Upload,
    clone_state,
    model_arrays,
    server_arrays,
)
from fedskew.algorithms.server_table import ServerTable
from fedskew.algorithms.steps import (
    Batch,
    ClientView,
    ContractError,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Phase,
    RoundInfo,
    Scratch,
    ServerUpdate,
    State,
)
from fedskew.errors import ConfigError
from fedskew.registry import Registry
from fedskew.settings import ClientSection

__all__ = [
    "ALGORITHMS",
    "MODEL_PREFIX",
    "Algorithm",
    "Batch",
    "ClientView",
    "Context",
    "ContractError",
    "HyperParams",
    "LocalOutput",
    "LocalPlan",
    "LocalResult",
    "LocalStep",
    "MeanInfo",
    "Payload",
    "Phase",
    "RoundInfo",
    "Scratch",
    "ServerTable",
    "ServerUpdate",
    "State",
    "Upload",
    "clone_state",
    "embedding_dim",
    "fedavg_mean",
    "flat_params",
    "load_state",
    "model_arrays",
    "param_names",
    "receipt",
    "sample_weights",
    "server_arrays",
    "uniform_weights",
    "weighted_average",
]


class AlgorithmRegistry(Registry):
    """The algorithm registry: registering a class under a name also sets its ``name``."""

    def register(self, name: str) -> Callable[[Any], Any]:
        add = super().register(name)

        def deco(cls: Any) -> Any:
            own = vars(cls).get("name")  # a class registered already (not a subclass inheriting its name)
            if own and own != name and own in self.names() and self.get(own) is cls:
                label = getattr(cls, "__qualname__", repr(cls))
                raise ConfigError(
                    f"algorithm class {label} is registered as '{own}' already; subclass it to register it "
                    f"as '{name}'"
                )
            add(cls)  # refuses a taken name before the class is touched
            cls.name = name
            return cls

        return deco


#: name -> Algorithm subclass
ALGORITHMS: Registry = AlgorithmRegistry("algorithm")


class HyperParams(BaseModel):
    """Base class of an algorithm's hyper-parameters: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class Context:
    """What an algorithm knows about the federation when it is constructed: the same on every process of a
    run (the server included, which holds no training data), derived from the config alone."""

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
class MeanInfo:
    """What :meth:`Algorithm.server_step` sees of a round besides the mean: the round, the accepted uploads
    without their arrays (client id, sample count, ``config`` scalars, ``metrics``) and the mean's weights."""

    round: RoundInfo
    uploads: list[Upload]
    weights: Tensor

    @property
    def count(self) -> int:
        """Accepted uploads."""
        return len(self.uploads)


def receipt(upload: Upload) -> Upload:
    """``upload`` without its arrays (sample count, config and metrics kept)."""
    p = upload.payload
    return Upload(upload.cid, upload.num_samples, Payload(config=p.config, metrics=p.metrics))


class Algorithm:
    """Base class: defaults give FedAvg behaviour, so a method overrides only what it changes.

    ``name`` is set by the registry (``@ALGORITHMS.register("name")``). Every capability a runtime or a
    config check reads is declared here (a subclass overrides the class attribute).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type[HyperParams]] = HyperParams
    # Flags: the defaults are FedAvg's, so a FedAvg-like method declares none. Each one has a runtime reader
    # and is checked when the run is built (docs/design.md, "class attributes").
    #: the model used to evaluate a client depends on the client (personal models, local heads, ...): the
    #: evaluators score each client with its own state
    personalized_eval: ClassVar[bool] = False
    #: there is no global model (``local``): the config must ask for ``eval.protocol=personalized``
    requires_personalized_eval: ClassVar[bool] = False
    #: clients may have different architectures (``model.per_client`` changing parameter shapes); without it
    #: a config whose clients' models differ in shape is refused when the run is built
    heterogeneous_models: ClassVar[bool] = False
    #: ``aggregate`` is this class's: a (weighted, :meth:`mean_weights`) mean of the uploads' arrays, then
    #: :meth:`server_step` on it. The engine may compute the mean itself (folded as uploads arrive), and
    #: robust rules, model-poisoning attacks and central DP replace it (``fedskew.algorithms.security``).
    #: ``False``: the method overrides ``aggregate`` with something that is not a mean (prototypes, class
    #: statistics)
    mean_aggregation: ClassVar[bool] = True
    #: the method runs on frozen-backbone features and needs ``data.vision_language`` in the config
    vision_language: ClassVar[bool] = False
    #: ``local_loss`` is a pure function of (model, batch, payload, state, scratch) with no data-dependent
    #: Python branching, so ``engine.mode=vectorized`` may train the round's clients at once under vmap
    vectorizable: ClassVar[bool] = True
    #: what ``local_loss`` reads of the step besides the model, ``scratch`` and ``info.round``: the vectorized
    #: engine stacks only these over clients, so payloads (or states) that differ in shape between clients do
    #: not stop it when the loss does not read them (FedProto: dense tensors from :meth:`init_scratch`
    #: instead). Under vmap the loss never sees ``step.client`` nor ``step.info.cid``.
    loss_reads: ClassVar[frozenset[str]] = frozenset()
    #: attributes a hook may fill on ``self``: caches that are pure functions of the context (MOON's frozen
    #: reference networks per architecture), each an attribute ``__init__`` creates. Any other attribute a
    #: hook changes breaks the contract.
    working_buffers: ClassVar[frozenset[str]] = frozenset()
    #: ``aggregate`` reads per-client scalars the uploads report in ``config`` (FedNova's ‖a_i‖₁): unbounded
    #: statistics of a client's data, which client-level DP cannot cover (refused under ``privacy``)
    reads_client_scalars: ClassVar[bool] = False
    #: a client's upload carries its sample count and training loss; ``False`` (DP runs: the mechanism needs
    #: neither, and under local DP the server is not trusted): every upload counts 1 and reports no loss
    discloses_client_statistics: ClassVar[bool] = True
    #: a client's update stays meaningful when it trains fewer steps than planned (FedProx's γ-inexact
    #: solutions, FedNova's heterogeneous τ_i): the virtual clock's ``late: partial`` is allowed
    partial_work: ClassVar[bool] = False
    #: what the CLIENT-side hooks read of the context's counts (a Flower node gets only this): ``own`` its
    #: node's clients' rows, ``sizes`` also every client's size (FedEnt), ``classes`` every histogram (FedGen)
    federation_counts: ClassVar[str] = "own"

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

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """The new server state from the accepted uploads. As written here (``mean_aggregation``): the mean
        of the uploads' arrays weighted by :meth:`mean_weights`, then :meth:`server_step` (FedAvg, McMahan
        et al. 2017, Alg. 1). A method whose aggregation is not such a mean overrides it and declares
        ``mean_aggregation = False``; one that is never overrides it (the engine may skip it)."""
        weights = self.mean_weights([u.num_samples for u in uploads])
        mean = Payload(arrays=weighted_average([u.payload.arrays for u in uploads], weights))
        return self.server_step(server, mean, MeanInfo(info, [receipt(u) for u in uploads], weights))

    def mean_weights(self, counts: Sequence[int]) -> Tensor:
        """The weights of the mean from the accepted uploads' sample counts, in order: FedAvg's ``n_k / n``
        (:func:`count_weights`). A pure function of the counts, which the engine knows before any client
        trains, so it can fold the mean as uploads arrive (uniform: ``torch.full((k,), 1.0 / k)``)."""
        return count_weights(counts)

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        """The new server state from ``mean`` (the weighted mean of the uploads' arrays, by their names, or
        what a robust rule or DP put in its place) and ``info`` (the round, the accepted uploads without
        their arrays, the weights). FedAvg: the mean is the new model."""
        return ServerUpdate({**server, "weights": mean.model_state()})

    def released(self, record: dict[str, Any]) -> dict[str, Any]:
        """What of a round's metrics record the run writes (metrics files, trackers, Flower's records):
        all of it, except under DP (``fedskew.algorithms.security``)."""
        return record

    def run_summary(self) -> dict[str, Any]:
        """Entries the method adds to ``summary.json`` (DP: the guarantee and its accounting)."""
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

    def start_local(self, step: LocalStep) -> LocalPlan:
        """Plan local training (``step.model`` already holds :meth:`model_weights`; read it, do not change
        it); what the plan's ``derived`` holds reaches the later hooks as ``step.derived``. Where the weights
        training starts from depend on the client's data, return them as the plan's ``start_weights`` (a
        subset of the model state's keys): the runtime loads them into ``step.model`` after this hook and
        before :meth:`init_scratch`, in every engine mode."""
        return LocalPlan([Phase(epochs=self.ctx.client.epochs, lr=self.ctx.client.lr)])

    def init_scratch(self, step: LocalStep) -> dict[str, Tensor]:
        """Tensors that ``local_loss`` finds in ``step.scratch`` from the first batch on: per-round constants
        derived from the payload and accumulators updated in place. The same names and shapes for every
        client of an architecture, so the vectorized engine can stack them."""
        return {}

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        """Loss on one batch; the engine back-propagates it and steps the optimizer."""
        return F.cross_entropy(step.model(batch.x), batch.y)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        """After training: the upload and the client's new state."""
        return LocalOutput(Payload(arrays=model_arrays(step.model.state_dict())), step.state)

    # ---------------------------------------------------------------- evaluation
    def eval_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        """The weights a client (or the server, ``state=None``) is evaluated with (by default
        :meth:`model_weights`, which then sees ``state=None``)."""
        return self.model_weights(payload, state)  # type: ignore[arg-type]

    def adapt_for_eval(self, step: LocalStep) -> Mapping[str, Tensor] | None:
        """Personalization at evaluation time: the weights client ``step.cid`` is scored with, adapted on its
        own training data ``step.client`` from the model being evaluated (``step.model`` holds
        :meth:`eval_weights`: read it, do not change it). A subset of the model state's keys, loaded over
        it; ``None`` (the default): score :meth:`eval_weights` as is. Every runtime's personalized evaluation
        runs it (``eval.protocol=personalized`` of a ``personalized_eval`` method; the global protocol scores
        the global model unadapted), once per client and evaluation, on the node that holds the client's
        data, with gradients enabled, ``step.info`` the evaluated round and the client (randomness from
        ``step.info.generator``; the global RNG is seeded from the same triple), ``step.state`` the client's
        committed state, ``step.derived`` and ``step.scratch`` empty. Nothing it returns is kept: evaluation
        commits nothing (FedAvg-FT and FedBABU fine-tune here, Per-FedAvg takes its α-step)."""
        return None

    def predict(
        self, model: nn.Module, x: Tensor, payload: Payload, state: State | None
    ) -> dict[str, Tensor]:
        """Named heads of class scores; the first is the primary metric. ``"logits"`` feeds the loss."""
        return {"logits": model(x)}


# -------------------------------------------------------------------- shared helpers
def sample_weights(uploads: list[Upload]) -> Tensor:
    """Aggregation weights proportional to local sample counts (FedAvg's n_k / n); equal weights when every
    upload comes from a client without data (``min_size: 0`` partitions), whose upload is the model it got."""
    return count_weights([u.num_samples for u in uploads])


def fedavg_mean(uploads: list[Upload]) -> dict[str, Tensor]:
    """FedAvg's sample-weighted mean of the uploads' model states: the FedAvg part of a method whose
    aggregation is not a mean of its whole uploads (FedEnt, FedRCL, MPFedCL: prototypes, scalars)."""
    return weighted_average([u.payload.model_state() for u in uploads], sample_weights(uploads))


def count_weights(counts: Sequence[int]) -> Tensor:
    """:func:`sample_weights` of uploads with these sample counts (float64): ``n_k / n``, or ``1 / K`` when
    every count is 0. The engine plans a round's FedAvg weights with it before the uploads exist
    (:mod:`fedskew.engine.folding`)."""
    n = torch.tensor([float(c) for c in counts], dtype=torch.float64)
    total = n.sum()
    return n / total if total > 0 else torch.full_like(n, 1.0 / len(n))


def uniform_weights(items: Sized) -> Tensor:
    """Equal aggregation weights ``1/|S|`` over uploads (or their sample counts:
    :meth:`Algorithm.mean_weights`), the plain mean over the sampled set: SCAFFOLD, FedDyn, pFedMe,
    Per-FedAvg."""
    n = len(items)
    return torch.full((n,), 1.0 / n)


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Tensor) -> dict[str, Tensor]:
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
            avg = cast(Tensor, sum(float(wk) * s[key].double() for s, wk in zip(states, w, strict=True)))
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
