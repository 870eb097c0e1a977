"""Evaluation protocols: ``global`` (one model, the held-out global test set) and ``personalized`` (each
client's own test split, with the model / state that client would use). Batched; every metric once.

The round transaction (:class:`fedskew.engine.loop.Simulation`) asks a :class:`RoundEvaluator`: this
module's :class:`Evaluator` scores in this process; the Flower server's scores personal models on the
nodes holding the clients' states. Both reduce per-client sums with :func:`client_summary`, so a metric
means the same on both runtimes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.algorithms.base import (
    Algorithm,
    ClientView,
    ContractError,
    LocalStep,
    Payload,
    RoundInfo,
    State,
    load_state,
)
from fedskew.data.federated import FederatedData
from fedskew.engine.device import precision_context
from fedskew.engine.runtime import ClientData, ModelCache
from fedskew.engine.types import tree_to
from fedskew.seeding import derive_seed, seed_torch


class RoundEvaluator(Protocol):
    """Metrics of a (server state, client states) pair: what the round transaction records."""

    def evaluate(self, server: State, state_of: Callable[[int], State], round_idx: int) -> dict[str, Any]:
        """The record of ``server`` and the clients' states (``state_of(cid)``, CPU) after ``round_idx``."""
        ...


#: a test set whose float32 copy fits in this many bytes is kept converted (the model's input), instead of
#: converting each batch at every evaluation (MNIST's 10k: 31 MB, ~2 ms an evaluation)
FLOAT_TEST_BYTES = 1 << 28
#: default evaluation batch per device type: on a CPU, 128 images keep a CNN's activations in cache (a 10k
#: MNIST evaluation of cnn_mnist took 3.7 s at 1024 and 1.6 s at 128); a GPU wants large batches
EVAL_BATCH = {"cpu": 128}
EVAL_BATCH_OTHER = 1024


@dataclass
class HeadScores:
    """Per-sample correctness for each named head and per-sample loss of the ``logits`` head."""

    correct: dict[str, Tensor]  # head -> bool [n]
    loss: Tensor  # float [n]


@torch.no_grad()
def score(
    algorithm: Algorithm,
    model: nn.Module,
    payload: Payload,
    state: State | None,
    x: Tensor,
    y: Tensor,
    batch_size: int,
    to_float: Callable[[Tensor], Tensor],
    precision: str = "fp32",
) -> HeadScores:
    """Run ``algorithm.predict`` in batches over ``x`` (raw tensors, converted per batch), its forward
    passes under ``engine.precision``."""
    model.eval()
    correct: dict[str, list[Tensor]] = {}
    losses: list[Tensor] = []
    for start in range(0, y.shape[0], batch_size):
        xb = to_float(x[start : start + batch_size])
        yb = y[start : start + batch_size]
        with precision_context(yb.device, precision):
            heads = algorithm.predict(model, xb, payload, state)
        if precision != "fp32":  # bf16 scores: argmax and the loss in float32
            heads = {k: v.float() for k, v in heads.items()}
        for name, scores in heads.items():
            correct.setdefault(name, []).append(scores.argmax(1) == yb)
        logits = heads.get("logits", next(iter(heads.values())))
        losses.append(F.cross_entropy(logits, yb, reduction="none"))
    return HeadScores({k: torch.cat(v) for k, v in correct.items()}, torch.cat(losses))


def summarize(
    per_client: dict[str, Tensor], loss: float, heads: list[str], sizes: Tensor | None = None
) -> dict[str, Any]:
    """Metrics record: ``accuracy`` (primary head) and ``accuracy_<head>`` for the others.

    ``per_client[head]`` holds one accuracy per client (``personalized``: mean and std over clients, as
    FedProto and MP-FedCL report) or a single value (``global``). A client without test samples
    (``sizes == 0``, possible with ``min_size: 0`` partitions) has no accuracy: it is left out of the mean and
    std, and is ``None`` in ``accuracy_clients``.
    """
    out: dict[str, Any] = {}
    has = None if sizes is None else (sizes > 0).cpu()
    for i, head in enumerate(heads):
        every = per_client[head].double().cpu()
        accs = every if has is None else every[has]
        key = "accuracy" if i == 0 else f"accuracy_{head}"
        out[key] = float(accs.mean())
        out[key + "_std"] = float(accs.std(unbiased=False)) if accs.numel() > 1 else 0.0
        if has is not None and i == 0:  # per-client accuracies of the primary head (spread analyses)
            out["accuracy_clients"] = [
                round(float(a), 6) if h else None for a, h in zip(every, has.tolist(), strict=True)
            ]
    out["loss"] = loss
    if sizes is not None:  # sample-weighted personalized accuracy, for comparison with pooled numbers
        w = sizes.double() / sizes.sum()
        out["accuracy_weighted"] = float((per_client[heads[0]].double() * w).sum())
    return out


def client_summary(
    correct: dict[str, Tensor], loss: Tensor, sizes: Tensor, heads: list[str]
) -> dict[str, Any]:
    """The personalized record from per-client sums: ``correct[head][i]`` correct predictions and
    ``loss[i]`` the summed loss of client ``i``'s ``sizes[i]`` samples (float64). Accuracies and losses are
    per-client means; the loss is averaged over the clients that have samples, as the accuracy is
    (:func:`summarize`). The one reduction of both runtimes."""
    counts = sizes.double().clamp_min(1)
    per_client = {h: correct[h] / counts for h in heads}
    mean_loss = float((loss / counts)[sizes > 0].mean())
    return summarize(per_client, mean_loss, heads, sizes)


class LazyClientView(ClientView):
    """A client's training data read on first access: an evaluation-time adaptation hook that does not look
    at the data (the default :meth:`~fedskew.algorithms.base.Algorithm.adapt_for_eval`) costs no copy of
    it."""

    def __init__(self, cid: int, read: Callable[[], ClientView]) -> None:
        self.cid, self._read = cid, read  # ClientView's other fields: properties
        self._view: ClientView | None = None

    def _data(self) -> ClientView:
        if self._view is None:
            self._view = self._read()
        return self._view

    @property
    def x(self) -> Tensor:  # type: ignore[override]
        return self._data().x

    @property
    def y(self) -> Tensor:  # type: ignore[override]
        return self._data().y

    @property
    def class_counts(self) -> Tensor:  # type: ignore[override]
        return self._data().class_counts


#: seed key of the global RNG stream an evaluation-time adaptation runs under (with round and client)
ADAPT_KEY = 0xE7A1


def load_eval_weights(
    algorithm: Algorithm,
    model: nn.Module,
    payload: Payload,
    state: State | None,
    info: RoundInfo,
    read_client: Callable[[], ClientView] | None = None,
) -> None:
    """Load into ``model`` what ``info.cid`` is scored with: :meth:`Algorithm.eval_weights`, then, for a
    client whose training data ``read_client`` gives, what :meth:`Algorithm.adapt_for_eval` returns (with
    gradients enabled, the global RNG seeded from ``(seed, round, cid)`` inside a forked stream, so the
    result is the same in every runtime and engine mode and the run's streams are untouched). The one path
    of the embedded evaluator and the Flower nodes; nothing here is committed."""
    load_state(model, algorithm.eval_weights(payload, state))
    if read_client is None or state is None or info.cid is None:
        return
    view = LazyClientView(info.cid, read_client)
    step = LocalStep(model=model, payload=payload, state=state, client=view, info=info)
    device = next(iter(model.state_dict().values()), torch.empty(0)).device  # a model without weights: CPU
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        seed_torch(derive_seed(info.seed, info.round, info.cid, ADAPT_KEY), device)
        adapted = algorithm.adapt_for_eval(step)
    if adapted is None:
        return
    unknown = sorted(set(adapted) - set(model.state_dict()))
    if unknown:
        raise ContractError(
            f"{algorithm.name}.adapt_for_eval returned weights the model lacks: {unknown[:3]}"
        )
    load_state(model, adapted)


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum of ``values`` within each segment (client), in float64, vectorized with ``index_add_``."""
    sums = torch.zeros(num_segments, dtype=torch.float64, device=values.device)
    return sums.index_add_(0, segment_ids, values.double())


def class_accuracy(correct: Tensor, y: Tensor, num_classes: int) -> list[float | None]:
    """Per class ``c < num_classes``, the share of the samples labelled ``c`` that ``correct`` marks right
    (``None``: no such sample): ``accuracy_classes``, what a deadline that drops the rare classes' clients
    costs those classes (issue 55). Two ``bincount``s, no loop over samples; the per-class counts weighted by
    the class sizes sum to ``accuracy``'s count exactly. On the CPU: a CUDA ``bincount`` with weights has
    no deterministic kernel (``engine.deterministic``), and a test set's labels are small."""
    y = y.cpu()
    total = torch.bincount(y, minlength=num_classes)[:num_classes]
    hits = torch.bincount(y, weights=correct.cpu().double(), minlength=num_classes)[:num_classes]
    return [float(h / t) if t else None for h, t in zip(hits.tolist(), total.tolist(), strict=True)]


def _identity(x: Tensor) -> Tensor:
    return x


@dataclass
class EvalData:
    """The held-out tensors on the device: the global test set (converted once when its float32 copy is at
    most :data:`FLOAT_TEST_BYTES`, else raw and converted per batch by ``to_float``) with the clients'
    test splits as index views into it, and the validation samples (normalised) with the clients'
    validation splits as index views into them. No training sample besides the validation ones."""

    x_test: Tensor
    y_test: Tensor
    to_float: Callable[[Tensor], Tensor]
    test_idx: list[Tensor]
    x_val: Tensor
    y_val: Tensor
    val_idx: list[Tensor]
    #: the dataset's classes (``accuracy_classes`` has one entry each, a class absent from the test set too)
    num_classes: int = 0

    @classmethod
    def of(cls, data: FederatedData, device: torch.device) -> EvalData:
        """The evaluation data of ``data`` on ``device``. The validation samples are kept in the order of
        their training-set index (the order scoring saw them in when they were read from the whole
        training pool), each client's split an index view into them."""
        ds = data.dataset
        val = data.val_idx or []
        pool = torch.unique(torch.cat(val)) if val else torch.zeros(0, dtype=torch.long)
        x_test = ds.x_test.to(device)
        to_float: Callable[[Tensor], Tensor] = ds.normaliser()
        if x_test.numel() * 4 <= FLOAT_TEST_BYTES:  # converted once (element-wise: the same values)
            x_test, to_float = to_float(x_test), _identity
        return cls(
            x_test=x_test,
            y_test=ds.y_test.to(device),
            to_float=to_float,
            test_idx=[t.to(device) for t in data.test_idx],
            x_val=ds.normaliser()(ds.x_train[pool]).to(device),
            y_val=ds.y_train[pool].to(device),
            val_idx=[torch.searchsorted(pool, v).to(device) for v in val],
            num_classes=ds.num_classes,
        )


class Evaluator:
    """Metrics of a (server state, client states) pair under ``global`` or ``personalized`` protocol.

    ``clients``: the clients' training data, which evaluation-time adaptation reads
    (:meth:`~fedskew.algorithms.base.Algorithm.adapt_for_eval`; ``None``: no adaptation, as a server that
    holds no training sample). ``per_class`` (``eval.per_class``): the test record also holds
    ``accuracy_classes`` (:func:`class_accuracy` of the primary head; ``personalized``: every client's
    own-model scores of its own test samples, pooled)."""

    def __init__(
        self,
        algorithm: Algorithm,
        models: ModelCache,
        data: EvalData,
        protocol: str,
        batch_size: int,
        seed: int,
        precision: str = "fp32",
        clients: ClientData | None = None,
        per_class: bool = False,
    ) -> None:
        self.algorithm, self.models, self.data = algorithm, models, data
        self.protocol, self.batch_size, self.seed = protocol, batch_size, seed
        self.precision, self.clients, self.per_class = precision, clients, per_class

    def evaluate(self, server: State, state_of: Callable[[int], State], round_idx: int) -> dict[str, Any]:
        """The record of ``server`` and the clients' states (``state_of(cid)``, CPU) after ``round_idx``."""
        d, per_client = self.data, self.protocol == "personalized"
        splits = [_Split(d.x_test, d.y_test, d.test_idx if per_client else None, d.to_float)]
        if d.y_val.numel():  # validation (for best-round selection, never test): already normalised
            if per_client:
                splits.append(_Split(d.x_val, d.y_val, d.val_idx, _identity))
            else:
                idx = torch.cat(d.val_idx)
                splits.append(_Split(d.x_val[idx], d.y_val[idx], None, _identity))
        scorer = _Scorer(self, server, state_of, round_idx)
        if per_client and self.algorithm.personalized_eval:
            scorer.personal = scorer.personal_parts(splits)
        out = scorer.split(splits[0], 0)
        if len(splits) > 1:
            val = scorer.split(splits[1], 1)
            out.update({f"val_{k}": val[k] for k in ("accuracy", "loss")})
        return out


@dataclass
class _Split:
    """Samples to score: ``idx`` per client (``None``: the global protocol on all of ``x``)."""

    x: Tensor
    y: Tensor
    idx: list[Tensor] | None
    to_float: Callable[[Tensor], Tensor]


@dataclass
class _Scorer:
    ev: Evaluator
    server: State
    state_of: Callable[[int], State]
    round_idx: int
    #: per split, the scores of each client with samples in it (personal models)
    personal: list[list[HeadScores]] | None = None

    def load(self, cid: int | None, device: torch.device) -> tuple[nn.Module, Payload, State | None]:
        """``cid``'s model with the weights it is scored with (adapted on its data where the method adapts),
        its payload and state (``cid=None``: the global model)."""
        alg, ev = self.ev.algorithm, self.ev
        info = RoundInfo(self.round_idx, cid, ev.seed)
        payload = alg.broadcast(self.server, info)
        state = None if cid is None else tree_to(self.state_of(cid), device)
        model = ev.models.model_for(cid)
        clients = ev.clients
        read = None if clients is None or cid is None else partial(clients.view, cid)
        load_eval_weights(alg, model, payload, state, info, read)
        return model, payload, state

    def score(
        self, cid: int | None, x: Tensor, y: Tensor, to_float: Callable[[Tensor], Tensor]
    ) -> HeadScores:
        model, payload, state = self.load(cid, x.device)
        ev = self.ev
        return score(ev.algorithm, model, payload, state, x, y, ev.batch_size, to_float, ev.precision)

    def personal_parts(self, splits: list[_Split]) -> list[list[HeadScores]]:
        """Each client's own model on its samples of every split, its weights loaded (and adapted) once for
        all of them; a client without samples in any split is not scored (nor adapted)."""
        ev = self.ev
        out: list[list[HeadScores]] = [[] for _ in splits]
        client_idx = [s.idx for s in splits]
        for cid in range(len(client_idx[0] or [])):
            held = [k for k, idx in enumerate(client_idx) if idx is not None and len(idx[cid])]
            if not held:
                continue
            model, payload, state = self.load(cid, splits[0].x.device)
            for k in held:
                s, idx = splits[k], client_idx[k][cid]  # type: ignore[index]
                args = (s.x[idx], s.y[idx], ev.batch_size, s.to_float, ev.precision)
                out[k].append(score(ev.algorithm, model, payload, state, *args))
        return out

    def split(self, sp: _Split, k: int) -> dict[str, Any]:
        """The record of split ``k`` (the test split, ``k == 0``, with ``accuracy_classes`` where asked)."""
        record, correct, labels = self.scored(sp, k)
        ev = self.ev
        if k == 0 and ev.per_class:
            record["accuracy_classes"] = class_accuracy(correct, labels, ev.data.num_classes)
        return record

    def scored(self, sp: _Split, k: int) -> tuple[dict[str, Any], Tensor, Tensor]:
        """The record of split ``k`` (the global protocol when ``sp.idx`` is None, else per client), with the
        primary head's per-sample correctness and the labels it was scored against."""
        x, y, client_idx, to_float = sp.x, sp.y, sp.idx, sp.to_float
        if client_idx is None:
            s = self.score(None, x, y, to_float)
            heads = list(s.correct)
            record = summarize(
                {h: c.double().mean().view(1) for h, c in s.correct.items()}, float(s.loss.mean()), heads
            )
            return record, s.correct[heads[0]], y
        n = len(client_idx)
        sizes = torch.tensor([len(i) for i in client_idx], device=x.device)
        if not bool((sizes > 0).any()):  # no client has samples: nothing to score
            zero = torch.zeros(n, dtype=torch.float64)
            record = client_summary({"logits": zero}, zero, sizes.cpu(), ["logits"])
            return record, torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long)
        seg = torch.repeat_interleave(torch.arange(n, device=x.device), sizes)
        if self.personal is not None:  # a client without samples adds none (and is not scored)
            parts = self.personal[k]
            correct = {h: torch.cat([p.correct[h] for p in parts]) for h in parts[0].correct}
            loss = torch.cat([p.loss for p in parts])
        else:  # one shared model: score each distinct test sample once, then gather per client
            uniq, inverse = torch.unique(torch.cat(client_idx), return_inverse=True)
            s = self.score(None, x[uniq], y[uniq], to_float)
            correct = {h: c[inverse] for h, c in s.correct.items()}
            loss = s.loss[inverse]
        sums = {h: segment_sum(c, seg, n) for h, c in correct.items()}
        record = client_summary(sums, segment_sum(loss, seg, n), sizes, list(correct))
        return record, next(iter(correct.values())), y[torch.cat(client_idx)]  # in client order, as scored
