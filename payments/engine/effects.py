"""The contract between the fence and an external effect (a provider call).

The fence calls `perform` with the request stored on the claim and the claim's
idempotency key, and `find` to learn what happened when an answer was lost.
Neither side knows the other's internals: an effect raises exceptions that
carry an `outcome` attribute (payments.engine.outcomes.Outcome) and returns
EffectResult for a success or a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
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

    @property
    def succeeded(self) -> bool:
        return self.outcome == Outcome.SUCCESS


@dataclass(frozen=True)
class ClaimView:
    """What an effect may know of a claim when asked to find its outcome."""

    operation_key: str
    step: str
    idempotency_key: str
    reference: str
    request: dict[str, Any]
    #: When the first and the last request under the key were sent (the database's clock).
    first_request_at: datetime | None = None
    last_request_at: datetime | None = None


#: How far the provider's clock and ours may differ, on either side of a created window.
CLOCK_SLACK = timedelta(minutes=5)


def created_window(claim: ClaimView, grace: timedelta) -> tuple[int, int]:
    """The `created` window (Unix seconds, both ends included) where the claim's object is.

    From the first request under the key to a grace after the last one: an
    object the provider made for one of those requests was created inside it.
    Lists by `created` are consistent reads (search is not, and never decides).
    """
    if claim.first_request_at is None or claim.last_request_at is None:
        raise ValueError(f"{claim.operation_key}/{claim.step}: no request times to look between")
    since = claim.first_request_at - CLOCK_SLACK
    until = claim.last_request_at + grace + CLOCK_SLACK
    return int(since.timestamp()), int(until.timestamp()) + 1


class StillInProgress(Exception):
    """The provider has the object, still in progress (a pending refund): neither done nor
    refused, and not absent either. Look again later; never settle it as not found."""

    outcome = Outcome.UNCERTAIN

    def __init__(
        self, message: str, *, reference: str = "", data: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.reference = reference
        #: What the system showed of the object (status, amount, currency), when it did.
        self.data = data or {}

    def shown(self) -> EffectResult | None:
        """The object the system showed, in progress, as the desk keeps a look's view of it
        (fence.note_provider_view); None when it named none."""
        if not self.reference:
            return None
        return EffectResult(
            self.outcome, reference=self.reference, data={"status": "in progress", **self.data}
        )


class ExternalEffect(Protocol):
    """An external call fenced by a step claim.

    Two class attributes word the desk's "mark failed" page: `MAY_HAVE_HAPPENED`
    (one sentence: the effect may have happened already) and `VOIDS` (what `void`
    does to the provider's object, after "The provider's object <id>", or ""
    when it cannot be called back).
    """

    MAY_HAVE_HAPPENED: str
    VOIDS: str

    def build_request(self) -> dict[str, Any]:
        """Return the call's parameters; stored on the claim and sent unchanged on every try."""

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        """Make the call; raise an exception with `.outcome` when no settled answer came."""

    def find(self, claim: ClaimView) -> EffectResult | None:
        """Look the outcome up by consistent reads only; None when not found.

        By the reference when there is one, else by a list of the provider's
        objects (a created window, an intent's refunds) matched against the
        request. Never by search: it lags writes, and "not found" there may
        be a charge. Raise StillInProgress for an object neither done nor
        refused yet.
        """

    def void(self, claim: ClaimView) -> EffectResult | None:
        """Make sure the effect can no longer happen, and return what it is now.

        For an operator who marks the step failed: cancel what the provider
        holds (a PaymentIntent), then return SUCCESS when it had happened
        (it cannot be undone this way), PERMANENT when it is refused,
        cancelled or absent for good, None when nothing is found (the
        caller decides from the grace since the last request). Raise
        StillInProgress when it may still happen.
        """

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


def reversal_step(step: str) -> str:
    """The local step that records, once, that the provider reversed the done `step`."""
    return f"{step}:reversed"


class ReferenceNotFound(LookupError):
    """The provider has no object with that reference (or it is not a valid reference)."""


class DeliveryPolicy(StrEnum):
    """How a side effect without a lookup (plain e-mail) treats an unknown outcome."""

    AT_MOST_ONCE = "at_most_once"  # skip when it may have happened; never send twice
    AT_LEAST_ONCE = "at_least_once"  # send again when unsure; the repeat is flagged
