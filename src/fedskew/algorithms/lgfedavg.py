"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency 2020, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523), Algorithm 1.

The mirror of FedPer: each client keeps its **local representation** (the lower layers, ℓ_m) and trains it
together with the **global model** on top (the upper layers, g); only the global layers travel and the server
averages them, ``θ_g ← Σ_k (n_k/n) θ_g,k`` (Algorithm 1's server update). A client is trained and evaluated
with its own representation and the received global layers; there is no global model (the representation
never leaves the client), so evaluation is per client ("local test", the paper's headline metric).

Which layers are global (``global_layers``):

* unset (default): the model's head (``FedModel.is_head``, the classifier), the reading of PFLlib and
  FL-bench;
* ``k``: the top k weight layers (``nn.Linear`` / ``nn.Conv*``, in registration order, which is the forward
  order of the zoo's models) and every parameterised layer registered after the first of them (a
  normalisation between them). The authors' code keeps the top ``num_layers_keep`` layers global (3 of their
  MNIST MLP's 5).

Local representations may differ in architecture between clients (``model.per_client``), as long as the
global layers have the same names and shapes (the same embedding size): ``heterogeneous_models``.

Deviations (docs/methods/personalized.md, "LG-FedAvg: global layers, initialisation, averaging"): the
authors' code
starts LG-FedAvg from a FedAvg-trained model (``--load_fed``) and averages uniformly over the sampled clients;
here it starts from the run's initial model and averages with sample weights (FedAvg's n_k/n).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, cast

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

WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def top_layer_names(model: nn.Module, k: int) -> set[str]:
    """State-dict names of ``model``'s top ``k`` weight layers and of the parameterised layers registered
    after the first of them (see the module docstring)."""
    layers = [(p, m) for p, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    weights = [i for i, (_, m) in enumerate(layers) if isinstance(m, WEIGHT_LAYERS)]
    if k > len(weights):
        raise ConfigError(f"lgfedavg: global_layers={k} but the model has {len(weights)} weight layers")
    out: set[str] = set()
    for prefix, module in layers[weights[-k] :]:
        out |= {f"{prefix}.{n}" if prefix else n for n in module.state_dict(keep_vars=True)}
    return out


@ALGORITHMS.register("lgfedavg")
class LGFedAvg(FedPer):
    """LG-FedAvg (Liang et al. 2020): local representation per client, global top layers averaged."""

    personal_what: ClassVar[str] = "representation"
    heterogeneous_models: ClassVar[bool] = True  # only the global layers are averaged
    vectorizable = True  # plain cross-entropy (FedPer is not)

    class Params(HyperParams):
        global_layers: int | None = Field(
            None,
            ge=1,
            description="global (averaged) layers: None the model's head (PFLlib / FL-bench reading), or "
            "the top k weight layers (authors' code --num_layers_keep; 3 of 5 on MNIST)",
        )

    def __init__(self, params: HyperParams, ctx: Context) -> None:
        super().__init__(params, ctx)
        names = ctx.model_template(None).state_dict()
        #: state-dict names of the global layers (those of the global architecture)
        self.shared = frozenset(n for n in names if n not in self.personal)

    def personal_layers(self, model: nn.Module) -> set[str]:
        """Everything below the global layers: the local representation."""
        names = set(model.state_dict())
        k = cast(LGFedAvg.Params, self.p).global_layers
        if k is None:
            is_head = getattr(model, "is_head", None)
            shared = {n for n in names if is_head is not None and is_head(n)}
        else:
            shared = top_layer_names(model, k)
        if not shared:
            raise ConfigError(
                f"{self.name}: no global layer in this model (a FedModel head or global_layers)"
            )
        if shared == names:
            raise ConfigError(f"{self.name}: global_layers={k} leaves no local representation")
        return names - shared

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
