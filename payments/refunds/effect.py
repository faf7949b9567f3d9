"""The `refund` effect: a refund at the provider against the order's payment intent.

Maps provider answers to EffectResult; provider errors carry their own
outcome (an over-refund or a refund of an unpaid intent is a 400: permanent).
Refunds have Stripe's states: `pending` and `requires_action` are in flight
(StillInProgress: neither done, refused nor absent), `succeeded`, and
`failed` or `canceled`. A lost answer is found by listing the intent's
refunds, a consistent read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from payments.adyen.choice import ByPaymentSystem
from payments.adyen.effects import AdyenRefund
from payments.fence import ClaimView, EffectResult, ProviderEffect
from payments.provider.client import Refund
from payments.provider.errors import InvalidRequest, ResourceMissing

FAILED_STATUSES = frozenset({"failed", "canceled"})


class RefundEffect(ProviderEffect):
    """Refund an operation's amount of its order's payment intent, once."""

    AUDITED = "refund"  # the refund audit lists it by its reference
    AUDIT_PARENT = "payment_intent"  # the request item naming the payment it refunds
    MAY_HAVE_HAPPENED = "The customer may already have been refunded."
    VOIDS = ""  # a refund cannot be called back
    EVENTS = frozenset({"refund.created", "refund.updated", "refund.failed", "charge.refunded"})

    def request(self) -> dict[str, Any]:
        params = self.params
        return {
            "payment_intent": params["payment_intent"],
            "amount": int(params["amount"]),
            "currency": params["currency"],
            "metadata": {"order_id": str(params["order_id"])},
        }

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        try:
            return self.client.create_refund(
                payment_intent=request["payment_intent"],
                amount=request["amount"],
                metadata=request["metadata"],
                idempotency_key=idempotency_key,
            )
        except ResourceMissing:
            raise  # a 404 on create is not a refusal of this refund: let it be classified
        except InvalidRequest as exc:  # over-refund, already refunded, intent not refundable
            return self.refused(status="refused", code=exc.code or "invalid")

    def retrieve(self, reference: str) -> Refund:
        return self.client.retrieve_refund(reference)

    def candidates(self, claim: ClaimView) -> Iterator[Refund]:
        return self.client.list_refunds(payment_intent=str(claim.request.get("payment_intent")))

    def matches(self, refund: Refund, request: dict[str, Any]) -> bool:
        same_intent = refund.payment_intent == request.get("payment_intent")
        return same_intent and super().matches(refund, request)

    def outcome(self, refund: Refund) -> EffectResult | None:
        """SUCCESS, PERMANENT (failed, canceled); None while pending or requiring action."""
        data = {
            "status": refund.status,
            "amount": refund.amount,
            "currency": refund.currency,
            "payment_intent": refund.payment_intent,
        }
        if refund.status == "succeeded":
            return self.succeeded(refund.id, **data)
        if refund.status in FAILED_STATUSES:
            return self.refused(refund.id, **data)
        return None


class OrderRefund(ByPaymentSystem, RefundEffect):
    """The refund at the system the order's payment went through (payments.adyen.choice)."""

    ADYEN = AdyenRefund
