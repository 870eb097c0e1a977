"""A node's reply checked before any of it is used: the server trusts no node (issue 51, item 2).

A node reports, for the clients it was asked to train, which it accepted, their losses and sample counts,
and each accepted client's upload. :func:`check_reply` takes nothing on trust:

* **the reply as a whole**: the three lists present and of one length, every client id one the server asked
  this node for, none twice. Otherwise every client of the node is refused (the node cannot say which);
* **each client's entry**: its loss a number, not infinite (where the method discloses losses; NaN: the
  client took no step), its sample count exactly the count the server holds for the client
  (:func:`expected_count`: the manifest's, or 1 where the method does not disclose counts), so a node can
  neither inflate nor shrink its weight in a mean; its upload readable and of the method's layout
  (:mod:`fedskew.algorithms.layouts`: no array missing, none unknown, each of its dtype and shape, ids and
  counts in range, the config and metrics names the server reads) and finite.

A refused client is a failed client under ``engine.on_client_error``
(:func:`fedskew.engine.policy.reply_refused`): left out of the round with one logged line, or the round
fails with one line. The checks are pure functions of the reply, the request and the algorithm, so any
runtime receiving uploads it does not produce itself calls them; the Flower server does
(:mod:`fedskew.flower.server`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fedskew.algorithms.base import Algorithm, Payload, RoundInfo, Upload
from fedskew.algorithms.layouts import ArraySpec, UploadLayout, expected_layout

#: the lists a train reply's job record carries, one entry per accepted client
REPLY_LISTS = ("accepted", "loss", "samples")
#: lists a reply may carry besides (the clients' local steps and sample passes: the run's compute, a
#: diagnostic the server cannot verify; absent: 0), one entry per accepted client where present
WORK_LISTS = ("steps", "passes")


@dataclass(frozen=True)
class Accepted:
    """An entry that passed every check: the client's upload (with the count the server holds) and loss,
    and the work its node reports (:data:`WORK_LISTS`)."""

    upload: Upload
    loss: float
    steps: int = 0
    passes: int = 0


@dataclass
class Checked:
    """The outcome of a reply's checks: the accepted entries, in the reply's order, and the refused clients
    with the one-line problem of each (every requested client when the reply as a whole is refused)."""

    accepted: list[Accepted] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)


def shown(value: object) -> str:
    """``repr(value)`` cut to 60 characters: a hostile name or value cannot flood the one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_int(value: object) -> bool:
    """An integer as a node's record carries it (``bool`` is not a count nor an id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def expected_count(algorithm: Algorithm, cid: int) -> int:
    """The sample count an honest upload of client ``cid`` carries: its training samples as the server's
    context holds them (the partition, or the node's manifest), or 1 where the method does not disclose
    counts (local DP), exactly as the embedded engine reports it (:mod:`fedskew.engine.client`)."""
    if not algorithm.discloses_client_statistics:
        return 1
    return int(algorithm.ctx.client_sizes[cid])


def reply_problem(requested: Sequence[int], job: Mapping[str, Any] | None) -> str | None:
    """What is wrong with a reply as a whole (``job``: its job record, ``None`` when it has none), or
    ``None``."""
    if job is None:
        return "the reply has no job record"
    lists = {k: job.get(k) for k in REPLY_LISTS}
    bad = [k for k, v in lists.items() if not isinstance(v, list)]
    if bad:
        return f"the reply's {bad[0]!r} is missing or not a list"
    if len({len(v) for v in lists.values() if isinstance(v, list)}) != 1:
        return "the reply's 'accepted', 'loss' and 'samples' differ in length"
    for k in WORK_LISTS:
        v = job.get(k)
        if v is not None and not (isinstance(v, list) and len(v) == len(lists["accepted"] or [])):
            return f"the reply's {k!r} is not a list of one entry per accepted client"
        if v is not None and not all(is_int(n) and n >= 0 for n in v):
            return f"the reply's {k!r} holds a value that is not a non-negative integer"
    seen: set[int] = set()
    for cid in lists["accepted"] or []:
        if not is_int(cid):
            return f"the reply names client {shown(cid)}, not a client id"
        if cid not in requested:
            asked = list(requested)
            return f"the reply names client {cid}, which this node was not asked to train (asked: {asked})"
        if cid in seen:
            return f"the reply names client {cid} twice"
        seen.add(cid)
    return None


def entry_problem(loss: object, samples: object, expected: int, discloses: bool) -> str | None:
    """What is wrong with one entry's loss and sample count, or ``None``."""
    if discloses and not (
        isinstance(loss, (int, float)) and not isinstance(loss, bool) and not math.isinf(loss)
    ):
        return f"its loss {shown(loss)} is not a number"  # NaN is: a client that took no step has no loss
    if not is_int(samples):
        return f"its sample count {shown(samples)} is not an integer"
    if samples != expected:
        return f"it claims {samples} samples, the server holds {expected} for the client"
    return None


def _spec_problem(
    name: str, spec: ArraySpec, t: Any, sizes: dict[str, int], limits: Mapping[str, int]
) -> str | None:
    what = f"array {shown(name)} is {ArraySpec(tuple(t.shape), t.dtype)}, the method uploads {spec}"
    if t.dtype != spec.dtype or len(t.shape) != len(spec.shape):
        return what
    for want, got in zip(spec.shape, t.shape, strict=True):
        if isinstance(want, int) and got != want:
            return what
        if isinstance(want, str):
            if sizes.setdefault(want, got) != got:
                return f"{what} ({want} = {sizes[want]} elsewhere in the upload)"
            if want in limits and got > limits[want]:
                return f"{what} ({want} at most {limits[want]})"
    if t.numel() and spec.low is not None and bool((t < spec.low).any()):
        return f"array {shown(name)} holds values below {spec.low}"
    if t.numel() and spec.high is not None and bool((t > spec.high).any()):
        return f"array {shown(name)} holds values above {spec.high}"
    return None


def _names_problem(kind: str, names: frozenset[str] | None, values: Mapping[str, float]) -> str | None:
    """A scalar the server reads that is missing, or one it does not know (``names`` None: any)."""
    if names is None or set(values) == names:
        return None
    odd = sorted(names ^ set(values))[0]
    return f"{kind} value {shown(odd)} is {'missing' if odd in names else 'not one the method uploads'}"


def layout_problem(layout: UploadLayout, payload: Payload) -> str | None:
    """What in ``payload`` departs from ``layout`` (a missing or unknown array, a dtype, a shape, a value out
    of range, a missing or unknown config or metrics name the server reads) or is not finite; ``None`` when
    nothing does."""
    names = set(payload.arrays)
    missing = sorted(set(layout.arrays) - names)
    if missing:
        return f"array {shown(missing[0])} is missing"
    unknown = sorted(names - set(layout.arrays))
    if unknown:
        return f"array {shown(unknown[0])} is not one the method uploads"
    sizes: dict[str, int] = {}
    for name in sorted(names):
        problem = _spec_problem(name, layout.arrays[name], payload.arrays[name], sizes, layout.limits)
        if problem is not None:
            return problem
    problem = _names_problem("config", layout.config, payload.config)
    problem = problem or _names_problem("metrics", layout.metrics, payload.metrics)
    if problem is not None:
        return problem
    return None if payload.is_finite() else "non-finite values"


def _read(load: Callable[[int], Payload], cid: int) -> Payload | str:
    """Client ``cid``'s upload, or the one-line reason it cannot be read (a node's bytes are untrusted)."""
    try:
        return load(cid)
    except Exception as err:  # whatever a hostile record makes the reader raise
        text = str(err).splitlines()[0] if str(err) else ""
        return f"its upload cannot be read ({type(err).__name__}: {text[:120]})"


def check_reply(
    algorithm: Algorithm,
    info: RoundInfo,
    requested: Sequence[int],
    job: Mapping[str, Any] | None,
    load: Callable[[int], Payload],
    broadcasts: Mapping[int, Payload],
    arrays: bool = True,
) -> Checked:
    """Check a node's reply to the request to train ``requested`` in round ``info.round``: ``job`` its job
    record (``None``: it has none), ``load(cid)`` reads client ``cid``'s upload, ``broadcasts`` what each
    client was sent. Every requested client the reply does not accept is neither accepted nor refused here
    (its node rejected it under its own ``engine.on_client_error``). ``arrays=False``: the uploads carry no
    arrays (a secure round: they are in the masked sum), only their config and metrics are checked."""
    out = Checked()
    problem = reply_problem(requested, job)
    if problem is not None or job is None:
        out.refused = dict.fromkeys(requested, problem or "")
        return out
    discloses = algorithm.discloses_client_statistics
    n = len(job["accepted"])
    steps, passes = (job.get(k) or [0] * n for k in WORK_LISTS)
    for i, (cid, loss, samples) in enumerate(zip(job["accepted"], job["loss"], job["samples"], strict=True)):
        expected = expected_count(algorithm, cid)
        problem = entry_problem(loss, samples, expected, discloses)
        payload = _read(load, cid) if problem is None else problem
        if isinstance(payload, str):
            out.refused[cid] = payload
            continue
        layout = expected_layout(algorithm, broadcasts[cid], RoundInfo(info.round, cid, info.seed))
        layout = layout if arrays else replace(layout, arrays={})
        problem = layout_problem(layout, payload)
        if problem is not None:
            out.refused[cid] = problem
            continue
        value = float(loss) if discloses else math.nan
        out.accepted.append(Accepted(Upload(cid, expected, payload), value, steps[i], passes[i]))
    return out
