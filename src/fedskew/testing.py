"""The algorithm contract as a public check: a plugin method is checked like a built-in one.

``check_algorithm("fedavg_slr")`` runs the method on a tiny digits federation and raises
:class:`~fedskew.algorithms.base.ContractError` naming the first rule it breaks:

* a round runs and every upload is accepted, with finite metrics;
* no hook mutates what it was handed: the payload and client state (``train_client``), the server state and
  the uploads (``aggregate``);
* in every engine mode the method claims (sequential; vectorized when ``vectorizable``), ``start_local`` and
  ``init_scratch`` leave the model's weights alone and no client hook mutates its step's payload or state;
* optionally (``resume_dir``), a run interrupted after a checkpoint and resumed gives the uninterrupted
  metrics exactly.

In a pytest suite: ``@pytest.mark.parametrize("name", ["my_method"])`` and ``check_algorithm(name, ...)``.
The package's own suites (tests/test_contract.py, tests/test_contract_rules.py) check the same rules over
every registered method.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from fedskew.algorithms.base import ALGORITHMS, Algorithm, ContractError, LocalStep, RoundInfo

__all__ = ["check_algorithm", "checked", "contract_config", "fingerprint"]

#: each algorithm object's fingerprint when a hook first saw it: hooks must never change it
_REFERENCE: weakref.WeakKeyDictionary[Algorithm, str] = weakref.WeakKeyDictionary()


def fingerprint(obj: Any) -> str:
    """A hash of a nested structure of tensors and plain values (contents, dtypes and shapes)."""
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, Mapping):
            h.update(b"{")
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                walk(o[k])
            h.update(b"}")
        elif isinstance(o, (list, tuple)):
            h.update(b"[")
            for v in o:
                walk(v)
            h.update(b"]")
        elif hasattr(o, "__dataclass_fields__"):
            walk({k: getattr(o, k) for k in o.__dataclass_fields__})
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()


def contract_config(name: str, rounds: int = 2, **engine: Any) -> dict[str, Any]:
    """The tiny digits federation the checks run ``name`` on (6 clients, Dirichlet(0.5), a small MLP)."""
    alg = ALGORITHMS.get(name)
    cfg: dict[str, Any] = {
        "seed": 0,
        "rounds": rounds,
        "algorithm": {"name": name},
        "data": {"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.67},
        "eval": {"protocol": "personalized" if alg.personalized_eval else "global", "every": 1},
        "engine": {"mode": "sequential", "workers": 1, **engine},
        "checkpoint": {"every": 1},
    }
    return cfg


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, Mapping) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def check_algorithm(
    name: str, *, config: Mapping[str, Any] | None = None, resume_dir: str | Path | None = None
) -> None:
    """Check the registered algorithm ``name`` against the contract (module docstring); ``config``
    overrides keys of :func:`contract_config` (another dataset or model, the method's hyper-parameters);
    ``resume_dir``: also check that an interrupted, resumed run gives the uninterrupted metrics (two runs
    written under it). Raises :class:`ContractError` naming the rule broken."""
    cls = ALGORITHMS.get(name)

    def cfg(rounds: int = 2, **engine: Any) -> Any:
        from fedskew.experiment.config import build_config

        return build_config(_merged(contract_config(name, rounds, **engine), config or {}))

    _check_round(name, cfg(rounds=1))
    _check_no_mutation(name, cfg())
    modes = ["sequential", "vectorized"] if cls.vectorizable else ["sequential"]
    for mode in modes:
        with ALGORITHMS.replaced(name, checked(cls)):
            _check_rounds_accepted(name, cfg(mode=mode), mode)
    if resume_dir is not None:
        _check_resume(name, cfg(rounds=3), Path(resume_dir))


def _check_round(name: str, cfg: Any) -> None:
    from fedskew.experiment.runner import build_simulation

    record = build_simulation(cfg).run_round().record
    if record is None or record["rejected"]:
        raise ContractError(f"{name}: round 1 rejected uploads ({record and record['rejected']})")
    if not (math.isfinite(record["accuracy"]) and math.isfinite(record["loss"])):
        raise ContractError(f"{name}: round 1 gave a non-finite accuracy or loss ({record})")


def _check_no_mutation(name: str, cfg: Any) -> None:
    from fedskew.engine.client import train_client
    from fedskew.experiment.runner import build_simulation

    sim = build_simulation(cfg)
    sim.run_round()  # round 2 sees real prototypes, control variates, personal state ...
    rt, alg, r = cast(Any, sim.executor).runtime, sim.algorithm, 2  # the sequential executor's
    server_print, uploads = fingerprint(sim.server), []
    for cid in sim.schedule[r - 1].tolist():
        state = sim.client_state(cid)
        payload = alg.broadcast(sim.server, RoundInfo(r, cid, sim.seed))
        before = fingerprint(payload), fingerprint(state)
        outcome = train_client(rt, cid, r, payload, state)
        if (fingerprint(payload), fingerprint(state)) != before:
            raise ContractError(
                f"{name}: local training changed the payload or the client state it was handed"
            )
        if outcome.upload is None:
            raise ContractError(f"{name}: client {cid}'s upload was rejected")
        uploads.append(outcome.upload)
    if fingerprint(sim.server) != server_print:
        raise ContractError(f"{name}.broadcast mutated the server state")
    upload_print = fingerprint(uploads)
    alg.aggregate(sim.server, uploads, RoundInfo(r, None, sim.seed))
    if fingerprint(sim.server) != server_print:
        raise ContractError(f"{name}.aggregate mutated the server state")
    if fingerprint(uploads) != upload_print:
        raise ContractError(f"{name}.aggregate mutated the uploads")


def _check_rounds_accepted(name: str, cfg: Any, mode: str) -> None:
    from fedskew.experiment.runner import build_simulation

    sim = build_simulation(cfg)
    try:
        for _ in range(2):
            record = sim.run_round().record
            if record is not None and record["rejected"]:
                raise ContractError(f"{name} ({mode}): {record['rejected']} uploads rejected")
    finally:
        sim.close()


def _check_resume(name: str, cfg: Any, root: Path) -> None:
    from fedskew.experiment.runner import run_experiment

    def stop_after_two(sim: Any, record: Any) -> None:
        if sim.round == 2:
            raise KeyboardInterrupt

    run_experiment(cfg, root / "whole", force=True)
    with contextlib.suppress(KeyboardInterrupt):
        run_experiment(cfg, root / "cut", force=True, on_round=stop_after_two)
    run_experiment(cfg, root / "cut", resume=True)
    if _metrics(root / "cut") != _metrics(root / "whole"):
        raise ContractError(f"{name}: a resumed run's metrics differ from the uninterrupted run's")


def _metrics(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("seconds")} for x in lines]


def _snapshot(step: LocalStep) -> str:
    return fingerprint((step.model.state_dict(), step.payload, step.state))


def _untouched(step: LocalStep, before: str, message: str) -> None:
    if _snapshot(step) != before:
        raise ContractError(message)


def checked(cls: type[Algorithm]) -> type[Algorithm]:
    """``cls`` with the contract's rules asserted around its client hooks (a ContractError, which the engine
    never mistakes for a client's failure)."""

    def own(alg: Algorithm) -> str:
        return fingerprint({k: v for k, v in vars(alg).items() if k not in cls.working_buffers})

    def same_self(alg: Algorithm, hook: str) -> None:
        if _REFERENCE.setdefault(alg, own(alg)) != own(alg):
            raise ContractError(f"{cls.name}.{hook} changed the algorithm object outside working_buffers")

    def inputs(step: LocalStep) -> str:
        return fingerprint((step.payload, step.state))

    class Checked(cls):  # type: ignore[valid-type, misc]
        def start_local(self, step: LocalStep) -> Any:
            same_self(self, "start_local")
            weights, seen = fingerprint(step.model.state_dict()), inputs(step)
            plan = super().start_local(step)
            if fingerprint(step.model.state_dict()) != weights:
                raise ContractError(f"{cls.name}.start_local changed the model's weights")
            if inputs(step) != seen:
                raise ContractError(f"{cls.name}.start_local mutated its payload or state")
            same_self(self, "start_local")
            return plan

        def init_scratch(self, step: LocalStep) -> Any:
            before = _snapshot(step)
            scratch = super().init_scratch(step)
            _untouched(step, before, f"{cls.name}.init_scratch changed the model, its payload or state")
            same_self(self, "init_scratch")
            return scratch

        def finish_local(self, step: LocalStep, result: Any) -> Any:
            same_self(self, "local_loss")  # the losses of this client (and, vectorized, its chunk) ran
            seen = inputs(step)
            out = super().finish_local(step, result)
            if inputs(step) != seen:
                raise ContractError(f"{cls.name}.finish_local mutated its payload or state")
            same_self(self, "finish_local")
            return out

        def adapt_for_eval(self, step: LocalStep) -> Any:
            same_self(self, "adapt_for_eval")
            before = _snapshot(step)
            out = super().adapt_for_eval(step)
            _untouched(step, before, f"{cls.name}.adapt_for_eval changed the model, its payload or state")
            same_self(self, "adapt_for_eval")
            return out

    Checked.__name__ = cls.__name__
    return Checked
