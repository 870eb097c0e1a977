"""Checks of a method's declared flags against the run, made when the run is built (before round 1).

``Algorithm.heterogeneous_models``: a method that averages clients' models needs every client's model to
have the global model's parameter names and shapes; ``model.per_client`` options that change them are
refused with one line unless the method declares it (FedProto, LG-FedAvg, local). Without this check FedAvg
with per-client models fails in round 1 with a tensor-size error, or under ``on_client_error: drop`` drops
those clients silently every round.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from torch import nn

from fedskew.algorithms.base import ALGORITHMS, Algorithm
from fedskew.errors import ConfigError


def _layout(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_model_layouts(
    alg_cls: type[Algorithm],
    num_clients: int,
    build_model: Callable[[int | None], nn.Module],
    arch_key: Callable[[int | None], Hashable],
) -> None:
    """Refuse (one line) clients whose model differs in parameter names or shapes from the global model,
    for a method that does not declare ``heterogeneous_models``. One model is built per distinct
    architecture key (``model.per_client`` option sets), so a config without it builds one."""
    if alg_cls.heterogeneous_models:
        return
    reference_key = arch_key(None)
    seen: dict[Hashable, int] = {}
    for cid in range(num_clients):
        key = arch_key(cid)
        if key != reference_key and key not in seen:
            seen[key] = cid
    if not seen:
        return
    reference = _layout(build_model(None))
    for cid in seen.values():
        layout = _layout(build_model(cid))
        if layout != reference:
            diff = sorted(k for k in set(layout) | set(reference) if layout.get(k) != reference.get(k))
            allowed = ", ".join(n for n in ALGORITHMS.names() if ALGORITHMS.get(n).heterogeneous_models)
            raise ConfigError(
                f"model.per_client: client {cid}'s model differs from the global one ({diff[0]}); algorithm "
                f"'{alg_cls.name}' averages one architecture; allowed: per-client options that keep every "
                f"shape, or a method with heterogeneous_models ({allowed})"
            )


def check_declared_mean(alg_cls: type[Algorithm]) -> None:
    """``mean_aggregation`` (the default) says the method's aggregation is the engine's weighted mean followed
    by ``server_step``: the engine then computes that mean itself (folded as uploads arrive) and never calls
    ``aggregate``. A method that overrides ``aggregate`` while declaring it would have its own rule skipped in
    folded rounds and used in the others; refused with one line before round 1."""
    if alg_cls.mean_aggregation and alg_cls.aggregate is not Algorithm.aggregate:
        raise ConfigError(
            f"algorithm '{alg_cls.name}' overrides aggregate but declares mean_aggregation (the default), so "
            "the engine would compute the mean and skip it; put the server's step in server_step (and the "
            "weights in mean_weights), or declare mean_aggregation = False"
        )
