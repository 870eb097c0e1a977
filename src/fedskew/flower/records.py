"""Payloads and client states on Flower's records.

A :class:`~fedskew.algorithms.base.Payload` maps one-to-one onto an ``ArrayRecord`` (arrays), a
``ConfigRecord`` (config) and a ``MetricRecord`` (metrics); arrays travel as NumPy ``.npy`` bytes that Flower
loads with ``allow_pickle=False``. Client states never leave their node: they are kept in the node's
``Context.state`` as ``torch.save`` bytes and read back with ``weights_only=True``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedskew.algorithms.base import Payload, State

#: the only entry of a client state the Flower server keeps: the version number of the state on its node
REF_KEY = "flower.version"


def ref_of(state: State) -> int:
    """The node-side version a server-side client state refers to (0: the initial state)."""
    return int(state.get(REF_KEY, 0))


def put_payload(rd: RecordDict, key: str, payload: Payload) -> None:
    """Store ``payload`` in ``rd`` under ``key.a`` (arrays), ``key.c`` (config) and ``key.m`` (metrics)."""
    rd[f"{key}.a"] = ArrayRecord({k: v.detach().cpu() for k, v in payload.arrays.items()})
    rd[f"{key}.c"] = ConfigRecord({k: float(v) for k, v in payload.config.items()})
    rd[f"{key}.m"] = MetricRecord({k: float(v) for k, v in payload.metrics.items()})


def config(rd: RecordDict, key: str) -> Mapping[str, Any]:
    """The config record ``key`` of ``rd``, its values as the sender wrote them (Flower types every value
    as the union of all the types a record may hold; fedskew's own messages fix each key's type)."""
    return cast(Mapping[str, Any], rd.config_records[key])


def arrays(rd: RecordDict, key: str) -> ArrayRecord:
    """The array record ``key`` of ``rd``."""
    return rd.array_records[key]


def get_scalars(rd: RecordDict, key: str) -> Payload:
    """The payload :func:`put_payload` stored under ``key`` without its arrays: its config and metrics (all
    a secure round's receipts carry of an upload)."""
    values = {k: float(v) for k, v in config(rd, f"{key}.c").items()}
    metrics = {k: float(v) for k, v in cast(Mapping[str, Any], rd.metric_records[f"{key}.m"]).items()}
    return Payload(arrays={}, config=values, metrics=metrics)


def get_payload(rd: RecordDict, key: str, device: torch.device | str = "cpu") -> Payload:
    """The payload :func:`put_payload` stored under ``key``, arrays on ``device``."""
    tensors = {k: v.to(device) for k, v in arrays(rd, f"{key}.a").to_torch_state_dict().items()}
    return replace(get_scalars(rd, key), arrays=tensors)


def state_to_bytes(state: State) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def state_from_bytes(blob: bytes) -> State:
    """A state written by :func:`state_to_bytes` (tensors and plain values only: ``weights_only=True``)."""
    out: Any = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    return out
