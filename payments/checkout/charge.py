"""The `charge` effect: the order's PaymentIntent, confirmed once, fenced by a claim.

One PaymentIntent per order, as Stripe's own retry model has it. The first
attempt creates and confirms it in one request; every later attempt (a new
payment method after a decline, the desk's new attempt, the shop's retry under
a new key) confirms that same intent (`POST /v1/payment_intents/{id}/confirm`),
and an intent that succeeded refuses that: the provider itself makes a second
success for the order impossible. An intent cancelled by an operator's "mark
failed" can never be charged; the next attempt creates a new one.

Outcomes are decided by consistent reads only: retrieve by id, or a list by
`created` window matched against the claim's request; never by search.

This module is the only place where the fence's effect contract meets the
provider client. It maps provider answers to EffectResult and lets provider
errors (which carry their `outcome`) propagate to the fence.
"""

from __future__ import annotations

import logging
from typing import Any

from payments.adyen.choice import ByPaymentSystem
from payments.adyen.effects import AdyenCharge
from payments.checkout.names import CHARGE, CHECKOUT
from payments.fence import ClaimView, EffectResult
from payments.models import Operation, StepClaim
from payments.provider.client import PaymentIntent
from payments.provider.effect import PaymentIntentEffect
from payments.provider.errors import (
    PAYMENT_INTENT_UNEXPECTED_STATE,
    CardDeclined,
    InvalidRequest,
    ResourceMissing,
)

logger = logging.getLogger("payments.checkout.charge")
alerts = logging.getLogger("payments.alerts")

#: A created intent in these took no money: declined (back to requires_payment_method) or cancelled.
DECLINED_STATUSES = frozenset({"requires_payment_method", "canceled"})
#: Stripe's code for a confirm or cancel the intent's status forbids (succeeded, canceled).
UNEXPECTED_STATE = PAYMENT_INTENT_UNEXPECTED_STATE


def order_intent(operation: Operation) -> str:
    """The order's PaymentIntent a new attempt confirms, or '' when it must create one.

    The latest intent an earlier attempt of the same order recorded, unless it
    was cancelled (a cancelled intent can never be charged; a new one may be).
    """
    earlier = (
        StepClaim.objects.filter(
            operation__kind=CHECKOUT,
            operation__entity_type=operation.entity_type,
            operation__entity_id=operation.entity_id,
            step=CHARGE,
        )
        .exclude(operation_id=operation.pk)
        .exclude(provider_reference="")
        .order_by("-claimed_at", "-pk")
        .only("provider_reference", "result")
        .first()
    )
    if earlier is None or (earlier.result or {}).get("status") == "canceled":
        return ""
    return earlier.provider_reference


class PaymentIntentCharge(PaymentIntentEffect):
    """Charge an operation's amount with its payment method, once, on the order's intent."""

    #: The audit counts a done charge as a succeeded intent, by its reference.
    AUDITED = "payment"
    MAY_HAVE_HAPPENED = "The customer may already have been charged."
    VOIDS = "is cancelled there, so that it can never be charged"
    EVENTS = frozenset(
        {"payment_intent.succeeded", "payment_intent.payment_failed", "payment_intent.canceled"}
    )
    #: A later attempt confirms the order's intent, named here (and sends no metadata).
    TARGET = "payment_intent"

    def request(self) -> dict[str, Any]:
        params = self.params
        request = {
            "amount": int(params["amount"]),
            "currency": params["currency"],
            "payment_method": params["payment_method"],
        }
        # Only a later attempt (linked to the one before) can find an intent to confirm:
        # the first one creates it, with no look-up on the way.
        intent = order_intent(self.operation) if self.operation.retry_of_id else ""
        if intent:
            return {**request, "payment_intent": intent}
        return {**request, "metadata": {"order_id": str(params["order_id"])}}

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        try:
            if request.get("payment_intent"):
                return self.client.confirm_payment_intent(
                    request["payment_intent"],
                    payment_method=request["payment_method"],
                    idempotency_key=idempotency_key,
                )
            return self.client.create_payment_intent(
                amount=request["amount"],
                currency=request["currency"],
                payment_method=request["payment_method"],
                metadata=request["metadata"],
                idempotency_key=idempotency_key,
            )
        except CardDeclined as exc:
            code = exc.code or "card_declined"
            return self.refused(exc.payment_intent_id or "", status="declined", code=code)
        except ResourceMissing:
            raise  # a 404 on create is not a refusal of this charge: let it be classified
        except InvalidRequest as exc:
            if exc.code == UNEXPECTED_STATE and exc.payment_intent_id:
                return self._refused_by_state(exc.payment_intent_id)
            return self.refused(status="invalid", code=exc.code or "invalid")

    def _refused_by_state(self, intent_id: str) -> PaymentIntent:
        """The order's intent refused a confirm: it succeeded already, or was cancelled."""
        intent = self.client.retrieve_payment_intent(intent_id)
        if intent.status == "succeeded":
            # The order's one intent holds the money: this attempt's purpose is met, once.
            alerts.error(
                "operation %s: the order's %s had succeeded already; recorded as this "
                "attempt's charge (no second charge was made)",
                self.operation.key,
                intent.id,
            )
        return intent

    def outcome(self, intent: PaymentIntent) -> EffectResult | None:
        """SUCCESS, or PERMANENT (declined, cancelled); None in between (processing, ...)."""
        data: dict[str, Any] = {
            "status": intent.status,
            "amount": intent.amount,
            "currency": intent.currency,
        }
        if intent.status == "succeeded":
            return self.succeeded(intent.id, **data)
        if intent.status in DECLINED_STATUSES:
            code = "canceled" if intent.status == "canceled" else intent.last_error_code
            return self.refused(intent.id, **data, code=code or "declined")
        return None

    def decides(self, intent: PaymentIntent, request: dict[str, Any]) -> bool:
        """A confirm of the order's intent is not told by requires_payment_method.

        An earlier attempt's decline left the intent there too, and this
        attempt's confirm may not have run yet: only its own answer (or its
        same-key replay) tells a decline from a confirm that never arrived.
        """
        return not (request.get("payment_intent") and intent.status == "requires_payment_method")

    def void(self, claim: ClaimView) -> EffectResult | None:
        """Cancel the intent this step works on, unless it succeeded; say what it is now."""
        found, target = self.current(claim)
        if found is not None and found.succeeded:
            return found
        if not target:
            return found  # nothing in the consistent list: the caller weighs the grace
        try:
            intent = self.client.cancel_payment_intent(target, cancellation_reason="abandoned")
        except InvalidRequest as exc:
            if exc.code != UNEXPECTED_STATE:
                raise
            intent = self.client.retrieve_payment_intent(target)  # succeeded, or cancelled before
        return self._settled(intent)


class OrderCharge(ByPaymentSystem, PaymentIntentCharge):
    """The order's charge through the system its shop pays with: the provider's
    PaymentIntent, or an Adyen payment (payments.adyen.choice)."""

    ADYEN = AdyenCharge
