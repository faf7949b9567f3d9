"""The contract between the fence and an external effect (a provider call).

The fence calls `perform` with the request stored on the claim and the claim's
idempotency key, and `find` to learn what happened when an answer was lost.
Neither side knows the other's internals: an effect raises exceptions that
carry an `outcome` attribute (payments.engine.outcomes.Outcome) and returns
EffectResult for a success or a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from payments.engine.outcomes import Outcome


@dataclass(frozen=True)
class EffectResult:
    """A settled answer: SUCCESS (with the provider's reference) or PERMANENT (refused)."""

    outcome: Outcome
    reference: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def as_result(self) -> dict[str, Any]:
        return {"reference": self.reference, **self.data}


@dataclass(frozen=True)
class ClaimView:
    """What an effect may know of a claim when asked to find its outcome."""

    operation_key: str
    step: str
    idempotency_key: str
    reference: str
    request: dict[str, Any]


class ExternalEffect(Protocol):
    """An external call fenced by a step claim."""

    def build_request(self) -> dict[str, Any]:
        """Return the call's parameters; stored on the claim and sent unchanged on every try."""

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        """Make the call; raise an exception with `.outcome` when no settled answer came."""

    def find(self, claim: ClaimView) -> EffectResult | None:
        """Look the outcome up (by reference, else by metadata); None when not found."""

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """Check that `reference` is this claim's succeeded effect (an operator typed it).

        Raise ReferenceNotFound when the provider has no such object, ValueError naming
        what does not match; let other provider errors propagate.
        """


def fence_metadata(operation: Any, step: str, **business: str) -> dict[str, str]:
    """The metadata every effect's request sends: what the lookups search and match by.

    `operation_key` and `step` find a lost outcome; `operation_id` is unique
    across key scopes (a client key may equal a derived one); `business`
    adds what the handler wants on the provider's dashboard (an order id).
    """
    return {
        "operation_key": operation.key,
        "step": step,
        **business,
        "operation_id": str(operation.pk),
    }


def sent_metadata_matches(request: dict[str, Any], metadata: Any) -> bool:
    """Tell whether a provider object carries every metadata item this claim's request sent.

    An effect's `find` accepts only such objects: another operation with the
    same key (another scope, another client) never settles this claim.
    """
    sent = request.get("metadata") or {}
    return all(metadata.get(name) == value for name, value in sent.items())


class ReferenceNotFound(LookupError):
    """The provider has no object with that reference (or it is not a valid reference)."""


class DeliveryPolicy(StrEnum):
    """How a side effect without a lookup (plain e-mail) treats an unknown outcome."""

    AT_MOST_ONCE = "at_most_once"  # skip when it may have happened; never send twice
    AT_LEAST_ONCE = "at_least_once"  # send again when unsure; the repeat is flagged
