"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency 2020, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523), Algorithm 1.

The mirror of FedPer: each client keeps its **local representation** (the lower layers, ℓ_m) and trains it
together with the **global model** on top (the upper layers, g); only the global layers travel and the server
averages them, ``θ_g ← Σ_k (n_k/n) θ_g,k`` (Algorithm 1's server update). A client is trained and evaluated
with its own representation and the received global layers; there is no global model (the representation
never leaves the client), so evaluation is per client ("local test", the paper's headline metric).

Which layers are global (``global_part``, ``global_layers`` = k; "weight layers" are ``nn.Linear`` /
``nn.Conv*`` in registration order, the forward order of the zoo's models; a parameterised or buffered layer
between two weight layers, a normalisation, goes with the weight layer before it):

* ``top`` (default): the top k weight layers, the authors' reading (pliang279/LG-FedAvg ``main_lg.py`` keeps
  ``weight_keys[-num_layers_keep:]`` global; ``scripts/main_lg_mnist.sh`` and the README run their MNIST MLP,
  ``models/Nets.py`` ``MLP`` with 5 weight layers, at ``--num_layers_keep 3``). Unset k is the authors' share,
  3/5 of the model's weight layers rounded (at least 1, at most all but one): 2 of ``mlp_mpfedcl``'s 4, whose
  global part is then 17% of its parameters on MNIST, as the authors' 3 of 5 are 16% of their MLP's;
* ``first``: the first k weight layers, FL-bench's reading (KarhouTam/FL-bench ``src/client/lgfedavg.py``:
  the first ``num_global_layers`` of its Conv2d / BatchNorm2d / Linear modules are global, the rest
  personal; unset k is its default, 1). FL-bench counts a BatchNorm2d as a layer of its own; here it goes
  with the weight layer before it (the same sets on models without normalisation);
* ``head``: the model's head (``FedModel.is_head``, the classifier), PFLlib's reading
  (TsingZ0/PFLlib ``clientlg.py`` sets only ``model.head`` from the server); k must be unset.

The authors' CIFAR CNN lists its layers as (fc1, fc2, fc3, conv2, conv1), so its ``num_layers_keep 2`` makes
the two convolutions global, against the paper's figure; ``first`` with k = 2 is that set on such a CNN.

Local representations may differ in architecture between clients (``model.per_client``), as long as the
global layers have the same names and shapes (``heterogeneous_models``; checked at construction, one line
naming the first layer that differs: with clients of different widths, fewer global layers or ``head``).

Deviations (docs/methods/personalized.md, "LG-FedAvg: global layers, initialisation, averaging"): the
authors' code starts LG-FedAvg from a FedAvg-trained model (``--load_fed``) and averages uniformly over the
sampled clients; here it starts from the run's initial model and averages with sample weights (FedAvg's
n_k/n).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Literal, NamedTuple, cast

from pydantic import Field
from torch import Tensor, nn

from fedskew.algorithms.base import (
    ALGORITHMS,
    Context,
    HyperParams,
    LocalOutput,
    LocalResult,
    LocalStep,
    Payload,
    State,
    model_arrays,
)
from fedskew.algorithms.fedper import FedPer
from fedskew.algorithms.helpers import no_global_model
from fedskew.errors import ConfigError
from fedskew.search_space import tunable

WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: the authors' share of global weight layers: --num_layers_keep 3 of their MNIST MLP's 5
AUTHORS_SHARE = (3, 5)


class GlobalPart(NamedTuple):
    """One reading of "which layers are global"."""

    names: Callable[[nn.Module, int], set[str]]  # the global layers' state-dict names for k
    default_k: Callable[[nn.Module], int]  # the k an unset global_layers means
    takes_k: bool = True


def _layer_names(model: nn.Module) -> tuple[list[set[str]], list[int]]:
    """The state-dict names of each layer that holds parameters or buffers of its own (registration order),
    and the indices of the weight layers among them."""
    layers: list[set[str]] = []
    weights: list[int] = []
    for prefix, module in model.named_modules():
        own = {n for n in module.state_dict(keep_vars=True) if "." not in n}  # not a child's entry
        if own:
            if isinstance(module, WEIGHT_LAYERS):
                weights.append(len(layers))
            layers.append({f"{prefix}.{n}" if prefix else n for n in own})
    return layers, weights


def _weight_layers(model: nn.Module, k: int) -> tuple[list[set[str]], list[int]]:
    layers, weights = _layer_names(model)
    if k > len(weights):
        raise ConfigError(f"lgfedavg: global_layers={k} but the model has {len(weights)} weight layers")
    return layers, weights


def top_layer_names(model: nn.Module, k: int) -> set[str]:
    """State-dict names of ``model``'s top ``k`` weight layers and of the layers registered after the first
    of them (see the module docstring)."""
    layers, weights = _weight_layers(model, k)
    return set().union(*layers[weights[-k] :])


def first_layer_names(model: nn.Module, k: int) -> set[str]:
    """State-dict names of ``model``'s first ``k`` weight layers, of the layers registered before them and of
    those between the k-th and the next weight layer (see the module docstring)."""
    layers, weights = _weight_layers(model, k)
    return set().union(*layers[: weights[k] if k < len(weights) else len(layers)])


def head_names(model: nn.Module, k: int = 0) -> set[str]:
    """State-dict names of ``model``'s head (``FedModel.is_head``); none for a model without one."""
    is_head = getattr(model, "is_head", None)
    return {n for n in model.state_dict() if is_head is not None and is_head(n)}


def authors_share(model: nn.Module) -> int:
    """The authors' 3/5 of ``model``'s weight layers, rounded (3n/5 is never a half), within [1, n − 1]."""
    n = len(_layer_names(model)[1])
    num, den = AUTHORS_SHARE
    return max(1, min(n - 1, (num * n + den // 2) // den))


#: the readings of ``global_part`` (see the module docstring)
GLOBAL_PARTS: dict[str, GlobalPart] = {
    "top": GlobalPart(top_layer_names, authors_share),
    "first": GlobalPart(first_layer_names, lambda model: 1),  # FL-bench's default num_global_layers
    "head": GlobalPart(head_names, lambda model: 0, takes_k=False),
}


@ALGORITHMS.register("lgfedavg")
class LGFedAvg(FedPer):
    """LG-FedAvg (Liang et al. 2020): local representation per client, global top layers averaged."""

    personal_what: ClassVar[str] = "representation"
    heterogeneous_models: ClassVar[bool] = True  # only the global layers are averaged
    vectorizable = True  # plain cross-entropy (FedPer is not)

    class Params(HyperParams):
        global_part: Literal["top", "first", "head"] = Field(
            "top",
            description="which layers are global: 'top' the top k weight layers (authors' code, "
            "--num_layers_keep), 'first' the first k (FL-bench's num_global_layers), 'head' the classifier "
            "(PFLlib)",
        )
        global_layers: int | None = tunable(
            None,
            low=1,
            high=3,
            integer=True,
            step=1,
            ge=1,
            description="k of global_part top / first; unset: top 3/5 of the weight layers (the authors' 3 "
            "of 5 on MNIST; 2 of mlp_mpfedcl's 4), first 1 (FL-bench's default); must be unset with head",
        )

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        template = ctx.model_template(None)
        #: state-dict names of the global layers (those of the global architecture)
        self.shared = frozenset(n for n in template.state_dict() if n not in self.personal)
        self._check_architectures(template)

    def personal_layers(self, model: nn.Module) -> set[str]:
        """Everything that is not global: the local representation."""
        p = cast(LGFedAvg.Params, self.p)
        part = GLOBAL_PARTS[p.global_part]
        if not part.takes_k and p.global_layers is not None:
            takes = ", ".join(n for n, g in GLOBAL_PARTS.items() if g.takes_k)
            raise ConfigError(
                f"{self.name}: global_layers={p.global_layers} does not apply to "
                f"global_part={p.global_part}; allowed: global_part {takes}, or global_layers unset"
            )
        k = part.default_k(model) if p.global_layers is None else p.global_layers
        shared = part.names(model, k)
        names = set(model.state_dict())
        if not shared:
            raise ConfigError(f"{self.name}: no global layer in this model (global_part={p.global_part})")
        if shared >= names:
            raise ConfigError(
                f"{self.name}: global_part={p.global_part} with global_layers={k} leaves no local "
                "representation; allowed: fewer global layers"
            )
        return names - shared

    def _check_architectures(self, template: nn.Module) -> None:
        """Refuse (one line) a client architecture whose global layers differ in shape from the global
        model's: they could not be averaged (one model built per distinct architecture)."""
        reference = template.state_dict()
        seen = {self.ctx.arch_key(None)}
        for cid in range(self.ctx.num_clients):
            key = self.ctx.arch_key(cid)
            if key in seen:
                continue
            seen.add(key)
            own = self.ctx.model_template(cid).state_dict()
            for name in sorted(self.shared):
                if name not in own or own[name].shape != reference[name].shape:
                    got = tuple(own[name].shape) if name in own else "missing"
                    raise ConfigError(
                        f"{self.name}: global layer {name} is {got} in client {cid}'s model but "
                        f"{tuple(reference[name].shape)} in the global one; allowed: global layers of equal "
                        "shapes on every client (fewer global_layers, or global_part=head)"
                    )

    def is_personal(self, name: str) -> bool:
        return name not in self.shared  # a client's own layers need not exist in the global architecture

    def is_shared(self, name: str) -> bool:
        return name in self.shared

    # The client keeps its representation under "weights" (as ``local`` keeps its model), not FedPer's
    # "personal": a heterogeneous client's personal weights are its own architecture's.
    def init_client(self, cid: int) -> State:
        return {"weights": {k: v for k, v in self.ctx.initial_state(cid).items() if self.is_personal(k)}}

    def model_weights(self, payload: Payload, state: State | None) -> Mapping[str, Tensor]:
        if state is None:
            raise no_global_model(self.name)
        return {**payload.model_state(), **state["weights"]}

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        sd = step.model.state_dict()
        personal = {k: v.detach().clone() for k, v in sd.items() if self.is_personal(k)}
        return LocalOutput(
            Payload(arrays=model_arrays(sd, self.is_shared)), {**step.state, "weights": personal}
        )
