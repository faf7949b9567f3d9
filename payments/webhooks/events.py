"""Which claim a system's event belongs to, and what it tells of it.

The facts an event carries are read by its system's `EventSource`
(payments.engine.facts; the provider's is payments.provider.events): this
module names no system. A fact belongs to a claim when the object's metadata
names it (`operation_id` + `step`, else `operation_key` + `step`) and it is
that claim's request (every metadata item, the amount, the currency and the
items the fact `names`), or when the claim carries its reference. An order's
attempts share its first object (a later attempt confirms the payment the
first one made, whose metadata name the first): a first object's fact belongs
to the latest of the attempts (operations of the same kind and entity) that
work on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from payments.engine.effects import EffectResult
from payments.engine.facts import EventSource, Fact
from payments.engine.handlers import registered_handlers
from payments.engine.systems import DEFAULT_SYSTEM, system_named
from payments.exceptions import ConfigurationError
from payments.models import Operation, StepClaim

__all__ = ["Fact", "claim_for", "facts_of", "handled_types", "settled_by", "source"]


def source() -> EventSource:
    """The event reader of the system whose events the endpoint receives (the provider)."""
    events = system_named(DEFAULT_SYSTEM).events
    if events is None:
        raise ConfigurationError(f"system {DEFAULT_SYSTEM!r} declares no event source")
    return events


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


def facts_of(event_type: str, event: Mapping[str, Any]) -> list[Fact]:
    """Return the facts a stored event of a handled type carries; raise ValueError if
    malformed. An event of a type not handled carries none."""
    if event_type not in handled_types():
        return []
    return source().facts(event)


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
    if mine and fact.first_object:
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
    """The claims of later attempts (same kind and entity) that act on the fact's object."""
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

    Every metadata item the request sent, its amount, currency and the items
    the fact names (a refund's payment) must match: a namesake (another scope's
    equal key) never settles this claim.
    """
    request = claim.request or {}
    sent = request.get("metadata") or {}  # a confirm of the order's intent sends none
    if any(fact.metadata.get(str(name)) != str(value) for name, value in sent.items()):
        return False
    if "amount" in request and int(request["amount"]) != fact.amount:
        return False
    if "currency" in request and str(request["currency"]).lower() != fact.currency.lower():
        return False
    return all(str(request[name]) == value for name, value in fact.names.items() if name in request)
