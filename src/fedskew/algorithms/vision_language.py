"""Shared plumbing of the vision-language methods (CacheFL and its baselines, Yi et al. 2025).

These methods run on a frozen backbone's L2-normalised features (``data.vision_language``; the model is
``identity``) and train a small head built from the assets of :class:`~fedskew.algorithms.base.Context`:
the class embeddings ``text`` (W_text, Eq. 5) and the synthetic cache ``cache_x``/``cache_y`` (Eqs. 3–4).
A :class:`VisionLanguageMethod` replaces the identity model by its head in :meth:`prepare_model`,
trains and communicates only the head's parameters whose names ``trained`` accepts, and averages them with
FedAvg's weights (Eq. 9). Frozen parts are buffers: never trained, never sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor, nn

from fedskew.algorithms.base import (
    Algorithm,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    Payload,
    Phase,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    fedavg_mean,
    model_arrays,
)
from fedskew.errors import ConfigError
from fedskew.models.base import count_parameters


def vl_assets(ctx_assets: Mapping[str, Any], method: str, *names: str) -> list[Any]:
    """The named assets, or a one-line error saying the method needs ``data.vision_language``."""
    missing = [n for n in names if n not in ctx_assets]
    if missing:
        raise ConfigError(
            f"algorithm '{method}' needs config key 'data.vision_language' (backbone features, synthetic "
            f"cache and class embeddings); missing asset '{missing[0]}'"
        )
    return [
        ctx_assets[n].detach().clone() if isinstance(ctx_assets[n], Tensor) else ctx_assets[n] for n in names
    ]


class VisionLanguageMethod(Algorithm):
    """Base of the vision-language methods: a head over backbone features, only its ``trained`` parameters
    trained and communicated."""

    mean_aggregation = False  # FedAvg of the trained part, kept as payload arrays: its own aggregate
    vectorizable = False

    #: the method needs ``data.vision_language`` (its config is checked for it)
    vision_language: ClassVar[bool] = True

    def build_head(self) -> nn.Module:
        raise NotImplementedError

    def trained(self, name: str) -> bool:
        """Whether a head entry is trained and communicated."""
        return False

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if count_parameters(model) > 0:
            raise ConfigError(
                f"algorithm '{self.name}' runs on the frozen backbone's features: set model.name=identity "
                f"(got a model with {count_parameters(model)} parameters)"
            )
        return self.build_head().to(self.ctx.device)

    def init_server(self, model: nn.Module) -> State:
        return {"weights": model_arrays(model.state_dict(), self.trained)}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        return Payload(arrays={k: v.clone() for k, v in server["weights"].items()})

    def start_local(self, step: LocalStep) -> LocalPlan:
        return LocalPlan([Phase(self.ctx.client.epochs, self.ctx.client.lr, trainable=self.trained)])

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        return LocalOutput(Payload(arrays=model_arrays(step.model.state_dict(), self.trained)), step.state)

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        new = fedavg_mean(uploads)
        return ServerUpdate({**server, "weights": model_arrays(new)})


class UntrainedMethod(VisionLanguageMethod):
    """A method with no federated training (zero-shot, the untrained cache): no local steps, nothing sent;
    the head keeps its construction-time values."""

    def init_server(self, model: nn.Module) -> State:
        return {}

    def broadcast(self, server: State, info: RoundInfo) -> Payload:
        return Payload()

    def start_local(self, step: LocalStep) -> LocalPlan:
        return LocalPlan([])

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        return LocalOutput(Payload(), step.state)

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        return ServerUpdate({**server})


def zero_shot_logits(f: Tensor, text: Tensor, scale: float) -> Tensor:
    """Eq. (5) with CLIP's logit scale: ``s · f W_textᵀ`` ``[B, N]``."""
    return scale * f @ text.T


class TextHead(nn.Module):
    """Zero-shot classifier: ``s · f W_textᵀ`` (Eq. 5); W_text is a frozen buffer."""

    text: Tensor

    def __init__(self, text: Tensor, scale: float) -> None:
        super().__init__()
        self.register_buffer("text", text)
        self.scale = scale

    def forward(self, f: Tensor) -> Tensor:
        return zero_shot_logits(f, self.text, self.scale)
