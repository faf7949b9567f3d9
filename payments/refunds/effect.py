"""The `refund` effect: a refund at the provider against the order's payment intent.

Maps provider answers to EffectResult; provider errors carry their own
outcome (an over-refund or a refund of an unpaid intent is a 400: permanent).
Refunds have Stripe's states: `pending` and `requires_action` are in flight
(StillInProgress: neither done, refused nor absent), `succeeded`, and
`failed` or `canceled`. A lost answer is found by listing the intent's
refunds, a consistent read.
"""

from __future__ import annotations

from typing import Any

from payments.engine.effects import (
    ClaimView,
    EffectResult,
    ReferenceNotFound,
    StillInProgress,
    fence_metadata,
    sent_metadata_matches,
)
from payments.engine.outcomes import Outcome
from payments.models import Operation
from payments.provider.client import ProviderClient, Refund
from payments.provider.errors import InvalidRequest, ResourceMissing
from payments.refunds.names import REFUND_STEP

FAILED_STATUSES = frozenset({"failed", "canceled"})


class UnsettledRefund(StillInProgress):
    """The refund exists but is still pending (or requires action) at the provider."""


class RefundEffect:
    """Refund an operation's amount of its order's payment intent, once."""

    #: What "mark failed" must say, in the desk's words (a refund cannot be called back).
    MAY_HAVE_HAPPENED = "The customer may already have been refunded."
    VOIDS = ""

    def __init__(self, operation: Operation, client: ProviderClient | None = None) -> None:
        self.operation = operation
        self.client = client or ProviderClient.from_settings()

    def build_request(self) -> dict[str, Any]:
        params = self.operation.params
        return {
            "payment_intent": params["payment_intent"],
            "amount": int(params["amount"]),
            "currency": params["currency"],
            "metadata": fence_metadata(
                self.operation, REFUND_STEP, order_id=str(params["order_id"])
            ),
        }

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        try:
            refund = self.client.create_refund(
                payment_intent=request["payment_intent"],
                amount=request["amount"],
                metadata=request["metadata"],
                idempotency_key=idempotency_key,
            )
        except ResourceMissing:
            raise  # a 404 on create is not a refusal of this refund: let it be classified
        except InvalidRequest as exc:  # over-refund, already refunded, intent not refundable
            return EffectResult(
                Outcome.PERMANENT, data={"status": "refused", "code": exc.code or "invalid"}
            )
        return _settled(refund)

    def find(self, claim: ClaimView) -> EffectResult | None:
        if claim.reference:
            try:
                return _settled(self.client.retrieve_refund(claim.reference))
            except ResourceMissing:
                return None
        intent = str(claim.request.get("payment_intent", ""))
        mine = [
            r
            for r in self.client.list_refunds(payment_intent=intent)
            if _is_this_request(r, claim.request)
        ]
        done = [r for r in mine if r.status == "succeeded"]
        if done:
            return _settled(done[0])
        in_flight = [r for r in mine if r.status not in FAILED_STATUSES]
        if in_flight:
            return _settled(in_flight[0])  # raises UnsettledRefund: never "not found"
        failed = [r for r in mine if r.status in FAILED_STATUSES]
        return _settled(failed[0]) if failed else None

    def void(self, claim: ClaimView) -> EffectResult | None:
        """A refund cannot be called back: say what it is (a pending one raises)."""
        return self.find(claim)

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """Check that `reference` is this step's succeeded refund; raise ValueError naming why not."""
        try:
            refund = self.client.retrieve_refund(reference)
        except (ResourceMissing, ValueError) as exc:
            raise ReferenceNotFound(reference) from exc
        problems = []
        if refund.status != "succeeded":
            problems.append(f"its status is {refund.status}")
        if not _is_this_request(refund, claim.request):
            problems.append("it was made for another operation, intent or amount")
        if problems:
            raise ValueError("; ".join(problems))
        return _settled(refund)


def _is_this_request(refund: Refund, request: dict[str, Any]) -> bool:
    """Tell whether a found refund is the one this claim's request made (metadata, intent, amount)."""
    if not sent_metadata_matches(request, refund.metadata):
        return False
    if refund.payment_intent != request.get("payment_intent"):
        return False
    return "amount" not in request or int(request["amount"]) == refund.amount


def _settled(refund: Refund) -> EffectResult:
    result = _settled_or_none(refund)
    if result is None:
        raise UnsettledRefund(f"refund {refund.id} is {refund.status}", reference=refund.id)
    return result


def _settled_or_none(refund: Refund) -> EffectResult | None:
    data = {
        "status": refund.status,
        "amount": refund.amount,
        "currency": refund.currency,
        "payment_intent": refund.payment_intent,
    }
    if refund.status == "succeeded":
        return EffectResult(Outcome.SUCCESS, reference=refund.id, data=data)
    if refund.status in FAILED_STATUSES:
        return EffectResult(Outcome.PERMANENT, reference=refund.id, data=data)
    return None
