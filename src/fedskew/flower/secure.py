"""Secure aggregation on the Flower runtimes with Flower's own SecAgg+ (``engine.secagg``; issue 51, item 7).

SecAgg+ (Bell et al., CCS 2020; Flower's ``SecAggPlusWorkflow`` on the ServerApp and ``secaggplus_mod`` on
every ClientApp, used unchanged) lets the server learn the sum of the nodes' vectors and nothing else: each
node quantizes its vector, adds a private mask and pairwise masks agreed with its neighbours, and the masks
cancel in the sum (those of nodes that dropped out after sharing their keys are rebuilt from
``threshold`` of the ``shares`` of their secrets). One SecAgg+ run is one round:

1. **What a node sums.** A method whose aggregation is a weighted mean (``mean_aggregation``) needs
   ``Σ_k w_k u_k / Σ_k w_k`` over the round's uploads, with the planned weights ``w_k`` of
   :func:`fedskew.engine.folding.plan_round` (``Algorithm.mean_weights`` of the counts the server holds).
   Node ``n`` trains its sampled clients as always (:func:`fedskew.flower.node.handle_train`) and hands
   SecAgg+ ``x_n = Σ_{k∈n} w_k (u_k − b_k) / W_n`` with weight ``W_n = Σ_{k∈n} w_k`` (``b_k``: what client
   ``k`` was sent, for every upload array the broadcast has with the same shape; otherwise ``u_k`` itself).
   Deltas, not models: they are small, so Flower's clipping range (default ±8) and its 2^22 quantization
   levels lose ≈ 2c/2^22 ≈ 4e-6 per value and node, rather than clipping weights.
2. **What the server gets.** SecAgg+ returns ``Σ_n q_n x_n / Σ_n q_n`` with ``q_n`` the node's weight
   quantized to 2^22 levels of ``max_weight`` (here :data:`WEIGHT_SCALE`), i.e. the weighted mean of the
   deltas over the nodes that made the sum; the server adds back ``Σ w_k b_k / Σ w_k`` (it knows what it
   sent) and calls the method's ``server_step`` (the engine's folded-mean seam:
   :mod:`fedskew.engine.folding`).
   The weights of the nodes that dropped out are left out, so the result is ``mean_weights`` of the clients
   that made it: exact for FedAvg's ``n_k / n`` and for uniform weights (the only kinds allowed:
   :func:`fedskew.experiment.secagg_checks.check_secagg`).
3. **What the server still sees in the clear:** which clients each node trained, their sample counts,
   training losses and the scalar ``config`` / ``metrics`` entries of their uploads (FedNova's ‖a_i‖₁),
   checked as every reply is (:mod:`fedskew.engine.replies`), and each node's weight ``W_n``, which must
   equal the server's plan. What it cannot check is that a node's masked vector is what the node claims
   (the price of not seeing it): a node can bias the mean within the clipping range, which is why robust
   rules, which need every update, are refused with secure aggregation.

Any problem with a round's sum (a refused reply, a weight that is not the plan, arrays that are not the
method's) discards the whole round's update: its clients are rejected under ``engine.on_client_error``,
since no single upload can be taken out of a sum.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import (
    Code,
    FitRes,
    Status,
    ndarrays_to_parameters,
)
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.serverapp import Grid

from fedskew.errors import FedskewError
from fedskew.flower.records import config, get_payload
from fedskew.settings import SecAggSection

if TYPE_CHECKING:
    pass

log = logging.getLogger("fedskew.flower")

#: the FitIns / FitRes config entry carrying fedskew's own records (a serialized ``RecordDict``)
SECAGG_KEY = "fedskew"
#: a node's weight ``W_n`` (at most 1: planned mean weights sum to 1) travels as ``round(W_n · 2^20)``
#: examples, and SecAgg+'s ``max_weight`` is 2^20, so the weight ratio it quantizes is at most 1
WEIGHT_SCALE = 2**20
#: an integer array (BatchNorm's step counter) travels divided by this, so that a round's change of up to
#: 8 · 2^16 steps fits the default clipping range; the server multiplies back and rounds (SecAgg+'s error,
#: ≈ 4e-6 · 2^16 ≈ 0.25 steps, is below the rounding's 0.5)
COUNT_SCALE = 2.0**16
#: the job-record entries of a secure round: each client's planned weight, and the clipping range
WEIGHTS, CLIPPING = "secagg_weights", "secagg_clipping"


def to_bytes(content: RecordDict) -> bytes:
    return bytes(recorddict_to_proto(content).SerializeToString())


def from_bytes(blob: bytes) -> RecordDict:
    proto = ProtoRecordDict()
    proto.ParseFromString(blob)
    return recorddict_from_proto(proto)


def node_examples(weight: float) -> int:
    """The ``num_examples`` a node with weight ``weight`` reports to SecAgg+ (see :data:`WEIGHT_SCALE`)."""
    return round(weight * WEIGHT_SCALE)


def workflow_of(section: SecAggSection, timeout: float | None) -> Any:
    """Flower's ``SecAggPlusWorkflow`` for ``engine.secagg`` (its own checks raise ``ValueError``), with one
    correction: a node that does not answer the setup or the key-sharing stage (it crashed, but its
    heartbeat has not lapsed) is left out of the round's protocol. Flower 1.42 keeps it among the sampled
    nodes, so that the unmask stage looks for shares of its secrets, which nobody holds since it never
    shared them, and the round halts (or a node fails asking for them). A node whose keys or shares nobody
    received has no mask in anyone's vector, so leaving it out is exact."""
    from flwr.server.workflow import SecAggPlusWorkflow

    class Workflow(SecAggPlusWorkflow):
        def setup_stage(self, grid: Grid, context: Any, state: Any) -> bool:
            return self._kept(bool(super().setup_stage(grid, context, state)), state)

        def share_keys_stage(self, grid: Grid, context: Any, state: Any) -> bool:
            return self._kept(bool(super().share_keys_stage(grid, context, state)), state)

        def _kept(self, ok: bool, state: Any) -> bool:
            """Leave the nodes that did not answer this stage out of the round: one that sent no keys, or no
            shares of its secrets, is in nobody's masks (a node masks only with those whose shares it got)."""
            answered = set(state.active_node_ids)
            state.sampled_node_ids = answered
            state.nid_to_neighbours = {
                n: nb & answered for n, nb in state.nid_to_neighbours.items() if n in answered
            }
            return ok or (bool(answered) and bool(self._check_threshold(state)))

    return Workflow(
        section.shares, section.threshold, max_weight=float(WEIGHT_SCALE),
        clipping_range=section.clipping_range, quantization_range=section.quantization_range,
        timeout=timeout,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- node side
def is_secure(content: RecordDict) -> bool:
    """A train message of a secure round (the SecAgg+ stage that trains: Flower's legacy ``fitins``)."""
    return "fitins.config" in content.config_records


def array_kind(shape: tuple[int, ...], floating: bool, sent: torch.Tensor | None) -> tuple[bool, float]:
    """How an upload array enters the sum: whether as its change from what the client was sent (the same
    array in the broadcast, of the same shape and kind), and the factor it is divided by (1; integer arrays:
    :data:`COUNT_SCALE`). The server derives the same from the method's layout and its own broadcast."""
    delta = sent is not None and tuple(sent.shape) == tuple(shape) and sent.is_floating_point() == floating
    return delta, 1.0 if floating else COUNT_SCALE


def node_update(
    sent: RecordDict, reply: RecordDict, accepted: Sequence[int], weights: Mapping[int, float]
) -> tuple[list[np.ndarray], list[str], list[bool], float]:
    """The node's ``x_n`` (float64 arrays by sorted name), the names, which are deltas, and ``W_n``."""
    if not accepted:
        raise FedskewError("secure aggregation: no client of this node finished training; nothing to add")
    total = sum(weights[c] for c in accepted)
    sums: dict[str, torch.Tensor] = {}
    names: list[str] | None = None
    delta: dict[str, bool] = {}
    for cid in accepted:
        up, down = get_payload(reply, f"u.{cid}").arrays, get_payload(sent, f"p.{cid}").arrays
        if names is None:
            names = sorted(up)
        if sorted(up) != names:
            raise FedskewError("secure aggregation: this node's clients upload different arrays")
        for k in names:
            base = down.get(k)
            is_delta, scale = array_kind(tuple(up[k].shape), up[k].is_floating_point(), base)
            if delta.setdefault(k, is_delta) != is_delta:
                raise FedskewError(f"secure aggregation: array {k!r} is sent to some clients only")
            term = (up[k].double() - (base.double() if base is not None and is_delta else 0.0)) / scale
            sums[k] = sums[k] + weights[cid] * term if k in sums else weights[cid] * term
    assert names is not None
    # 0-d arrays travel as 1-d: Flower 1.42's unmasking rescales its arrays in place, which a 0-d array
    # (a NumPy scalar after arithmetic) silently escapes
    arrays = [np.atleast_1d((sums[k] / total).numpy()) for k in names]
    return arrays, names, [delta[k] for k in names], total


def handle_secure_train(content: RecordDict, context: Context) -> RecordDict:
    """A secure round's training on a node: train as always, then hand ``secaggplus_mod`` the node's
    weighted update ``x_n`` and weight (Flower's ``FitRes``) and the server the receipts (every record of
    the reply but the uploads' arrays), which the mod passes on in the clear."""
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitins

    from fedskew.flower.node import handle_train

    sent = from_bytes(cast(bytes, recorddict_to_fitins(content, keep_input=True).config[SECAGG_KEY]))
    reply = handle_train(sent, context, secure=True)
    job, answer = config(sent, "job"), config(reply, "job")
    weights = dict(zip((int(c) for c in job["cids"]), (float(w) for w in job[WEIGHTS]), strict=True))
    arrays, names, delta, total = node_update(sent, reply, [int(c) for c in answer["accepted"]], weights)
    clip = float(job[CLIPPING])
    largest = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
    if largest > clip:
        raise FedskewError(
            f"secure aggregation: this node's update reaches {largest:.3g}, beyond "
            f"engine.secagg.clipping_range={clip:g}; raise it"
        )
    receipts = RecordDict({k: v for k, v in reply.items() if not isinstance(v, ArrayRecord)})
    receipts["secagg"] = ConfigRecord({"names": names, "delta": delta})
    fit = FitRes(
        Status(Code.OK, ""), ndarrays_to_parameters(arrays), node_examples(total),
        {SECAGG_KEY: to_bytes(receipts)},
    )  # fmt: skip
    return fitres_to_recorddict(fit, keep_input=False)


def secure_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """The ClientApp's mod: Flower's ``secaggplus_mod`` for the messages of a SecAgg+ run, nothing for the
    others (fedskew's plain train, evaluate and query messages)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return cast(Message, call_next(msg, context))
