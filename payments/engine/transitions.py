"""The one authority for state changes: which operation and claim transitions are allowed.

Every state change of an operation (`fence.transition_in_tx`) and of a claim
(`fence.settle_claim`, `take_over_claim`, `release_claim`) asks `check_*`
here, or, where the fence makes the change in one statement, states in that
statement's WHERE clause exactly the from-states this table allows
(`operation_sources`, `claim_sources`); the runtime, recovery, the desk and
the API decide nothing on their own.
An illegal transition raises IllegalTransition, is logged with both states and
leaves the row as it was (the caller's transaction rolls back).
"""

from __future__ import annotations

import logging

from payments.exceptions import IllegalTransition
from payments.models import ClaimState, OperationState

logger = logging.getLogger("payments.engine.transitions")

_O = OperationState
#: from -> the states an operation may move to (a same-state move is an audited note).
OPERATION_TRANSITIONS: dict[str, frozenset[str]] = {
    # Taken by a worker; a message delivered, retried or given up; no handler: review.
    _O.PENDING: frozenset({_O.RUNNING, _O.SUCCEEDED, _O.RETRYING, _O.FAILED, _O.NEEDS_REVIEW}),
    # Every outcome of a run; RUNNING -> RUNNING is a takeover after the lease ran out.
    _O.RUNNING: frozenset(
        {_O.RUNNING, _O.RETRYING, _O.SUCCEEDED, _O.FAILED, _O.UNCERTAIN, _O.NEEDS_REVIEW}
    ),
    _O.RETRYING: frozenset(
        {_O.RUNNING, _O.RETRYING, _O.SUCCEEDED, _O.FAILED, _O.UNCERTAIN, _O.NEEDS_REVIEW}
    ),
    # Settled by the reconciler, an event or an operator; never run without a decision.
    _O.UNCERTAIN: frozenset({_O.UNCERTAIN, _O.RETRYING, _O.FAILED, _O.NEEDS_REVIEW}),
    _O.NEEDS_REVIEW: frozenset({_O.NEEDS_REVIEW, _O.RETRYING, _O.FAILED, _O.UNCERTAIN}),
    # Resumed (the provider showed success, or an operator decided), or an in-doubt
    # claim found past the grace period; a message requeued by an operator succeeds.
    _O.FAILED: frozenset({_O.FAILED, _O.RETRYING, _O.NEEDS_REVIEW, _O.SUCCEEDED}),
    _O.SUCCEEDED: frozenset(),  # final
}

_C = ClaimState
#: from -> the states a claim may move to. A settled claim (done, failed) never changes.
#: A claim written with the lease and never used is withdrawn (fence.withdraw_claim): no
#: move, the row goes; its audit row reads claimed -> WITHDRAWN.
CLAIM_TRANSITIONS: dict[str, frozenset[str]] = {
    # Released or taken over (stays claimed), settled, or in doubt.
    _C.CLAIMED: frozenset({_C.CLAIMED, _C.DONE, _C.FAILED, _C.UNCERTAIN}),
    _C.UNCERTAIN: frozenset({_C.UNCERTAIN, _C.DONE, _C.FAILED}),
    _C.DONE: frozenset(),
    _C.FAILED: frozenset(),
}


def _check(table: dict[str, frozenset[str]], what: str, name: str, from_: str, to: str) -> None:
    if to not in table.get(from_, frozenset()):
        logger.error(
            "illegal %s transition of %s: %s -> %s; nothing changed", what, name, from_, to
        )
        raise IllegalTransition(what=what, name=name, from_state=from_, to_state=to)


def check_operation(name: str, from_state: str, to_state: str) -> None:
    """Raise IllegalTransition unless an operation may go from `from_state` to `to_state`."""
    _check(OPERATION_TRANSITIONS, "operation", name, from_state, to_state)


def check_claim(name: str, from_state: str, to_state: str) -> None:
    """Raise IllegalTransition unless a claim may go from `from_state` to `to_state`."""
    _check(CLAIM_TRANSITIONS, "claim", name, from_state, to_state)


def operation_sources(to_state: str) -> list[str]:
    """Every state an operation may leave for `to_state` (what a one-statement transition accepts)."""
    return sorted(s for s, targets in OPERATION_TRANSITIONS.items() if to_state in targets)


def claim_sources(to_state: str) -> list[str]:
    """Every state a claim may leave for `to_state` (what a one-statement transition accepts)."""
    return sorted(s for s, targets in CLAIM_TRANSITIONS.items() if to_state in targets)


#: The audit row's to-state of a withdrawn claim (fence.withdraw_claim): no claim state.
WITHDRAWN = "withdrawn"
