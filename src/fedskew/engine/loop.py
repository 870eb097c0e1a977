"""The round loop. Algorithms never write it; every algorithm runs through this one.

One :class:`Simulation` holds the federated data as tensors on the training device, one reusable model
instance per architecture, the server state, and per-client state on CPU. A round: sample (pre-drawn
stream), broadcast, local training (the engine's optimizer over the algorithm's loss), upload (non-finite
updates rejected), aggregate, and evaluate by the configured protocol every ``eval.every`` rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedskew.algorithms.base import (
    Algorithm,
    ClientConfig,
    ClientView,
    Context,
    HyperParams,
    State,
    Upload,
)
from fedskew.data.federated import FederatedData
from fedskew.engine.evaluation import HeadScores, score, segment_mean, summarize
from fedskew.engine.local import NonFiniteLoss, run_phases
from fedskew.engine.sampling import derive_seed, sampling_schedule
from fedskew.engine.vectorized import NotVectorizable, train_vectorized, unsupported_reason
from fedskew.engine.workers import WorkerPool, pool_supported
from fedskew.errors import ConfigError
from fedskew.seeding import seed_torch

log = logging.getLogger("fedskew.engine")

PROTOCOLS = ("global", "personalized")
INIT_KEY = 0xC0FFEE  # seed key of the initial model
#: engine.mode=auto trains vectorized up to this many parameters and this batch size (issue 8 measurements)
AUTO_VECTOR_MAX_PARAMS, AUTO_VECTOR_MAX_BATCH = 100_000, 16
#: engine.mode=auto uses workers only when a client's round is at least this many samples x epochs
AUTO_WORKERS_MIN_SAMPLES = 256
#: default evaluation batch per device type: on a CPU, 128 images keep a CNN's activations in cache (a 10k
#: MNIST evaluation of cnn_mnist took 3.7 s at 1024 and 1.6 s at 128, issue 8); a GPU wants large batches
EVAL_BATCH = {"cpu": 128}
EVAL_BATCH_OTHER = 1024
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")


@dataclass
class EvalSettings:
    protocol: str = "global"
    every: int = 1
    batch_size: int | None = None  # None: EVAL_BATCH[device type]


@dataclass
class RoundTimes:
    train: float = 0.0
    aggregate: float = 0.0
    evaluate: float = 0.0


@dataclass
class ClientOutcome:
    cid: int
    bytes_down: int
    params_down: int = 0
    upload: Upload | None = None  # None: rejected
    state: State | None = None  # the client's new state (CPU), committed with the round
    loss: float = float("nan")


@dataclass
class RoundOutcome:
    round: int
    record: dict[str, Any] | None  # metrics record when the round was evaluated
    rejected: list[int] = field(default_factory=list)


def _identity(x: Tensor) -> Tensor:
    return x


def tree_to(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor in a nested dict / list structure to ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: tree_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_to(v, device) for v in obj)
    return obj


class Simulation:
    """An embedded, single-process federation for one algorithm and one seed."""

    def __init__(
        self,
        data: FederatedData,
        algorithm_cls: type[Algorithm],
        params: HyperParams,
        build_model: Callable[[int | None], nn.Module],
        client: ClientConfig,
        evaluation: EvalSettings,
        rounds: int,
        seed: int,
        device: str = "cpu",
        arch_key: Callable[[int | None], Hashable] = lambda cid: None,
        workers: int = 1,
        mode: str = "auto",
        memory_mb: float = 1024.0,
        memory_format: str = "auto",
    ) -> None:
        if evaluation.protocol not in PROTOCOLS:
            raise ConfigError(f"eval.protocol '{evaluation.protocol}' unknown; valid: {', '.join(PROTOCOLS)}")
        if memory_format not in MEMORY_FORMATS:
            raise ConfigError(
                f"engine.memory_format '{memory_format}' unknown; valid: {', '.join(MEMORY_FORMATS)}"
            )
        self.device = torch.device(device)
        self.data = data
        self.client_cfg = client
        if evaluation.batch_size is None:
            evaluation = replace(evaluation, batch_size=EVAL_BATCH.get(self.device.type, EVAL_BATCH_OTHER))
        self.eval = evaluation
        self.rounds = rounds
        self.seed = seed
        self._raw_build_model = build_model
        self.memory_format = memory_format
        self.mode = mode
        self._arch_key = arch_key
        self._models: dict[Hashable, nn.Module] = {}

        ds = data.dataset
        # Training inputs are normalised once and held on the device; clients are index views.
        self.x_train = ds.to_float(ds.x_train).to(self.device)
        self.y_train = ds.y_train.to(self.device)
        self.x_test = ds.x_test.to(self.device)  # raw; converted per evaluation batch
        self.y_test = ds.y_test.to(self.device)
        self.train_idx = [t.to(self.device) for t in data.train_idx]
        self.test_idx = [t.to(self.device) for t in data.test_idx]
        self.val_idx = [t.to(self.device) for t in (data.val_idx or [])]
        self.class_counts = data.class_counts()
        self.num_clients = len(data.train_idx)

        ctx = Context(
            num_clients=self.num_clients,
            num_classes=ds.num_classes,
            in_shape=ds.in_shape,
            device=self.device,
            client=client,
            client_sizes=self.class_counts.sum(1),
            class_counts=self.class_counts,
            rounds=rounds,
            seed=seed,
            build_model=self._build_model,
            initial_model=self._initial_model,
        )
        self.algorithm = algorithm_cls(params, ctx)
        torch.manual_seed(derive_seed(seed, INIT_KEY))  # same initial model for every algorithm
        init_model = self.model_for(None)
        self.server: State = self.algorithm.init_server(init_model)
        self.client_states: dict[int, State] = {}
        self.schedule = sampling_schedule(self.num_clients, client.fraction, rounds, seed)
        self.round = 0
        self.history: list[dict[str, Any]] = []
        self.bytes_up = 0
        self.bytes_down = 0
        self.times = RoundTimes()
        self.workers = workers
        self.memory_mb = memory_mb
        self._pool: WorkerPool | None = None
        self._resolved: str | None = None  # the execution mode, decided on the first round

    # ------------------------------------------------------------------ models and state
    def _initial_model(self, cid: int | None) -> nn.Module:
        """A new model of ``cid``'s architecture with the run's initial weights: built from the seed of the
        global initial model, so a client whose architecture matches starts from exactly that model."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, INIT_KEY))
            return self._build_model(cid)

    def model_for(self, cid: int | None) -> nn.Module:
        """The reusable model instance for ``cid``'s architecture (built once)."""
        key = self._arch_key(cid)
        if key not in self._models:
            self._models[key] = self._build_model(cid)
        return self._models[key]

    def _build_model(self, cid: int | None) -> nn.Module:
        """A new model for ``cid`` on the device, in the engine's memory format: ``channels_last`` (NHWC)
        convolutions ran 1.1-1.6x faster than NCHW on CPU in issue 8's measurements, so ``auto`` uses it for
        2-d convolutional models on CPU outside the vectorized mode. Values are unchanged; only the layout
        (and so the order of floating-point sums) differs."""
        model = self._raw_build_model(cid).to(self.device)
        fmt = self.memory_format
        if fmt == "auto":
            conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
            cpu_loop = self.device.type == "cpu" and self.mode != "vectorized"
            fmt = "channels_last" if conv and cpu_loop else "contiguous"
        if fmt == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        return model

    def client_state(self, cid: int) -> State:
        if cid not in self.client_states:
            self.client_states[cid] = tree_to(self.algorithm.init_client(cid, self.server), "cpu")
        return self.client_states[cid]

    def client_view(self, cid: int) -> ClientView:
        idx = self.train_idx[cid]
        return ClientView(
            cid=cid, x=self.x_train[idx], y=self.y_train[idx], class_counts=self.class_counts[cid]
        )

    # ------------------------------------------------------------------ one round
    def train_client(self, cid: int, round_idx: int) -> ClientOutcome:
        """Local training of one client in round ``round_idx``; commits nothing to the simulation."""
        alg = self.algorithm
        payload = alg.broadcast(self.server, cid)
        state = tree_to(self.client_state(cid), self.device)
        model = self.model_for(cid)
        view = self.client_view(cid)
        seed = derive_seed(self.seed, round_idx, cid)
        seed_torch(seed, self.device)  # dropout and any in-loss sampling: order-independent
        gen = torch.Generator().manual_seed(seed)
        scratch: dict = {}
        out = ClientOutcome(cid=cid, bytes_down=payload.nbytes(), params_down=payload.num_params())
        try:
            phases = alg.start_local(model, payload, state, view)
            scratch.update(alg.init_scratch(model, payload, state, view))
            decay = self.client_cfg.lr_decay ** (round_idx - 1)
            cfg = self.client_cfg
            result = run_phases(model, alg, payload, state, view, phases, cfg, gen, scratch, decay)
            upload = alg.finish_local(model, payload, state, view, scratch, result)
        except NonFiniteLoss as err:
            log.warning("round %d: rejected update: %s", round_idx, err)
            return out
        if not upload.is_finite():
            log.warning("round %d: rejected update of client %d: non-finite values", round_idx, cid)
            return out
        out.upload = Upload(cid=cid, num_samples=view.num_samples, payload=upload)
        out.state = tree_to(state, "cpu")
        out.loss = result.loss
        return out

    def _resolve_mode(self, cids: list[int]) -> str:
        """``vectorized``, ``vectorized+workers`` (a vmapped group of clients per worker process),
        ``workers`` or ``sequential`` from ``engine.mode``, ``engine.workers`` and the workload; the choice
        and the reason are logged."""
        model = self.model_for(cids[0])
        vec_reason = unsupported_reason(self, model)
        params = sum(p.numel() for p in model.parameters())
        dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
        if self.mode == "vectorized" and vec_reason is not None:
            log.warning("engine.mode=vectorized: %s", vec_reason)
        # auto: the measured rule of issue 8 (vmap wins on small models at small batches and loses on large
        # convolutions), and only where it reproduces the sequential loop's numbers (no dropout stream)
        small = params <= AUTO_VECTOR_MAX_PARAMS and self.client_cfg.batch_size <= AUTO_VECTOR_MAX_BATCH
        if vec_reason is None and (
            self.mode == "vectorized" or (self.mode == "auto" and small and not dropout)
        ):
            choice, why = "vectorized", f"{params:,} parameters, batch {self.client_cfg.batch_size}"
            if self.workers > 1 and pool_supported(self) is None:  # a group of clients per worker
                choice, why = "vectorized+workers", f"{why}, {self.workers} processes"
        elif (
            self.workers > 1
            and (pool_reason := pool_supported(self)) is None
            and (self.mode != "auto" or self._client_work(cids) >= AUTO_WORKERS_MIN_SAMPLES)
        ):
            choice, why = "workers", f"{self.workers} processes"
        else:
            reasons = [r for r in (vec_reason, pool_reason if self.workers > 1 else None) if r]
            if self.workers > 1 and not reasons:
                reasons = [f"clients too small for workers (< {AUTO_WORKERS_MIN_SAMPLES} samples x epochs)"]
            choice, why = "sequential", "; ".join(reasons) or "engine.workers=1"
        log.info("engine.mode=%s: training clients %s (%s)", self.mode, choice, why)
        return choice

    def _client_work(self, cids: list[int]) -> float:
        """Mean samples × epochs per sampled client: below a few hundred, a worker task costs more to ship
        than to run (W3: 60-sample clients ran 1.8x slower in workers than in-process)."""
        sizes = [self.train_idx[c].numel() for c in cids]
        return float(np.mean(sizes)) * self.client_cfg.epochs

    def _train_clients(self, cids: list[int], round_idx: int) -> list[ClientOutcome]:
        """Local training of the round's clients: in-process, vectorized, or over forked workers."""
        if self._resolved is None and cids:
            self._resolved = self._resolve_mode(cids)
        vectorized = self._resolved in ("vectorized", "vectorized+workers")
        if vectorized and len(cids) > 1 and (self._resolved == "vectorized" or len(cids) < 2 * self.workers):
            return self._train_vectorized(cids, round_idx)
        if self._resolved in ("workers", "vectorized+workers") and len(cids) > 1:
            if self._pool is None:
                self._pool = WorkerPool(self, min(self.workers, self.num_clients))
            size = lambda cid: float(self.train_idx[cid].numel())  # noqa: E731
            try:
                return self._pool.train(self, cids, round_idx, size, vectorized=vectorized)
            except BaseException:  # failed or interrupted mid-round: the workers' tasks are abandoned
                self._pool.close(terminate=True)
                self._pool = None
                raise
        return [self.train_client(cid, round_idx) for cid in cids]

    def _train_vectorized(self, cids: list[int], round_idx: int) -> list[ClientOutcome]:
        groups: dict[Hashable, list[int]] = {}
        for cid in cids:
            groups.setdefault(self._arch_key(cid), []).append(cid)
        done: dict[int, ClientOutcome] = {}
        for members in groups.values():
            try:
                outs = train_vectorized(self, members, round_idx)
            except NotVectorizable as err:
                log.warning("round %d: %s; these clients train sequentially", round_idx, err)
                outs = [self.train_client(cid, round_idx) for cid in members]
            done.update((o.cid, o) for o in outs)
        return [done[c] for c in cids]

    def close(self) -> None:
        """Release the worker processes, if any (the simulation stays usable, in-process)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def run_round(self) -> RoundOutcome:
        """Run the next round; evaluates when ``round % eval.every == 0`` or at the last round.

        Transactional: the simulation's round, server, client states and counters change only once the
        round is complete, so an interrupt mid-round leaves a consistent state to checkpoint.
        """
        r = self.round + 1
        t0 = time.perf_counter()
        outcomes = self._train_clients(self.schedule[r - 1].tolist(), r)
        uploads = [o.upload for o in outcomes if o.upload is not None]
        t1 = time.perf_counter()
        server = self.algorithm.aggregate(self.server, uploads, r) if uploads else self.server
        t2 = time.perf_counter()
        # commit
        self.server, self.round = server, r
        for o in outcomes:
            if o.state is not None:
                self.client_states[o.cid] = o.state
        round_up = sum(u.payload.nbytes() for u in uploads)
        round_down = sum(o.bytes_down for o in outcomes)
        self.bytes_up += round_up
        self.bytes_down += round_down
        rejected = [o.cid for o in outcomes if o.upload is None]
        record = None
        if r % self.eval.every == 0 or r == self.rounds:
            losses = [o.loss for o in outcomes if o.upload is not None]
            record = {"round": r, **self.evaluate()}
            record.update(
                train_loss=float(np.mean(losses)) if losses else float("nan"),
                bytes_up=self.bytes_up,
                bytes_down=self.bytes_down,
                round_bytes_up=round_up,
                round_bytes_down=round_down,
                round_params_up=sum(u.payload.num_params() for u in uploads),
                round_params_down=sum(o.params_down for o in outcomes),
                rejected=len(rejected),
            )
            record.update(self.algorithm.round_metrics(self.server))
        t3 = time.perf_counter()
        self.times.train += t1 - t0
        self.times.aggregate += t2 - t1
        self.times.evaluate += t3 - t2
        if record is not None:
            record.update(seconds=t3 - t0, seconds_train=t1 - t0, seconds_eval=t3 - t2)
            self.history.append(record)
        return RoundOutcome(r, record, rejected)

    # ------------------------------------------------------------------ evaluation
    def _score(
        self, cid: int | None, x: Tensor, y: Tensor, to_float: Callable[[Tensor], Tensor]
    ) -> HeadScores:
        payload = self.algorithm.broadcast(self.server, cid)
        state = None if cid is None else tree_to(self.client_state(cid), self.device)
        model = self.model_for(cid)
        self.algorithm.load_eval(model, payload, state)
        return score(self.algorithm, model, payload, state, x, y, self.eval.batch_size, to_float)

    def _evaluate_split(
        self, x: Tensor, y: Tensor, client_idx: list[Tensor] | None, to_float: Callable[[Tensor], Tensor]
    ) -> dict[str, Any]:
        """``client_idx=None``: the global protocol on ``(x, y)``; else per-client subsets of ``x``."""
        if client_idx is None:
            s = self._score(None, x, y, to_float)
            heads = list(s.correct)
            return summarize(
                {h: c.double().mean().view(1) for h, c in s.correct.items()}, float(s.loss.mean()), heads
            )
        sizes = torch.tensor([len(i) for i in client_idx], device=self.device)
        seg = torch.repeat_interleave(torch.arange(len(client_idx), device=self.device), sizes)
        if self.algorithm.personalized_eval:
            parts = [self._score(cid, x[idx], y[idx], to_float) for cid, idx in enumerate(client_idx)]
            correct = {h: torch.cat([p.correct[h] for p in parts]) for h in parts[0].correct}
            loss = torch.cat([p.loss for p in parts])
        else:  # one shared model: score each distinct test sample once, then gather per client
            uniq, inverse = torch.unique(torch.cat(client_idx), return_inverse=True)
            s = self._score(None, x[uniq], y[uniq], to_float)
            correct = {h: c[inverse] for h, c in s.correct.items()}
            loss = s.loss[inverse]
        n = len(client_idx)
        per_client = {h: segment_mean(c, seg, n) for h, c in correct.items()}
        mean_loss = float(segment_mean(loss, seg, n).mean())
        return summarize(per_client, mean_loss, list(correct), sizes)

    def evaluate(self) -> dict[str, Any]:
        """Metrics of the current server / client states under the configured protocol."""
        per_client = self.eval.protocol == "personalized"
        raw = self.data.dataset.to_float
        out = self._evaluate_split(self.x_test, self.y_test, self.test_idx if per_client else None, raw)
        if sum(len(v) for v in self.val_idx):
            # Validation (for best-round selection, never test) lives in the already-normalised training pool.
            if per_client:
                val = self._evaluate_split(self.x_train, self.y_train, self.val_idx, _identity)
            else:
                idx = torch.cat(self.val_idx)
                val = self._evaluate_split(self.x_train[idx], self.y_train[idx], None, _identity)
            out.update({f"val_{k}": val[k] for k in ("accuracy", "loss")})
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "server": tree_to(self.server, "cpu"),
            "clients": self.client_states,
            "history": self.history,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "times": self.times.__dict__.copy(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.round = int(sd["round"])
        self.server = tree_to(sd["server"], self.device)
        self.client_states = sd["clients"]
        self.history = list(sd["history"])
        self.bytes_up = int(sd["bytes_up"])
        self.bytes_down = int(sd["bytes_down"])
        self.times = RoundTimes(**sd.get("times", {}))
