"""A payment's page (an order's, in the desk): its money, its movements, its provider timeline.

What an operator asks of one payment, on one page: how much was asked,
charged and given back; every charge and refund with its provider
reference, state and dashboard link, a duplicate charge in red; and every
request sent to the provider and every event it sent back, oldest first.
The refund button leads to a confirmation (`payments.desk.views.refund`)
that asks the handler which declares refunds (`payments.desk.refund`).

Nothing here knows a business: charges and refunds are the steps whose
effects the fence audit counts as such (`ProviderEffect.AUDITED`), and a
duplicate is a second provider success for the entity (two done charge
steps, or the last fence audit's "double charges per order").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from payments.desk import refund as desk_refund
from payments.desk.display import (
    provider_requests,
    reference_link,
    request_ids,
    state_badge,
    succeeded_at_provider,
    when,
)
from payments.desk.views.queries import first_error_of, not_found_kind
from payments.engine.handlers import get_handler
from payments.exceptions import ConfigurationError
from payments.models import (
    ClaimState,
    FenceAuditRun,
    Operation,
    OperationEvent,
    OperationState,
    ProviderEvent,
    StepClaim,
)
from payments.money import format_money
from payments.provider.client import ProviderClient
from payments.provider.errors import ProviderError

logger = logging.getLogger("payments.admin")

#: What a step's effect counts as at the provider (ProviderEffect.AUDITED).
CHARGE, REFUND = "payment_intent", "refund"
#: A charge the provider showed succeeded that no step recorded done yet (its answer was lost).
AT_PROVIDER = "at the provider, not yet settled"
#: The states of a charge that took the money: recorded done, a provider success outside the
#: fence, or a success the provider showed for a step still unsettled.
CHARGED = frozenset({ClaimState.DONE, "succeeded", AT_PROVIDER})
#: The most rows a timeline shows (the newest are kept; the operations' pages have the rest).
TIMELINE_ROWS = 300


@dataclass
class Movement:
    """One charge or refund of the entity, as its page lists it."""

    what: str  # "charge" or "refund"
    reference: str
    amount: int | None
    currency: str
    state: str
    operation: Operation | None
    step: str
    duplicate: bool = False
    original: bool = False  # the first of duplicate charges: the one the entity kept
    refunded_by: str = ""  # a duplicate's refund operation keys (succeeded or in flight)
    refunded: int = 0  # what those refunds give back of it

    @property
    def refundable(self) -> bool:
        """A later duplicate, of which less than its amount is refunded or being refunded."""
        if not self.duplicate or self.original:
            return False
        return self.amount is None and not self.refunded or (self.amount or 0) > self.refunded

    def refund_words(self) -> str:
        """What was given back of a duplicate and what is left ("" when nothing was)."""
        if not self.refunded:
            return ""
        refunded = format_money(self.refunded, self.currency)
        if self.amount is None:
            return f"{refunded} refunded"
        return (
            f"{refunded} refunded, {format_money(self.amount - self.refunded, self.currency)} left"
        )

    def row(self) -> dict[str, Any]:
        op = self.operation
        return {
            "what": "duplicate charge" if self.duplicate else self.what,
            "duplicate": self.duplicate,
            "refundable": self.refundable,
            "refund_words": self.refund_words(),
            "reference_text": self.reference,
            "reference": reference_link(self.reference),
            "amount": format_money(self.amount, self.currency),
            "state": state_badge(self.state) if self.state in _STATES else self.state,
            "operation": op,
            "operation_url": reverse("admin:payments_operation_change", args=[op.pk]) if op else "",
            "step": self.step or "-",
            "refunded_by": self.refunded_by,
        }


_STATES = {*ClaimState.values, *OperationState.values}


def _audited(kind: str) -> dict[str, str]:
    """Step -> what its effect counts as at the provider ("payment_intent", "refund")."""
    try:
        spec = get_handler(kind)
    except ConfigurationError:
        return {}
    return {step: str(getattr(e, "AUDITED", "")) for step, e in spec.effects.items()}


def _money(op: Operation, claim: StepClaim) -> tuple[int | None, str]:
    """The money a step moved (done) or asks (otherwise), by its effect's reading."""
    effect = get_handler(op.kind).effects.get(claim.step)
    reads = getattr(effect, "money", None)
    moved = reads(claim.result or {}) if reads is not None and claim.result else None
    if moved is not None:
        return moved
    request = claim.request or {}
    amount = request.get("amount", op.params.get("amount"))
    currency = str(request.get("currency") or op.params.get("currency") or "")
    return (int(amount) if isinstance(amount, int) else None), currency


def entity_operations(entity_type: str, entity_id: int | str) -> list[Operation]:
    """Every operation of the entity, oldest first, with its claims."""
    return list(
        Operation.objects.filter(entity_type=entity_type, entity_id=str(entity_id))
        .prefetch_related("claims")
        .order_by("created_at", "pk")
    )


def audit_duplicates(entity_type: str, entity_id: int | str) -> list[str]:
    """The references the last fence audit found charged twice for the entity."""
    run = FenceAuditRun.objects.order_by("-finished_at").first()
    found = (
        run.summary.get("double_charged_entities") if run and isinstance(run.summary, dict) else []
    )
    for item in found or []:
        if isinstance(item, dict) and (item.get("entity_type"), str(item.get("entity_id"))) == (
            entity_type,
            str(entity_id),
        ):
            return [str(r) for r in item.get("references") or []]
    return []


def movements(entity_type: str, entity_id: int | str, ops: list[Operation]) -> list[Movement]:
    """Every charge and refund of the entity; a second provider success is a duplicate."""
    rows: list[Movement] = []
    for op in ops:
        audited = _audited(op.kind)
        for claim in sorted(op.claims.all(), key=lambda c: (c.claimed_at, c.pk)):
            what = {CHARGE: "charge", REFUND: "refund"}.get(audited.get(claim.step, ""))
            # A charge refused before it reached the provider moved nothing; a failed refund
            # is shown (failed), so that the charge it was for reads as not given back.
            unsent = claim.state == ClaimState.FAILED and not claim.provider_reference
            if what is None or what == "charge" and unsent:
                continue
            amount, currency = _money(op, claim)
            state = claim.state if what == "charge" else op.state
            shown = succeeded_at_provider(claim) if what == "charge" else ""
            if shown:  # the money moved; the step is not settled yet: counted, and said so
                state = AT_PROVIDER
                amount, currency = _shown_money(claim, amount, currency)
            rows.append(
                Movement(
                    what, claim.provider_reference or shown, amount, currency, state, op, claim.step
                )
            )
    charged = [m for m in rows if m.what == "charge" and m.state in (ClaimState.DONE, AT_PROVIDER)]
    known = {m.reference for m in rows}
    for reference in audit_duplicates(entity_type, entity_id):
        if reference not in known:
            rows.append(_outside_the_fence(reference))
    charges = [m for m in rows if m.what == "charge" and m.state in CHARGED]
    if len(charges) > 1 or (charged and len(charges) > len(charged)):
        for movement in charges:
            movement.duplicate = True
        charges[0].original = True  # the first success is the payment; the later ones repeat it
    for movement in charges:
        _note_duplicate_refunds(movement, rows)
    return rows


def _note_duplicate_refunds(charge: Movement, rows: list[Movement]) -> None:
    """Add up the duplicate refunds of `charge` that succeeded or are in flight (not failed)."""
    for m in rows:
        op = m.operation
        if m.what != "refund" or op is None or not op.params.get("duplicate"):
            continue
        if str(op.params.get("payment_intent")) != charge.reference:
            continue
        if op.state == OperationState.FAILED:
            continue
        charge.refunded += int(op.params.get("amount") or 0)
        charge.refunded_by = ", ".join(filter(None, (charge.refunded_by, op.key)))


def _shown_money(claim: StepClaim, amount: int | None, currency: str) -> tuple[int | None, str]:
    """The amount the provider showed for the step, else the one it asked."""
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    shown = view.get("amount")
    if isinstance(shown, int):
        return shown, str(view.get("currency") or currency)
    return amount, currency


def _outside_the_fence(reference: str) -> Movement:
    """A provider success no step recorded: asked at the provider for its amount and state."""
    try:
        with ProviderClient.from_settings() as client:
            intent = client.retrieve_payment_intent(reference)
        return Movement(
            "charge", reference, intent.amount, intent.currency, intent.status, None, ""
        )
    except ProviderError as exc:  # the page still shows the reference, and why no amount
        logger.warning("could not look up %s: %s", reference, type(exc).__name__)
        return Movement(
            "charge", reference, None, "", f"not looked up ({type(exc).__name__})", None, ""
        )


def money_summary(order: Any, rows: list[Movement]) -> dict[str, str]:
    """Amount asked, charged (every success, duplicates too, and those the provider showed
    for steps not settled yet), refunded and net, formatted."""
    currency = order.currency
    charged = sum(m.amount or 0 for m in rows if m.what == "charge" and m.state in CHARGED)
    unsettled = sum(m.amount or 0 for m in rows if m.what == "charge" and m.state == AT_PROVIDER)
    refunded = sum(
        int(m.operation.params.get("amount") or 0)
        for m in rows
        if m.what == "refund" and m.operation and m.operation.state == OperationState.SUCCEEDED
    )
    return {
        "amount": format_money(order.amount, currency),
        "charged": format_money(charged, currency),
        # Of which the provider showed succeeded for steps not settled yet ("" when none).
        "charged_at_provider": format_money(unsettled, currency) if unsettled else "",
        "refunded": format_money(refunded, currency),
        "net": format_money(charged - refunded, currency),
    }


def timeline(ops: list[Operation]) -> list[dict[str, Any]]:
    """Every provider request (claims and their audit rows) and provider event, oldest first.

    An audit row shows the requests behind it (HTTP status, request id); a step's last
    lookup that changed nothing, only in its provider view, is a row of its own.
    """
    by_id = {op.pk: op for op in ops}
    entries: list[tuple[datetime, int, dict[str, Any]]] = []
    requests: dict[int, dict[str, StepClaim]] = {}
    claimers = _claimers(list(by_id))
    for op in ops:
        # Provider requests only: a local step (an invoice, an e-mail) sends none.
        requests[op.pk] = {c.step: c for c in op.claims.all() if c.idempotency_key}
        for claim in requests[op.pk].values():
            keyed = {"operation": op, "step": claim.step, "key": claim.idempotency_key}
            # Who claimed it and sent the first request: its claim's audit row (the claim's
            # claimed_by names its current owner, a reconciler or an operator who took it).
            who = claimers.get((op.pk, claim.step), claim.claimed_by)
            entries.append(
                (claim.claimed_at, 0, {**keyed, "what": "claimed", "outcome": "claimed, then sent",
                                      "who": who})
            )  # fmt: skip
            if claim.last_request_at and claim.last_request_at != claim.claimed_at:
                entries.append(
                    (claim.last_request_at, 1, {**keyed, "what": "last request",
                     "outcome": f"request {claim.attempts} under this key", "who": claim.claimed_by})
                )  # fmt: skip
    steps = {step for claims in requests.values() for step in claims}
    events = (
        OperationEvent.objects.filter(operation__in=list(by_id), step__in=steps).exclude(
            reason="claimed"
        )  # the claim's own row says it
    )
    audited: set[str] = set()  # request ids an audit row shows
    # The newest rows are kept: read newest first, then put back in order (the sort below).
    for event in events.order_by("-created_at", "-id")[:TIMELINE_ROWS]:
        op = by_id[event.operation_id]
        step_claim = requests[op.pk].get(event.step)
        if step_claim is None:
            continue  # a local step of the same name in another operation
        audited |= request_ids(event.requests)
        entries.append(
            (event.created_at, 2, {"operation": op, "step": event.step, "what": "outcome",
             "key": step_claim.idempotency_key if step_claim else "", "who": event.actor,
             "outcome": f"{event.from_state or '-'} → {event.to_state}: {event.reason}".rstrip(": "),
             "requests": provider_requests(event.requests)})
        )  # fmt: skip
    for op in ops:
        for claim in requests[op.pk].values():
            entries.extend(_last_lookup(op, claim, audited))
    provider_events = ProviderEvent.objects.filter(operation__in=list(by_id))
    for pe in provider_events.order_by("-created", "-id")[:TIMELINE_ROWS]:
        entries.append(
            (pe.created, 3, {"operation": by_id.get(pe.operation_id or 0), "step": "",
             "what": f"provider event {pe.type}", "key": pe.id, "who": "the provider",
             "outcome": f"{pe.object_id}: {pe.outcome or 'not handled yet'}"})
        )  # fmt: skip
    entries.sort(key=lambda e: (e[0], e[1]))
    return [
        {**entry, "when": when(at), "at": at.isoformat(), "op_url": _op_url(entry["operation"])}
        for at, _, entry in entries[-TIMELINE_ROWS:]
    ]


def _claimers(operation_ids: list[int]) -> dict[tuple[int, str], str]:
    """(operation id, step) -> the actor of the step's first claim row."""
    rows = (
        OperationEvent.objects.filter(operation__in=operation_ids, reason="claimed")
        .exclude(step="")
        .order_by("-created_at", "-id")
        .values_list("operation_id", "step", "actor")
    )
    return {(op_id, step): actor for op_id, step, actor in rows}  # the oldest written last


def _last_lookup(
    op: Operation, claim: StepClaim, audited: set[str]
) -> list[tuple[datetime, int, dict[str, Any]]]:
    """The claim's last lookup as a timeline row, when its requests are on no audit row."""
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    sent = view.get("requests")
    ids = request_ids(sent)
    if not sent or (ids and ids <= audited):
        return []
    try:
        at = datetime.fromisoformat(str(view.get("checked_at")))
    except ValueError:
        return []
    status = view.get("status") or view.get("outcome") or "-"
    return [
        (at, 2, {"operation": op, "step": claim.step, "what": "look-up",
         "key": claim.idempotency_key, "who": view.get("actor") or view.get("source") or "-",
         "outcome": f"{view.get('source') or 'lookup'}: {status} {view.get('reference') or ''}".strip(),
         "requests": provider_requests(sent)})
    ]  # fmt: skip


def errors_shown(op: Operation) -> str:
    """The operation's last error; beside it the first one, and which "not found" it is."""
    first = first_error_of(op)
    kind = not_found_kind(first, op.last_error)
    if not first or first == op.last_error:
        return format_html('<span class="desk-last-error">{}</span>', op.last_error)
    return format_html(
        '<span class="desk-last-error">{}</span>{}<br><small class="desk-first-error">'
        "first error: {}</small>",
        op.last_error,
        format_html('<br><strong class="desk-not-found-kind">Not found: {}.</strong>', kind)
        if kind
        else "",
        first,
    )


def _op_url(op: Operation | None) -> str:
    return reverse("admin:payments_operation_change", args=[op.pk]) if op is not None else ""


def payment_context(request: HttpRequest, order: Any) -> dict[str, Any]:
    """What the order's page shows beside its fields."""
    ops = entity_operations("order", order.pk)
    rows = movements("order", order.pk, ops)
    may_refund = request.user.has_perm(desk_refund.refund_permission("order"))
    refund_url = reverse("admin:payments_order_refund", args=[order.pk])
    return {
        "money": money_summary(order, rows),
        "movements": [m.row() for m in rows],
        "has_duplicate": any(m.duplicate for m in rows),
        "duplicate_open": any(m.refundable for m in rows),
        "timeline": timeline(ops),
        "refund_url": refund_url if desk_refund.refund_hook("order") is not None else "",
        "may_refund": may_refund,
        "refund_refused": desk_refund.refund_refused("order", order.pk),
        "refund_permission": desk_refund.refund_permission("order"),
    }
