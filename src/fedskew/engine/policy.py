"""What happens to a client that fails: one rule, ``engine.on_client_error``, for every runtime.

A client fails in one of three ways: its training **raises** (a bug in this process, a ClientApp that
failed on its node), it produces a **non-finite** loss or upload (a diverging client), or its node's reply
is **refused** (a reply that is not what the server asked for: :mod:`fedskew.engine.replies`). The setting
decides, per failure, whether the client is left out of the round (``reject``: logged and counted in the
record's ``rejected``) or the round fails (``fail``: a :class:`ClientError`, nothing of the round is
committed, and ``--resume`` continues from the last committed round):

=================  ===========  ============  ============
setting            raised       non-finite    refused
=================  ===========  ============  ============
drop_non_finite    fail         reject        reject
drop               reject       reject        reject
fail               fail         fail          fail
=================  ===========  ============  ============

A refused reply is decided as a non-finite upload (:data:`Failure.NON_FINITE`), not as a bug: by default a
broken or hostile node loses its clients for the round and the honest nodes' round goes on.

The embedded engine (:mod:`fedskew.engine.client`, :mod:`fedskew.engine.loop`) and the Flower server
(:mod:`fedskew.flower.server`) call the functions below and nothing else, so the two runtimes cannot
disagree. An algorithm's ``ContractError`` is never a client's fault and always fails the round; callers
let it through before asking the policy.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

from fedskew.algorithms.base import Payload
from fedskew.errors import RunFailure

log = logging.getLogger("fedskew.engine")

#: the values of ``engine.on_client_error`` (the settings' ``Literal`` lists the same)
ON_CLIENT_ERROR = ("drop_non_finite", "drop", "fail")
#: the allowed values, for error messages
ALLOWED = "allowed: " + ", ".join(ON_CLIENT_ERROR)


class ClientError(RunFailure):
    """A client failed and ``engine.on_client_error`` says to fail the round: nothing of it is committed."""


class Failure(enum.Enum):
    """How a client failed."""

    RAISED = "raised"  # its training raised (this process or its node)
    NON_FINITE = "non-finite"  # NaN / Inf in its training loss or its upload (and a refused reply)


class Decision(enum.Enum):
    """What the round does with a failed client."""

    REJECT = "reject"  # leave the client out of the round (logged, counted in 'rejected')
    FAIL = "fail"  # fail the round: nothing of it is committed


def decide(on_client_error: str, failure: Failure) -> Decision:
    """The decision of ``engine.on_client_error`` for ``failure`` (the table of the module docstring)."""
    if on_client_error not in ON_CLIENT_ERROR:
        raise ValueError(f"engine.on_client_error={on_client_error!r}; {ALLOWED}")
    if on_client_error == "fail":
        return Decision.FAIL
    if on_client_error == "drop" or failure is Failure.NON_FINITE:
        return Decision.REJECT
    return Decision.FAIL


def client_raised(on_client_error: str, what: str) -> None:
    """Apply the policy to clients whose training raised; ``what`` says which, e.g. ``"round 3: client 4
    raised ValueError: ..."`` (only its first line is kept). Raises :class:`ClientError` when the round must
    fail; otherwise logs that the clients are dropped from the round, and the caller rejects them."""
    what = what.splitlines()[0] if what else what
    if decide(on_client_error, Failure.RAISED) is Decision.FAIL:
        raise ClientError(
            f"{what}; the round was not committed (engine.on_client_error={on_client_error}; {ALLOWED})"
        )
    log.warning("%s; dropped from the round", what)


def reply_refused(on_client_error: str, what: str) -> None:
    """Apply the policy to clients whose node's reply was refused; ``what`` names the round, the node, the
    clients and the problem in one line. Raises :class:`ClientError` when the round must fail; otherwise logs
    that the clients are rejected from the round, and the caller rejects them."""
    if decide(on_client_error, Failure.NON_FINITE) is Decision.FAIL:  # decided as a non-finite upload
        raise ClientError(
            f"{what}; the round was not committed (engine.on_client_error={on_client_error}; {ALLOWED})"
        )
    log.warning("%s; rejected from the round", what)


def finite_upload(payload: Payload, round_idx: int, cid: int) -> bool:
    """The one non-finite check of an upload: ``False`` (and a logged rejection) when ``payload`` holds NaN
    or Inf; the caller then rejects the client's update."""
    if payload.is_finite():
        return True
    log.warning("round %d: rejected update of client %d: non-finite values", round_idx, cid)
    return False


def check_rejected(on_client_error: str, round_idx: int, rejected: Sequence[int]) -> None:
    """Apply the policy to a round's rejected clients (non-finite losses or uploads; clients dropped after
    raising only reach here under ``drop``, whose decision is the same): raises :class:`ClientError` when
    the round must fail."""
    if rejected and decide(on_client_error, Failure.NON_FINITE) is Decision.FAIL:
        raise ClientError(
            f"round {round_idx}: update of client {rejected[0]} rejected (non-finite values); the round was "
            f"not committed (engine.on_client_error={on_client_error}; {ALLOWED})"
        )
