"""The security of a federation: attacks of malicious clients (simulation only), robust aggregation and
client-level differential privacy, around any algorithm whose aggregation is a mean of uploads
(docs/security.md)."""

from fedskew.algorithms.security.rules import ATTACKS, DEFENCES, AttackRule, DefenceRule

__all__ = ["ATTACKS", "DEFENCES", "AttackRule", "DefenceRule"]
