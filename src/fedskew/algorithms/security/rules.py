"""The attacks and defences a config names, as registries: one entry per name, with its checks.

:data:`ATTACKS` maps ``attack.name`` to an :class:`AttackRule` (a data attack poisons a malicious client's
batches, an update attack replaces its update on the server), :data:`DEFENCES` maps ``defence.name`` to a
:class:`DefenceRule` (what replaces the method's mean of the uploads, and the rule's one-line config check).
:func:`~fedskew.algorithms.security.secured.secured` and :mod:`~fedskew.algorithms.security.config` read
only these tables, so a plugin registers an attack or a defence without touching either.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedskew.algorithms.base import Batch, Upload
from fedskew.algorithms.security import attacks, robust
from fedskew.errors import ConfigError
from fedskew.registry import Registry
from fedskew.settings import AttackSection, DefenceSection

#: a malicious client's batch: (batch, attack section, its 0-d malicious flag, number of classes) -> batch
BatchPoison = Callable[[Batch, AttackSection, Tensor, int], Batch]
#: the malicious clients' updates ``[f, d]`` replaced: (their honest updates, attack section, uploads in the
#: round, one generator per malicious client) -> ``[f, d]``
UpdatePoison = Callable[[Tensor, AttackSection, int, list[torch.Generator]], Tensor]


def _no_check(section: object) -> None:
    return None


@dataclass(frozen=True)
class AttackRule:
    """One ``attack.name``: at most one of ``batch`` (data poisoning, on the clients) and ``updates`` (model
    poisoning, on the server: a simulation shortcut with the client's effect)."""

    batch: BatchPoison | None = None
    updates: UpdatePoison | None = None
    check: Callable[[AttackSection], None] = _no_check


@dataclass(frozen=True)
class Defended:
    """What a defence leaves of a round: ``uploads`` for the method's own weighted mean (all, clipped,
    or selected), or ``value``, the update that replaces the mean (median, trimmed mean, ...)."""

    uploads: list[Upload] | None = None
    value: Tensor | None = None


@dataclass(frozen=True)
class DefenceInput:
    """A defence's inputs: the (poisoned) updates ``[n, d]`` and their uploads, the uploads' sample counts
    (float, for weighted rules), the assumed malicious uploads ``f``, ``rebuild(upload, row)`` (an upload
    whose floating arrays are the reference plus ``row``) and the metrics dict the rule may fill."""

    deltas: Tensor
    uploads: list[Upload]
    counts: Tensor
    byzantine: int
    rebuild: Callable[[Upload, Tensor], Upload]
    metrics: dict[str, float]


@dataclass(frozen=True)
class DefenceRule:
    """One ``defence.name``: ``apply`` (``None``: the method's own mean of the uploads as sent),
    ``byzantine`` (``(a, b)``: the rule assumes a fraction of malicious uploads and needs m ≥ a·f + b, in
    the config and in every round), its config ``check`` and, for a rule without ``byzantine`` whose own
    setting bounds the malicious uploads it tolerates, ``tolerates(section, n)`` (trimmed mean: ⌊βn⌋)."""

    apply: Callable[[DefenceSection, DefenceInput], Defended] | None = None
    byzantine: tuple[int, int] | None = None
    check: Callable[[DefenceSection], None] = _no_check
    tolerates: Callable[[DefenceSection, int], int] | None = None


#: ``attack.name`` -> :class:`AttackRule`
ATTACKS: Registry[AttackRule] = Registry("attack")
#: ``defence.name`` -> :class:`DefenceRule`
DEFENCES: Registry[DefenceRule] = Registry("defence")


def _flip(batch: Batch, a: AttackSection, bad: Tensor, num_classes: int) -> Batch:
    return dataclasses.replace(batch, y=attacks.flip_labels(batch.y, num_classes, bad))


def _backdoor(batch: Batch, a: AttackSection, bad: Tensor, num_classes: int) -> Batch:
    x, y = attacks.poison_batch(batch.x, batch.y, bad, a.target, a.trigger_size, a.poison_fraction)
    return dataclasses.replace(batch, x=x, y=y)


def _rows(fn: Callable[[Tensor, AttackSection, torch.Generator], Tensor]) -> UpdatePoison:
    """An update attack applied to each malicious update with its own generator."""

    def poison(honest: Tensor, a: AttackSection, n: int, gens: list[torch.Generator]) -> Tensor:
        return torch.stack([fn(row, a, g) for row, g in zip(honest, gens, strict=True)])

    return poison


def _alie(honest: Tensor, a: AttackSection, n: int, gens: list[torch.Generator]) -> Tensor:
    z = a.z if a.z is not None else attacks.alie_z(n, honest.shape[0])
    return attacks.alie(honest, z).expand_as(honest)


ATTACKS.register("none")(AttackRule())
ATTACKS.register("label_flip")(AttackRule(batch=_flip))
ATTACKS.register("backdoor")(AttackRule(batch=_backdoor))
ATTACKS.register("sign_flip")(AttackRule(updates=_rows(lambda d, a, g: attacks.sign_flip(d, a.scale))))
ATTACKS.register("scaling")(AttackRule(updates=_rows(lambda d, a, g: attacks.scale_update(d, a.scale))))
ATTACKS.register("gaussian")(
    AttackRule(updates=_rows(lambda d, a, g: attacks.gaussian_update(d, a.sigma, g)))
)
ATTACKS.register("alie")(AttackRule(updates=_alie))


def _norm_bound(d: DefenceSection, x: DefenceInput) -> Defended:
    assert d.max_norm is not None
    clipped, within = robust.clip_rows(x.deltas, d.max_norm)
    x.metrics["defence_clipped"] = float((~within).sum())
    return Defended(uploads=[x.rebuild(u, row) for u, row in zip(x.uploads, clipped, strict=True)])


def _krum(select: Callable[[DefenceSection, DefenceInput], int]) -> Callable[..., Defended]:
    def apply(d: DefenceSection, x: DefenceInput) -> Defended:
        n = len(x.uploads)
        chosen = robust.multi_krum(x.deltas, x.byzantine, min(select(d, x), n))
        x.metrics["defence_selected"] = float(len(chosen))
        return Defended(uploads=[x.rebuild(x.uploads[i], x.deltas[i]) for i in sorted(chosen)])

    return apply


def _value(fn: Callable[[DefenceSection, DefenceInput], Tensor]) -> Callable[..., Defended]:
    return lambda d, x: Defended(value=fn(d, x))


def _check_trimmed(d: DefenceSection) -> None:
    if not d.beta < 0.5:
        raise ConfigError(f"defence.beta={d.beta}: trimmed_mean trims less than half; allowed: [0, 0.5)")


def _check_norm(d: DefenceSection) -> None:
    if d.max_norm is None or d.max_norm <= 0:
        raise ConfigError(f"defence.max_norm={d.max_norm}: norm_bound needs a positive bound, e.g. 1.0")


DEFENCES.register("mean")(DefenceRule())
DEFENCES.register("norm_bound")(DefenceRule(_norm_bound, check=_check_norm))
DEFENCES.register("krum")(DefenceRule(_krum(lambda d, x: 1), byzantine=(2, 3)))
DEFENCES.register("multi_krum")(
    DefenceRule(_krum(lambda d, x: d.select or len(x.uploads) - x.byzantine), byzantine=(2, 3))
)
DEFENCES.register("median")(
    DefenceRule(_value(lambda d, x: robust.coordinate_median(x.deltas)), byzantine=(2, 1))
)
DEFENCES.register("trimmed_mean")(
    DefenceRule(
        _value(lambda d, x: robust.trimmed_mean(x.deltas, d.beta)),
        check=_check_trimmed,
        tolerates=lambda d, n: math.floor(d.beta * n),  # the k values trimmed at each end (Yin et al. 2018)
    )
)
DEFENCES.register("bulyan")(
    DefenceRule(_value(lambda d, x: robust.bulyan(x.deltas, x.byzantine)), byzantine=(4, 3))
)
DEFENCES.register("geomed")(
    DefenceRule(
        _value(
            lambda d, x: robust.geometric_median(
                x.deltas, x.counts.to(x.deltas.dtype), eps=d.eps, max_iter=d.max_iter
            )
        )
    )
)


def poisons_updates(attack: AttackSection) -> bool:
    """Whether ``attack`` replaces malicious updates on the server."""
    return ATTACKS.get(attack.name).updates is not None


def poisons_data(attack: AttackSection) -> bool:
    """Whether ``attack`` poisons malicious clients' batches."""
    return ATTACKS.get(attack.name).batch is not None


def replaces_mean(defence: DefenceSection) -> bool:
    """Whether ``defence`` changes the uploads or their mean (``mean``: the method's own)."""
    return DEFENCES.get(defence.name).apply is not None


def tolerance(defence: DefenceSection, byzantine: int, n: int) -> int | None:
    """The malicious uploads ``defence`` tolerates in a round of ``n`` uploads: its assumed f
    (``byzantine``) for a rule with a stated f, ``tolerates`` for one bounded by its own setting, ``None``
    for a rule that states no bound (mean, norm_bound, geomed)."""
    rule = DEFENCES.get(defence.name)
    if rule.byzantine is not None:
        return byzantine
    return None if rule.tolerates is None else rule.tolerates(defence, n)
