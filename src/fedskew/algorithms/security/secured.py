"""An algorithm under a threat model: malicious clients, robust aggregation, client-level DP.

:func:`secured` derives from a registered algorithm class a subclass that keeps every hook and capability
of the method and adds, as declared by a :class:`~fedskew.algorithms.security.config.SecurityPlan`:

* on the clients (every runtime: the embedded engine and Flower nodes build the same class):
  data poisoning of the malicious clients' batches in ``local_loss`` (``label_flip``, ``backdoor``; the
  flag travels in ``derived``, so the loss stays vmappable), and the local DP variant in ``finish_local``
  (the client clips its update to C and adds N(0, (z·2C)²) itself);
* on the server, in place of the method's mean (``Algorithm.mean_aggregation``: the method's
  ``server_step`` then runs on what replaced it, so it composes with server optimizers):
  model-poisoning of the malicious uploads (``sign_flip``, ``gaussian``, ``scaling``, ``alie``; a
  simulation shortcut with the same effect as the client sending it), then either a robust rule
  (:mod:`~fedskew.algorithms.security.robust`) or central DP-FedAvg (McMahan et al. 2018, Alg. 1):
  each update clipped to C, the sum of the clipped updates plus N(0, (z·2C)² I) divided by the fixed
  m, with adaptive quantile clipping (Andrew et al. 2021, Alg. 1) as an option.

Attacks and defences are the entries of :data:`~fedskew.algorithms.security.rules.ATTACKS` and
:data:`~fedskew.algorithms.security.rules.DEFENCES`. Updates are the uploads' floating arrays minus what
the server broadcast for them (the global model for ``model.*`` entries, 0 for arrays it does not send,
e.g. SCAFFOLD's control-variate changes). A robust rule that *selects* (Krum, Multi-Krum) or bounds
(norm_bound) leaves uploads for the method's own weighted mean; a rule that *computes* a value (median,
trimmed mean, Bulyan, geometric median) and central DP give the mean itself (the reference plus that value),
so the method's server step sees exactly the rule's output. Where the server changes uploads the derived
class does not declare ``mean_aggregation`` (the engine cannot fold a mean it does not compute).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import torch
from torch import Tensor

from fedskew.algorithms.base import (
    Algorithm,
    Batch,
    LocalOutput,
    LocalPlan,
    LocalResult,
    LocalStep,
    MeanInfo,
    Payload,
    RoundInfo,
    ServerUpdate,
    State,
    Upload,
    receipt,
    weighted_average,
)
from fedskew.algorithms.security import robust
from fedskew.algorithms.security.config import NOT_PRIVATE, SecurityPlan, count_noise
from fedskew.algorithms.security.randomness import secret_normal
from fedskew.algorithms.security.rules import ATTACKS, DEFENCES, DefenceInput, poisons_data, tolerance
from fedskew.algorithms.steps import RoundSkipped
from fedskew.errors import RunFailure

MALICIOUS = "security.malicious"  # the derived flag of a malicious client (0-d float tensor)
CLIP_KEY = "dp_clip"  # server state: the current clip norm (adaptive clipping)
_NOISE_KEY, _ATTACK_KEY, _COUNT_KEY = 0xD9, 0xA7, 0xC0
log = logging.getLogger(__name__)

#: what a DP run's records carry: the (noised) global model scored on the server's test set, traffic and
#: timing fixed by the model's shapes and the sample, the accounting and the clip norm (a function of the
#: noisy count under adaptive clipping). Everything else (training loss, the unclipped share, validation
#: scores on client samples, method scalars) is a statistic of client data no noise covers: withheld.
DP_RELEASED = frozenset(
    {"round", "accuracy", "loss", "epsilon", "epsilon_rdp", "epsilon_pld", "dp_clip", "bytes_up",
     "bytes_down", "round_bytes_up", "round_bytes_down", "round_params_up", "round_params_down", "seconds",
     "seconds_train", "seconds_eval", "skipped", "dropped"}
)  # fmt: skip
#: per-head accuracies of the global model on the server's test set (``accuracy_<head>``, its ``_std``)
_DP_RELEASED_PREFIX = "accuracy_"
_DP_WITHHELD_PREFIXES = ("accuracy_clients", "accuracy_weighted")


def dp_released(record: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A DP run's record reduced to ``DP_RELEASED`` (and the global model's per-head accuracies), and the
    keys withheld."""

    def kept(key: str) -> bool:
        if key in DP_RELEASED:
            return True
        return key.startswith(_DP_RELEASED_PREFIX) and not key.startswith(_DP_WITHHELD_PREFIXES)

    return {k: v for k, v in record.items() if kept(k)}, sorted(k for k in record if not kept(k))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How uploads flatten: the floating array names (sorted), their shapes and the reference values."""

    keys: list[str]
    shapes: list[torch.Size]
    reference: Tensor  # [d]

    @classmethod
    def of(cls, upload: Upload, broadcast: Payload) -> Layout:
        keys = sorted(k for k, v in upload.payload.arrays.items() if v.is_floating_point())
        arrays = upload.payload.arrays
        refs = [broadcast.arrays.get(k, torch.zeros_like(arrays[k])).reshape(-1) for k in keys]
        ref = (
            torch.cat([r.to(arrays[k].dtype) for r, k in zip(refs, keys, strict=True)])
            if keys
            else torch.zeros(0)
        )
        return cls(keys, [arrays[k].shape for k in keys], ref)

    def deltas(self, uploads: list[Upload]) -> Tensor:
        """``[n, d]``: each upload's arrays minus the reference."""
        rows = [torch.cat([u.payload.arrays[k].reshape(-1) for k in self.keys]) for u in uploads]
        return torch.stack(rows) - self.reference

    def with_delta(
        self, upload: Upload, delta: Tensor, num_samples: int | None = None, public: Payload | None = None
    ) -> Upload:
        """A new upload whose floating arrays are ``reference + delta`` (other arrays and config kept; with
        ``public``, its non-floating arrays are ``public``'s: integer buffers such as BatchNorm's batch
        counts are statistics of client data that DP does not noise)."""
        arrays = dict(upload.payload.arrays) if public is None else public_integers(upload.payload, public)
        flat, start = self.reference + delta, 0
        for k, shape in zip(self.keys, self.shapes, strict=True):
            size = shape.numel()
            arrays[k] = flat[start : start + size].reshape(shape)
            start += size
        payload = Payload(arrays, dict(upload.payload.config), dict(upload.payload.metrics))
        n = upload.num_samples if num_samples is None else num_samples
        return Upload(upload.cid, n, payload)


@functools.lru_cache(maxsize=8)  # one line per process and set of keys, not one per round
def _announce_withheld(keys: tuple[str, ...]) -> None:
    what = "privacy: withheld from the records (client-data statistics no noise covers)"
    log.info("%s: %s", what, ", ".join(keys))


def public_integers(upload: Payload, broadcast: Payload) -> dict[str, Tensor]:
    """``upload``'s arrays with each non-floating one replaced by the broadcast's (zeros where the server
    sent none)."""
    arrays = dict(upload.arrays)
    for k, v in upload.arrays.items():
        if not v.is_floating_point():
            sent = broadcast.arrays.get(k)
            arrays[k] = torch.zeros_like(v) if sent is None else sent.to(v.device, v.dtype)
    return arrays


class TooFewUploads(RunFailure):
    """``defence.too_few: fail``: a round's accepted uploads are fewer than its robust rule needs for its f;
    the round fails (nothing of it is committed, ``--resume`` continues from the last committed round)."""


def check_cohort(plan: SecurityPlan, uploads: list[Upload], round_idx: int) -> dict[str, float]:
    """A robust rule's assumptions checked against the round's accepted uploads (after drops, rejections and
    the virtual clock), not only against the configured m: with fewer than a·f + b uploads the round is
    skipped (:class:`RoundSkipped`) or fails (:class:`TooFewUploads`), as ``defence.too_few`` says. The
    simulation knows the attackers: where the round's malicious uploads exceed what the rule tolerates,
    one warning line and the record's ``attackers_over_f`` / ``attackers`` (docs/decisions.md, issue 51
    item 5)."""
    d, f, n = plan.defence, plan.byzantine, len(uploads)
    condition = DEFENCES.get(d.name).byzantine
    if condition is not None and n < condition[0] * f + condition[1]:
        a, b = condition
        what = f"defence.name={d.name} needs {a * f + b} uploads ({a}f + {b}, f = {f}), the round has {n}"
        if d.too_few == "fail":
            raise TooFewUploads(
                f"round {round_idx}: {what}; the round was not committed (defence.too_few=fail; allowed: "
                "skip, fail)"
            )
        raise RoundSkipped(f"{what} (defence.too_few=skip)")
    tolerated = tolerance(d, f, n)
    attackers = sum(plan.is_malicious(u.cid) for u in uploads)
    if plan.attack.name == "none" or tolerated is None or attackers <= tolerated:
        return {}
    log.warning(
        "round %d: %d malicious uploads of %d exceed the %d defence.name=%s tolerates (simulation: the "
        "attackers are known)", round_idx, attackers, n, tolerated, d.name,
    )  # fmt: skip
    return {"attackers_over_f": True, "attackers": attackers}


class SecuredAlgorithm(Algorithm):
    """The hooks :func:`secured` adds in front of a method (it is mixed in before the method's class)."""

    security: SecurityPlan

    # ------------------------------------------------------------------ clients
    def start_local(self, step: LocalStep) -> LocalPlan:
        plan = super().start_local(step)
        if not poisons_data(self.security.attack):
            return plan
        flag = torch.tensor(float(self.security.is_malicious(step.client.cid)), device=step.client.y.device)
        return dataclasses.replace(plan, derived={**plan.derived, MALICIOUS: flag})

    def local_loss(self, step: LocalStep, batch: Batch) -> Tensor:
        attack = self.security.attack
        poison = ATTACKS.get(attack.name).batch
        if poison is not None:
            batch = poison(batch, attack, step.derived[MALICIOUS], self.ctx.num_classes)
        return super().local_loss(step, batch)

    def finish_local(self, step: LocalStep, result: LocalResult) -> LocalOutput:
        out = super().finish_local(step, result)
        privacy = self.security.privacy
        if privacy.mechanism != "local":
            return out
        upload = Upload(step.client.cid, step.client.num_samples, out.upload)
        layout = Layout.of(upload, step.payload)
        clipped, _ = robust.clip_rows(layout.deltas([upload]), privacy.clip)
        noise = self._noise(clipped.shape[1], clipped, step.info, _NOISE_KEY)
        noisy = clipped[0] + self.security.noise * self.security.sensitivity_factor * privacy.clip * noise
        sent = layout.with_delta(upload, noisy, public=step.payload).payload
        # the server is not trusted: nothing but the noised arrays leaves (no method scalars, no loss)
        return dataclasses.replace(out, upload=Payload(sent.arrays))

    def _noise(self, n: int, like: Tensor, info: RoundInfo, key: int) -> Tensor:
        """``n`` N(0, 1) draws: secret (the OS's cryptographic source, stored nowhere) unless the run asked
        for ``privacy.randomness: reproducible`` (seed-derived: not private)."""
        if self.security.privacy.randomness == "secret":
            return secret_normal(n, like.dtype, like.device)
        return torch.randn(n, generator=info.generator(key), dtype=like.dtype).to(like.device)

    def released(self, record: dict[str, Any]) -> dict[str, Any]:
        record = super().released(record)
        if self.security.privacy.mechanism == "none":
            return record
        kept, withheld = dp_released(record)
        if withheld:
            _announce_withheld(tuple(withheld))
        return kept

    def run_summary(self) -> dict[str, Any]:
        summary = super().run_summary()
        if self.security.privacy.mechanism == "none":
            return summary
        return {**summary, "privacy": self.security.accounting()}

    # ------------------------------------------------------------------ server
    def init_server(self, model: Any) -> State:
        server = super().init_server(model)
        if self.security.privacy.mechanism != "none" and not self.security.private:
            log.warning("privacy: %s", NOT_PRIVATE)
        if self.security.privacy.adaptive is not None:
            server = {
                **server,
                CLIP_KEY: torch.tensor(float(self.security.privacy.clip), dtype=torch.float64),
            }
        return server

    def aggregate(self, server: State, uploads: list[Upload], info: RoundInfo) -> ServerUpdate:
        """The method's aggregation, with the mean replaced where the plan touches uploads: poisoned
        updates, then a defence or central DP, then the method's :meth:`server_step` on the result."""
        plan = self.security
        # self-reported sample counts are not trusted under local DP nor by a robust rule (one node's
        # claimed count would otherwise decide the geometric median, or the mean after Krum): uniform
        if plan.privacy.mechanism == "local" or DEFENCES.get(plan.defence.name).apply is not None:
            uploads = [dataclasses.replace(u, num_samples=1) for u in uploads]
        if not plan.touches_uploads or not uploads:
            return super().aggregate(server, uploads, info)
        metrics = check_cohort(plan, uploads, info.round)  # may skip or fail the round (defence.too_few)
        broadcast = self.broadcast(server, RoundInfo(info.round, None, info.seed))
        layout = Layout.of(uploads[0], broadcast)
        deltas = self._poison(layout.deltas(uploads), uploads, info)
        uploads = [
            layout.with_delta(u, row) if plan.is_malicious(u.cid) else u
            for u, row in zip(uploads, deltas, strict=True)
        ]
        if plan.privacy.mechanism == "central":
            uploads = [dataclasses.replace(u, num_samples=1) for u in uploads]
            value, clip = self._central_dp(server, deltas, uploads, info, metrics)
            server = {**server, CLIP_KEY: clip} if CLIP_KEY in server else server
            mean = self._mean_of(uploads, layout, value, broadcast)
        else:
            counts = torch.tensor([float(u.num_samples) for u in uploads], dtype=torch.float64)
            x = DefenceInput(deltas, uploads, counts, plan.byzantine, layout.with_delta, metrics)
            rule = DEFENCES.get(plan.defence.name).apply
            out = rule(plan.defence, x) if rule is not None else None
            uploads = uploads if out is None or out.uploads is None else out.uploads
            mean = self._mean_of(uploads, layout, None if out is None else out.value, None)
        weights = self.mean_weights([u.num_samples for u in uploads])
        update = self.server_step(server, mean, MeanInfo(info, [receipt(u) for u in uploads], weights))
        update = dataclasses.replace(update, metrics={**update.metrics, **metrics})
        if CLIP_KEY in server:
            update = dataclasses.replace(update, state={**update.state, CLIP_KEY: server[CLIP_KEY]})
        return update

    def _mean_of(
        self, uploads: list[Upload], layout: Layout, value: Tensor | None, public: Payload | None
    ) -> Payload:
        """The method's weighted mean of ``uploads``; with ``value``, its floating arrays are the reference
        plus ``value`` (and, with ``public``, its integer arrays the broadcast's)."""
        weights = self.mean_weights([u.num_samples for u in uploads])
        mean = Payload(arrays=weighted_average([u.payload.arrays for u in uploads], weights))
        if value is None:
            return mean
        return Payload(layout.with_delta(Upload(-1, 0, mean), value, public=public).payload.arrays)

    def server_step(self, server: State, mean: Payload, info: MeanInfo) -> ServerUpdate:
        return self._with_privacy_metrics(super().server_step(server, mean, info), info.round)

    def _with_privacy_metrics(self, update: ServerUpdate, info: RoundInfo) -> ServerUpdate:
        eps = self.security.epsilons
        if not eps:
            return update
        return dataclasses.replace(
            update, metrics={**update.metrics, "epsilon": eps[min(info.round, len(eps)) - 1]}
        )

    def _poison(self, deltas: Tensor, uploads: list[Upload], info: RoundInfo) -> Tensor:
        """The malicious clients' updates replaced as their attack says (simulation shortcut)."""
        plan, attack = self.security, self.security.attack
        bad = [i for i, u in enumerate(uploads) if plan.is_malicious(u.cid)]
        poison = ATTACKS.get(attack.name).updates
        if poison is None or not bad:
            return deltas
        gens = [RoundInfo(info.round, uploads[i].cid, info.seed).generator(_ATTACK_KEY) for i in bad]
        out = deltas.clone()
        out[bad] = poison(deltas[bad], attack, len(uploads), gens)
        return out

    def _central_dp(
        self,
        server: State,
        deltas: Tensor,
        uploads: list[Upload],
        info: RoundInfo,
        metrics: dict[str, float],
    ) -> tuple[Tensor, Tensor]:
        """DP-FedAvg: (Σ clip_C(Δ_k) + N(0, (z·S·C)²)) / m, S = 2 (replace-one) or 1 (add/remove), m the
        fixed (expected, under Poisson sampling) clients per round: the update that replaces the mean (whose
        integer arrays are the broadcast's); with adaptive clipping the next C from the noisy share of
        unclipped updates (Andrew et al. Alg. 1)."""
        plan, privacy = self.security, self.security.privacy
        clip = (
            server[CLIP_KEY] if CLIP_KEY in server else torch.tensor(float(privacy.clip), dtype=torch.float64)
        )
        c = float(clip)
        clipped, within = robust.clip_rows(deltas, c)
        noise = self._noise(clipped.shape[1], clipped, info, _NOISE_KEY)
        value = (clipped.sum(0) + plan.noise * plan.sensitivity_factor * c * noise) / plan.per_round
        metrics.update(dp_clip=c, dp_unclipped=float(within.sum()) / len(uploads))
        if privacy.adaptive is not None:
            ad, m = privacy.adaptive, plan.per_round
            draw = float(self._noise(1, clipped, info, _COUNT_KEY)[0])
            noisy = float(within.sum()) + count_noise(ad, m) * draw
            share = noisy / m
            clip = clip * math.exp(-ad.lr * (share - ad.quantile))  # Andrew et al. Eq. (3): C ← C·e^{−η(b̃−γ)}
        return value, clip


def secured(algorithm_cls: type[Algorithm], plan: SecurityPlan) -> type[Algorithm]:
    """``algorithm_cls`` under ``plan`` (itself when the plan does nothing): a subclass with the same name,
    parameters and capabilities; a data attack adds ``derived`` to what its vmapped loss reads."""
    if not plan.active:
        return algorithm_cls
    attrs: dict[str, Any] = {"security": plan, "__module__": __name__, "name": algorithm_cls.name}
    if plan.privacy.mechanism != "none":  # no sample counts, no losses: the mechanism needs neither, and
        attrs["discloses_client_statistics"] = False  # under local DP the server is not trusted
    if plan.touches_uploads:  # the server replaces the mean: the engine cannot fold it
        attrs["mean_aggregation"] = False
    if poisons_data(plan.attack):
        attrs["loss_reads"] = algorithm_cls.loss_reads | {"derived"}
    return type(f"Secured{algorithm_cls.__name__}", (SecuredAlgorithm, algorithm_cls), attrs)
