"""What a provider event says, as facts the fence understands, and the claim each belongs to.

An event is a notification, not evidence: it carries a snapshot of one
provider object as it was, and a leaked signing secret can make one up. So
before a fact settles or moves anything, the object it names is retrieved
from the provider by id (`current`), and the retrieved state decides; an
object the provider does not have moves nothing.

An event carries a snapshot of one provider object. A payment intent that
succeeded, or was declined, and a refund that succeeded or failed, are
*facts*: an `EffectResult` (SUCCESS with the reference, or PERMANENT) shaped
like the one the step's own lookup (`effect.find`) would return, so a claim
settled from an event carries the same result as one settled by the
reconciler. A snapshot still in progress (a pending refund) is no fact yet.

A fact belongs to a claim when the object's metadata names it
(`operation_id` + `step`, else `operation_key` + `step`) and it is that
claim's request (every metadata item, the amount, the currency and the
intent), or when the claim carries its reference. An order's attempts share
its PaymentIntent (a later attempt confirms the intent the first one made,
whose metadata name the first): an intent's fact belongs to the latest of the
attempts (operations of the same kind and entity) that work on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from payments.engine.effects import EffectResult
from payments.engine.handlers import registered_handlers
from payments.engine.outcomes import Outcome
from payments.models import Operation, StepClaim
from payments.provider.client import Event, PaymentIntent, ProviderClient, Refund
from payments.provider.errors import ResourceMissing

CHARGE_REFUNDED = "charge.refunded"

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
    payment_intent: str = ""  # the intent itself, or a refund's intent
    #: The provider has no such object (retrieved by id): the event moves nothing.
    missing: bool = False
    #: The event's type: only the steps whose effect declares it (`EVENTS`) may be settled.
    event_type: str = ""
    #: The object as retrieved from the provider (`current`); the claim's effect reads it.
    obj: Any = field(default=None, hash=False, compare=False)


def handled_types() -> frozenset[str]:
    """The event types some registered effect declares (`ProviderEffect.EVENTS`).

    Any other is acknowledged (200) and neither stored nor handled. A new
    operation's effects bring their own: nothing here names them.
    """
    types: set[str] = set()
    for spec in registered_handlers().values():
        for effect in spec.effects.values():
            types |= set(getattr(effect, "EVENTS", ()))
    return frozenset(types)


def effect_class(claim: StepClaim) -> Any:
    """The effect class of a claim's step, or None (no handler, or not an external step)."""
    spec = registered_handlers().get(claim.operation.kind)
    return None if spec is None else spec.effects.get(claim.step)


def facts_of(event: Event) -> list[Fact]:
    """Return the facts an event of a handled type carries; raise ValueError if malformed.

    An event of a type not handled carries none.
    """
    obj = dict(event.object)
    if event.type not in handled_types():
        return []
    if event.type == CHARGE_REFUNDED:
        if obj.get("object") != "charge":
            raise ValueError("charge.refunded without a charge")
        refunds = obj.get("refunds")
        listed = refunds.get("data") if isinstance(refunds, dict) else None
        # Without its refunds listed (Stripe's default since 2022-11-15), the
        # refund's own event settles it.
        facts = [_refund_fact(item) for item in listed or []]
    elif event.type.startswith("payment_intent."):
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
    return Fact("payment_intent", object_id, found, metadata, amount, currency, object_id)


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


def current(fact: Fact, client: ProviderClient) -> Fact:
    """The fact as the provider shows it now: its object retrieved by id.

    Provider errors other than "no such object" propagate (try again later).
    """
    try:
        if fact.object_type == "payment_intent":
            intent = client.retrieve_payment_intent(fact.object_id)
            now = _intent_fact(_intent_json(intent))
            return replace(now, event_type=fact.event_type, obj=intent)
        refund = client.retrieve_refund(fact.object_id)
        return replace(_refund_fact(_refund_json(refund)), event_type=fact.event_type, obj=refund)
    except (ResourceMissing, ValueError):
        return Fact(
            fact.object_type,
            fact.object_id,
            None,
            fact.metadata,
            fact.amount,
            fact.currency,
            fact.payment_intent,
            missing=True,
            event_type=fact.event_type,
        )


def _intent_json(intent: PaymentIntent) -> dict[str, Any]:
    error = {"code": intent.last_error_code} if intent.last_error_code else None
    return {
        "object": "payment_intent",
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
        "payment_intent": refund.payment_intent,
        "metadata": dict(refund.metadata),
    }


def claim_for(fact: Fact) -> StepClaim | None:
    """Return the claim this fact settles (or contradicts), or None when no claim fences it.

    Candidates: the claim the object's metadata names (when it is that claim's
    request), the later attempts that confirm the same intent, a claim that
    carries the object's reference, and the later steps of the named claim's
    operation that act on the object (a capture or a release names its
    intent). Of those, only steps whose effect declares the event's type; the
    latest wins.
    """
    step = fact.metadata.get("step", "")
    operation_id = fact.metadata.get("operation_id", "")
    operation_key = fact.metadata.get("operation_key", "")
    named = StepClaim.objects.none()
    if step and operation_id.isascii() and operation_id.isdigit():
        named = StepClaim.objects.filter(operation_id=int(operation_id), step=step)
    elif step and operation_key:
        named = StepClaim.objects.filter(operation__key=operation_key, step=step)
    mine = [claim for claim in named.select_related("operation") if is_this_request(claim, fact)]
    if mine and fact.object_type == "payment_intent":
        mine += _later_attempts(mine[0], fact) + _acting_on(mine[0], fact)
    mine += StepClaim.objects.filter(provider_reference=fact.object_id).select_related("operation")
    if fact.event_type:
        mine = [claim for claim in mine if fact.event_type in _events_of(claim)]
    return max(mine, key=lambda claim: claim.pk, default=None)


def _events_of(claim: StepClaim) -> frozenset[str]:
    effect = effect_class(claim)
    return frozenset(getattr(effect, "EVENTS", ())) if effect is not None else frozenset()


def _acting_on(first: StepClaim, fact: Fact) -> list[StepClaim]:
    """The operation's other steps whose request names the fact's object as their target."""
    others = StepClaim.objects.filter(operation_id=first.operation_id).exclude(pk=first.pk)
    found = []
    for claim in others.select_related("operation"):
        target = getattr(effect_class(claim), "TARGET", "")
        if target and (claim.request or {}).get(target) == fact.object_id:
            found.append(claim)
    return found


def _later_attempts(first: StepClaim, fact: Fact) -> list[StepClaim]:
    """The claims of later attempts (same kind and entity) that confirm the fact's intent."""
    op: Operation = first.operation
    attempts = StepClaim.objects.filter(
        step=first.step,
        operation__kind=op.kind,
        operation__entity_type=op.entity_type,
        operation__entity_id=op.entity_id,
        pk__gt=first.pk,
    ).select_related("operation")
    return [claim for claim in attempts if is_this_request(claim, fact)]


def settled_by(fact: Fact, claim: StepClaim) -> EffectResult | None:
    """What the fact tells of this claim, as the claim's own effect reads the object: None
    when it tells nothing yet (in progress, or a state that does not decide this request)."""
    effect: Any = registered_handlers()[claim.operation.kind].effect(claim.step, claim.operation)
    if fact.obj is None or not hasattr(effect, "outcome"):
        return fact.found
    if not effect.decides(fact.obj, claim.request or {}):
        return None
    return effect.outcome(fact.obj)


def is_this_request(claim: StepClaim, fact: Fact) -> bool:
    """Tell whether the fact's object is the one this claim's stored request made.

    Every metadata item the request sent, its amount, currency and (for a
    refund) intent must match: a namesake (another scope's equal key) never
    settles this claim.
    """
    request = claim.request or {}
    sent = request.get("metadata") or {}  # a confirm of the order's intent sends none
    if any(fact.metadata.get(str(name)) != str(value) for name, value in sent.items()):
        return False
    if "amount" in request and int(request["amount"]) != fact.amount:
        return False
    if "currency" in request and str(request["currency"]).lower() != fact.currency.lower():
        return False
    return "payment_intent" not in request or request["payment_intent"] == fact.payment_intent
