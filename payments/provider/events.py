"""The provider's events as facts: its event shapes, and its objects retrieved by id.

The provider's `EventSource` (payments.engine.facts), declared on its system
(payments.provider.effect): a payment intent that succeeded or was declined,
and a refund that succeeded or failed, are facts; a `charge.refunded` carries
its refunds when they are listed (without them, since API version
2022-11-15, each refund's own event settles it). Before a fact moves
anything the object is retrieved by id (`current`) and the retrieved state
decides; an object the provider does not have is `missing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from payments.engine.effects import EffectResult
from payments.engine.facts import Fact, SystemUnavailable
from payments.engine.outcomes import Outcome
from payments.provider.client import Event, PaymentIntent, ProviderClient, Refund
from payments.provider.errors import ProviderError, ResourceMissing

CHARGE_REFUNDED = "charge.refunded"
INTENT = "payment_intent"
#: The request item naming the intent a step acts on or refunds.
INTENT_ITEM = "payment_intent"

DECLINED_STATUSES = frozenset({"requires_payment_method", "canceled"})
FAILED_REFUND_STATUSES = frozenset({"failed", "canceled"})


class ProviderEvents:
    """The provider's EventSource: facts out of its events, objects retrieved by id."""

    def facts(self, event: Mapping[str, Any]) -> list[Fact]:
        parsed = Event.from_json(dict(event))
        return facts_of(parsed)

    def current(self, fact: Fact) -> Fact:
        try:
            with ProviderClient.from_settings() as client:
                return current(fact, client)
        except ProviderError as exc:
            raise SystemUnavailable(f"{type(exc).__name__}: {exc}") from exc


def facts_of(event: Event) -> list[Fact]:
    """Return the facts an event carries; raise ValueError if malformed."""
    obj = dict(event.object)
    if event.type == CHARGE_REFUNDED:
        if obj.get("object") != "charge":
            raise ValueError("charge.refunded without a charge")
        refunds = obj.get("refunds")
        listed = refunds.get("data") if isinstance(refunds, dict) else None
        facts = [_refund_fact(item) for item in listed or []]
    elif event.type.startswith(INTENT + "."):
        facts = [_intent_fact(obj)]
    elif event.type.startswith("refund."):
        facts = [_refund_fact(obj)]
    else:
        raise ValueError(f"{event.type}: no object the fence reads")
    return [replace(fact, event_type=event.type) for fact in facts]


def object_id_of(event: Event) -> str:
    """The id of the object the event is about (for the record), or ''."""
    value = event.object.get("id")
    return value if isinstance(value, str) else ""


def _common(obj: Any, kind: str) -> tuple[str, dict[str, str], int, str]:
    if not isinstance(obj, dict) or obj.get("object") != kind:
        raise ValueError(f"not a {kind} object")
    object_id, amount, currency = obj.get("id"), obj.get("amount"), obj.get("currency")
    if not isinstance(object_id, str) or not object_id:
        raise ValueError(f"{kind} without an id")
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ValueError(f"{kind} without an amount")
    if not isinstance(currency, str) or not isinstance(obj.get("status"), str):
        raise ValueError(f"{kind} without a currency or status")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{kind} with malformed metadata")
    return object_id, {str(k): str(v) for k, v in metadata.items()}, amount, currency


def _intent_fact(obj: Any) -> Fact:
    """Shaped as PaymentIntentCharge.find shapes it (payments.checkout.charge)."""
    object_id, metadata, amount, currency = _common(obj, INTENT)
    status = obj["status"]
    data: dict[str, Any] = {"status": status, "amount": amount, "currency": currency}
    found: EffectResult | None = None
    if status == "succeeded":
        found = EffectResult(Outcome.SUCCESS, reference=object_id, data=data)
    elif status in DECLINED_STATUSES:
        error = obj.get("last_payment_error")
        code = error.get("code") if isinstance(error, dict) else None
        data["code"] = code or "declined"
        found = EffectResult(Outcome.PERMANENT, reference=object_id, data=data)
    return Fact(
        INTENT,
        object_id,
        found,
        metadata,
        amount,
        currency,
        parent=object_id,
        noun="charge",
        names={INTENT_ITEM: object_id},
    )


def _refund_fact(obj: Any) -> Fact:
    """Shaped as RefundEffect.find shapes it (payments.refunds.effect)."""
    object_id, metadata, amount, currency = _common(obj, "refund")
    intent = obj.get(INTENT)
    if isinstance(intent, dict):  # expanded
        intent = intent.get("id")
    if not isinstance(intent, str) or not intent:
        raise ValueError("refund without a payment_intent")
    status = obj["status"]
    data = {"status": status, "amount": amount, "currency": currency, INTENT: intent}
    found: EffectResult | None = None
    if status == "succeeded":
        found = EffectResult(Outcome.SUCCESS, reference=object_id, data=data)
    elif status in FAILED_REFUND_STATUSES:
        found = EffectResult(Outcome.PERMANENT, reference=object_id, data=data)
    return Fact(
        "refund",
        object_id,
        found,
        metadata,
        amount,
        currency,
        parent=intent,
        noun="refund",
        names={INTENT_ITEM: intent},
    )


def current(fact: Fact, client: ProviderClient) -> Fact:
    """The fact as the provider shows it now: its object retrieved by id.

    Provider errors other than "no such object" propagate (try again later).
    """
    try:
        if fact.object_type == INTENT:
            intent = client.retrieve_payment_intent(fact.object_id)
            now = _intent_fact(_intent_json(intent))
            return replace(now, event_type=fact.event_type, obj=intent)
        refund = client.retrieve_refund(fact.object_id)
        return replace(_refund_fact(_refund_json(refund)), event_type=fact.event_type, obj=refund)
    except (ResourceMissing, ValueError):
        return replace(fact, found=None, missing=True, obj=None)


def _intent_json(intent: PaymentIntent) -> dict[str, Any]:
    error = {"code": intent.last_error_code} if intent.last_error_code else None
    return {
        "object": INTENT,
        "id": intent.id,
        "status": intent.status,
        "amount": intent.amount,
        "currency": intent.currency,
        "metadata": dict(intent.metadata),
        "last_payment_error": error,
    }


def _refund_json(refund: Refund) -> dict[str, Any]:
    return {
        "object": "refund",
        "id": refund.id,
        "status": refund.status,
        "amount": refund.amount,
        "currency": refund.currency,
        INTENT: refund.payment_intent,
        "metadata": dict(refund.metadata),
    }
