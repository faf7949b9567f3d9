"""What a provider event says, as facts the fence understands, and the claim each belongs to.

An event carries a snapshot of one provider object. A payment intent that
succeeded, or was declined, and a refund that succeeded or failed, are
*facts*: an `EffectResult` (SUCCESS with the reference, or PERMANENT) shaped
like the one the step's own lookup (`effect.find`) would return, so a claim
settled from an event carries the same result as one settled by the
reconciler. A snapshot still in progress (a pending refund) is no fact yet.

A fact belongs to a claim when the object's metadata names it
(`operation_id` + `step`, else `operation_key` + `step`) and it is that
claim's request (every metadata item, the amount, the currency and, for a
refund, the intent), or else when the claim already carries its reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from payments.engine.effects import EffectResult
from payments.engine.outcomes import Outcome
from payments.models import StepClaim
from payments.provider.client import Event

PAYMENT_INTENT_TYPES = frozenset(
    {"payment_intent.succeeded", "payment_intent.payment_failed", "payment_intent.canceled"}
)
REFUND_TYPES = frozenset({"refund.created", "refund.updated", "refund.failed"})
CHARGE_REFUNDED = "charge.refunded"
#: The event types handled; any other is acknowledged (200) and neither stored nor handled.
HANDLED_TYPES = PAYMENT_INTENT_TYPES | REFUND_TYPES | {CHARGE_REFUNDED}

DECLINED_STATUSES = frozenset({"requires_payment_method", "canceled"})
FAILED_REFUND_STATUSES = frozenset({"failed", "canceled"})


@dataclass(frozen=True)
class Fact:
    """One provider object out of an event: what it is, and what it settles (None: nothing yet)."""

    object_type: str  # payment_intent | refund
    object_id: str
    found: EffectResult | None
    metadata: Mapping[str, str] = field(hash=False)
    amount: int
    currency: str
    payment_intent: str = ""  # a refund's intent


def facts_of(event: Event) -> list[Fact]:
    """Return the facts an event of a handled type carries; raise ValueError if malformed.

    An event of a type not handled carries none.
    """
    obj = dict(event.object)
    if event.type in PAYMENT_INTENT_TYPES:
        return [_intent_fact(obj)]
    if event.type in REFUND_TYPES:
        return [_refund_fact(obj)]
    if event.type == CHARGE_REFUNDED:
        if obj.get("object") != "charge":
            raise ValueError("charge.refunded without a charge")
        refunds = obj.get("refunds")
        listed = refunds.get("data") if isinstance(refunds, dict) else None
        # Without its refunds listed (Stripe's default since 2022-11-15), the
        # refund's own event settles it.
        return [_refund_fact(item) for item in listed or []]
    return []


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
    object_id, metadata, amount, currency = _common(obj, "payment_intent")
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
    return Fact("payment_intent", object_id, found, metadata, amount, currency)


def _refund_fact(obj: Any) -> Fact:
    """Shaped as RefundEffect.find shapes it (payments.refunds.effect)."""
    object_id, metadata, amount, currency = _common(obj, "refund")
    intent = obj.get("payment_intent")
    if isinstance(intent, dict):  # expanded
        intent = intent.get("id")
    if not isinstance(intent, str) or not intent:
        raise ValueError("refund without a payment_intent")
    status = obj["status"]
    data = {"status": status, "amount": amount, "currency": currency, "payment_intent": intent}
    found: EffectResult | None = None
    if status == "succeeded":
        found = EffectResult(Outcome.SUCCESS, reference=object_id, data=data)
    elif status in FAILED_REFUND_STATUSES:
        found = EffectResult(Outcome.PERMANENT, reference=object_id, data=data)
    return Fact("refund", object_id, found, metadata, amount, currency, intent)


def claim_for(fact: Fact) -> StepClaim | None:
    """Return the claim this fact settles (or contradicts), or None when no claim fences it."""
    step = fact.metadata.get("step", "")
    operation_id = fact.metadata.get("operation_id", "")
    operation_key = fact.metadata.get("operation_key", "")
    candidates = StepClaim.objects.none()
    if step and operation_id.isascii() and operation_id.isdigit():
        candidates = StepClaim.objects.filter(operation_id=int(operation_id), step=step)
    elif step and operation_key:
        candidates = StepClaim.objects.filter(operation__key=operation_key, step=step)
    for claim in candidates.select_related("operation").order_by("pk"):
        if is_this_request(claim, fact):
            return claim
    return (
        StepClaim.objects.filter(provider_reference=fact.object_id)
        .select_related("operation")
        .order_by("pk")
        .first()
    )


def is_this_request(claim: StepClaim, fact: Fact) -> bool:
    """Tell whether the fact's object is the one this claim's stored request made.

    Every metadata item the request sent, its amount, currency and (for a
    refund) intent must match: a namesake (another scope's equal key) never
    settles this claim.
    """
    request = claim.request or {}
    sent = request.get("metadata") or {}
    if any(fact.metadata.get(str(name)) != str(value) for name, value in sent.items()):
        return False
    if "amount" in request and int(request["amount"]) != fact.amount:
        return False
    if "currency" in request and str(request["currency"]).lower() != fact.currency.lower():
        return False
    return "payment_intent" not in request or request["payment_intent"] == fact.payment_intent
