"""The capture's three provider calls: authorise (a hold), capture (part or all), release."""

from __future__ import annotations

from typing import Any

from payments.adyen.choice import ByPaymentSystem
from payments.adyen.effects import AdyenAuthorization, AdyenCancel, AdyenCapture
from payments.fence import ClaimView, EffectResult, ProviderEffect
from payments.provider.client import PaymentIntent
from payments.provider.effect import PaymentIntentEffect
from payments.provider.errors import (
    PAYMENT_INTENT_UNEXPECTED_STATE,
    CardDeclined,
    InvalidRequest,
    ResourceMissing,
)

#: The step that authorises: the steps after it act on its intent.
AUTHORIZE = "authorize"
DECLINED = frozenset({"requires_payment_method", "canceled"})
#: What a step does to the hold on the card (its effect's `HOLD`), read by the desk's Money
#: box only, never by the engine: "hold" makes it, "capture" takes all or part of it (the
#: provider releases the rest), "release" cancels it whole.
MAKES_HOLD, CAPTURES_HOLD, RELEASES_HOLD = "hold", "capture", "release"


def release_hold_of(effect: ProviderEffect, claim: ClaimView) -> EffectResult | None:
    """For an operator's "mark failed": cancel the intent unless captured, so that no
    capture can follow and no hold stays on the card; say what the step is now."""
    found, intent = effect.current(claim)
    intent = intent or (found.reference if found is not None else "")
    if not intent or (found is not None and found.data.get("status") == "succeeded"):
        return found  # nothing to cancel, or captured: it happened
    try:
        effect.client.cancel_payment_intent(intent, cancellation_reason="abandoned")
    except InvalidRequest as exc:
        if exc.code != PAYMENT_INTENT_UNEXPECTED_STATE:
            raise
    return effect._settled(effect.retrieve(intent))


class _OnTheIntent(PaymentIntentEffect):
    """A call on the intent the authorisation made (named in the request; no metadata)."""

    TARGET = "payment_intent"

    def intent(self) -> str:
        return str(self.run.result(AUTHORIZE)["reference"])

    def decides(self, intent: PaymentIntent, request: dict[str, Any]) -> bool:
        return intent.status != "requires_capture"  # still held: neither call has acted

    def refused_by_state(self, exc: InvalidRequest, request: dict[str, Any]) -> Any:
        """A call the intent's state forbids: its state now tells what happened."""
        if isinstance(exc, ResourceMissing):
            raise exc  # a 404 is not this call's refusal: its own outcome classifies it
        if exc.code != PAYMENT_INTENT_UNEXPECTED_STATE:
            return self.refused(status="refused", code=exc.code or "invalid")
        return self.retrieve(request["payment_intent"])


class IntentAuthorization(PaymentIntentEffect):
    """Hold the order's amount on the card (`capture_method=manual`)."""

    MAY_HAVE_HAPPENED = "The customer's card may already hold the amount."
    VOIDS = "is cancelled there, which releases the hold"
    void = release_hold_of
    HOLD = MAKES_HOLD
    EVENTS = frozenset(
        {
            "payment_intent.amount_capturable_updated",
            "payment_intent.payment_failed",
            "payment_intent.canceled",
        }
    )

    def request(self) -> dict[str, Any]:
        params = self.params
        return {
            "amount": int(params["amount"]),
            "currency": params["currency"],
            "payment_method": params["payment_method"],
            "capture_method": "manual",
            "metadata": {"order_id": str(params["order_id"])},
        }

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        try:
            return self.client.create_payment_intent(
                amount=request["amount"],
                currency=request["currency"],
                payment_method=request["payment_method"],
                metadata=request["metadata"],
                capture_method="manual",
                idempotency_key=idempotency_key,
            )
        except CardDeclined as exc:
            code = exc.code or "card_declined"
            return self.refused(exc.payment_intent_id or "", status="declined", code=code)

    def outcome(self, intent: PaymentIntent) -> EffectResult | None:
        data = {"status": intent.status, "held": intent.amount, "currency": intent.currency}
        if intent.status in ("requires_capture", "succeeded"):
            return self.succeeded(intent.id, **data)
        if intent.status in DECLINED:
            return self.refused(intent.id, **data, code=intent.last_error_code or "declined")
        return None

    @classmethod
    def money(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        return None  # a hold moves no money

    @classmethod
    def held(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        """The amount the done authorisation holds on the card (minor units, currency)."""
        held, currency = result.get("held"), result.get("currency")
        if isinstance(held, int) and isinstance(currency, str):
            return held, currency
        return None


class IntentCapture(_OnTheIntent):
    """Capture `amount_to_capture` of the hold (Stripe releases the rest)."""

    MAY_HAVE_HAPPENED = "The held amount may already have been captured."
    VOIDS = "is cancelled there unless captured, which releases the hold"
    void = release_hold_of
    #: The audit counts a done capture as its intent's success (its reference is the charge).
    AUDITED = "payment"
    AUDIT_ID = "payment_intent"
    HOLD = CAPTURES_HOLD
    EVENTS = frozenset({"payment_intent.succeeded", "payment_intent.canceled"})

    def request(self) -> dict[str, Any]:
        return {
            "payment_intent": self.intent(),
            "amount_to_capture": int(self.params["amount_to_capture"]),
        }

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        try:
            return self.client.capture_payment_intent(
                request["payment_intent"],
                amount_to_capture=request["amount_to_capture"],
                idempotency_key=idempotency_key,
            )
        except InvalidRequest as exc:
            return self.refused_by_state(exc, request)

    def outcome(self, intent: PaymentIntent) -> EffectResult | None:
        data = {
            "status": intent.status,
            "amount": intent.amount_received,
            "currency": intent.currency,
            "payment_intent": intent.id,
        }
        if intent.status == "succeeded":  # the charge is the captured money's own object
            return self.succeeded(intent.latest_charge or "", **data)
        if intent.status == "canceled":
            return self.refused(intent.id, **data, code="canceled")
        return None


class IntentRelease(_OnTheIntent):
    """Cancel the intent, which releases a hold nobody will capture."""

    HOLD = RELEASES_HOLD
    EVENTS = frozenset({"payment_intent.canceled"})

    def request(self) -> dict[str, Any]:
        return {"payment_intent": self.intent(), "cancellation_reason": "abandoned"}

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        try:
            return self.client.cancel_payment_intent(
                request["payment_intent"],
                idempotency_key=idempotency_key,
                cancellation_reason=request["cancellation_reason"],
            )
        except InvalidRequest as exc:
            return self.refused_by_state(exc, request)

    def outcome(self, intent: PaymentIntent) -> EffectResult | None:
        data = {"status": intent.status, "payment_intent": intent.id}
        if intent.status == "canceled":  # no object of its own: the intent is the authorisation's
            return self.succeeded("", **data)
        if intent.status == "succeeded":
            return self.refused(intent.id, **data, code="captured")
        return None

    @classmethod
    def money(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        return None


# The steps as the handler declares them: each builds Adyen's twin for an order whose shop
# pays through Adyen (payments.adyen.choice), the provider's PaymentIntent call otherwise.


class Authorization(ByPaymentSystem, IntentAuthorization):
    """Hold the order's amount at the shop's payment system."""

    ADYEN = AdyenAuthorization


class Capture(ByPaymentSystem, IntentCapture):
    """Capture part or all of the hold at the shop's payment system."""

    ADYEN = AdyenCapture


class Release(ByPaymentSystem, IntentRelease):
    """Release the hold at the shop's payment system."""

    ADYEN = AdyenCancel
