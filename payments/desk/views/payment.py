"""A payment's page (an order's, in the desk): its money, its movements, its provider timeline.

What an operator asks of one payment, on one page: how much was asked,
charged and given back; every charge and refund with its provider
reference, state and dashboard link, a duplicate charge in red; and every
request sent to the provider and every event it sent back, oldest first.
The refund button leads to a confirmation (`payments.desk.views.refund`)
that asks the handler which declares refunds (`payments.desk.refund`).

Nothing here knows a business: charges and refunds are the steps whose
effects the fence audit counts as such (`ProviderEffect.AUDITED`), a hold on
the card and its release are the steps whose effects declare `HOLD`, and a
duplicate is a second provider success for the entity (two done charge
steps, or the last fence audit's "double charges per order").

The page is read at one moment (`one_moment`: one read-only snapshot): its
Money box, rows and timeline never mix the states before and after a worker's
commit. What is not settled yet is counted apart and said so: a refund in
flight, money the provider showed for a step not recorded yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
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
from payments.engine.effects import reversal_step
from payments.engine.handlers import get_handler, registered_handlers
from payments.engine.outcomes import Outcome
from payments.engine.systems import reference_system
from payments.exceptions import ConfigurationError
from payments.models import (
    UNSETTLED_CLAIM_STATES,
    ClaimState,
    FenceAuditRun,
    Operation,
    OperationEvent,
    OperationState,
    ProviderEvent,
    StepClaim,
)
from payments.money import format_money

logger = logging.getLogger("payments.admin")

#: What a step's effect counts as at the provider (ProviderEffect.AUDITED).
CHARGE, REFUND = "payment", "refund"
#: A charge the provider showed succeeded that no step recorded done yet (its answer was lost).
AT_PROVIDER = "at the provider, not yet settled"
#: A done step the provider took back since (a refund that failed after it succeeded: the
#: handler's on_reversal undid its writes): it moved nothing in the end.
REVERSED = "reversed by the provider: nothing moved in the end"
#: The states of a charge that took the money: recorded done, a provider success outside the
#: fence, or a success the provider showed for a step still unsettled.
CHARGED = frozenset({ClaimState.DONE, "succeeded", AT_PROVIDER})
#: The most rows a timeline shows (the newest are kept; the operations' pages have the rest).
TIMELINE_ROWS = 300
#: The states an operation ends in: a refund in any other is not settled yet.
FINAL = frozenset({OperationState.SUCCEEDED, OperationState.FAILED})
#: What a step does to a hold on the card (its effect's `HOLD`): makes, captures, releases it.
HOLD, CAPTURES, RELEASES = "hold", "capture", "release"
#: Every read of the page in one snapshot, read only: what it shows was true at one moment.
ONE_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


@contextmanager
def one_moment() -> Iterator[None]:
    """Make the block's reads one moment's: a read-only REPEATABLE READ transaction.

    Opens the transaction; inside one already (a test's, or a caller that reads more of the
    page at the same moment) the block's reads are that transaction's. Send no provider
    request inside: no transaction is held across an HTTP call.
    """
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(ONE_SNAPSHOT)
        yield


@dataclass
class Movement:
    """One charge or refund of the entity, as its page lists it."""

    what: str  # "charge", "refund", "hold" or "release"
    reference: str
    amount: int | None
    currency: str
    state: str
    operation: Operation | None
    step: str
    note: str = ""  # after the state: what became of a hold ("captured €45.00")
    held_words: str = ""  # a hold in the Money box ("€45.00 captured, €15.00 released")
    shown_succeeded: bool = False  # a refund or hold the provider showed done, not settled
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
            "note": self.note,
            "operation": op,
            "operation_url": reverse("admin:payments_operation_change", args=[op.pk]) if op else "",
            "step": self.step or "-",
            "refunded_by": self.refunded_by,
        }


_STATES = {*ClaimState.values, *OperationState.values}


def _declared(kind: str, name: str) -> dict[str, str]:
    """Step -> its effect's declaration `name`: AUDITED (what it counts as at the provider:
    "payment", "refund") or HOLD (what it does to a hold: "hold", "capture", ...)."""
    try:
        spec = get_handler(kind)
    except ConfigurationError:
        return {}
    return {step: str(getattr(e, name, "")) for step, e in spec.effects.items()}


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
    """The references the last fence audit found charged twice for the entity, whether the
    double charge is still open or its extra charge was refunded in full since."""
    run = FenceAuditRun.objects.order_by("-finished_at").first()
    summary = run.summary if run and isinstance(run.summary, dict) else {}
    found = [
        *(summary.get("double_charged_entities") or []),
        *(summary.get("refunded_in_full_entities") or []),
    ]
    for item in found:
        if isinstance(item, dict) and (item.get("entity_type"), str(item.get("entity_id"))) == (
            entity_type,
            str(entity_id),
        ):
            return [str(r) for r in item.get("references") or []]
    return []


def movements(entity_type: str, entity_id: int | str, ops: list[Operation]) -> list[Movement]:
    """Every charge, refund, hold and release of the entity; a second provider success is a
    duplicate."""
    return with_duplicates(fenced_movements(ops), audit_duplicates(entity_type, entity_id))


def fenced_movements(ops: list[Operation]) -> list[Movement]:
    """What the operations' steps moved or asked, as recorded (no provider request)."""
    rows: list[Movement] = []
    for op in ops:
        audited, roles = _declared(op.kind, "AUDITED"), _declared(op.kind, "HOLD")
        claims = sorted(op.claims.all(), key=lambda c: (c.claimed_at, c.pk))
        moved = [m for m in (_movement(op, c, audited.get(c.step, "")) for c in claims) if m]
        capture = next((m for m in moved if roles.get(m.step) == CAPTURES), None)
        hold, released = _hold(op, claims, roles, capture)
        rows += [*hold, *moved, *released, *_refunds_asked(op, audited, claims)]
    return rows


def _movement(op: Operation, claim: StepClaim, audited: str) -> Movement | None:
    """The charge or refund a step made or asked; None for a step that moves no money."""
    what = {CHARGE: "charge", REFUND: "refund"}.get(audited)
    # A charge refused before it reached the provider moved nothing; a failed refund
    # is shown (failed), so that the charge it was for reads as not given back.
    unsent = claim.state == ClaimState.FAILED and not claim.provider_reference
    if what is None or what == "charge" and unsent:
        return None
    amount, currency = _money(op, claim)
    state = claim.state if what == "charge" else op.state
    shown = _shown_succeeded(claim)
    if shown:  # the money moved; the step is not settled yet: counted, and said so
        amount, currency = _shown_money(claim, amount, currency)
    if shown and what == "charge":
        state = AT_PROVIDER
    if any(c.step == reversal_step(claim.step) for c in op.claims.all()):
        state = REVERSED  # the claim stays done (it happened), the money came back
    reference = claim.provider_reference or succeeded_at_provider(claim)
    row = Movement(what, reference, amount, currency, state, op, claim.step)
    row.shown_succeeded = (
        what == "refund" and state != REVERSED and (claim.state == ClaimState.DONE or shown)
    )
    return row


def _shown_succeeded(claim: StepClaim) -> bool:
    """Whether the provider's last look showed this step succeeded, not recorded done yet."""
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    return claim.state != ClaimState.DONE and (
        view.get("outcome") == Outcome.SUCCESS or view.get("status") == "succeeded"
    )


def _refunds_asked(
    op: Operation, audited: dict[str, str], claims: list[StepClaim]
) -> list[Movement]:
    """A refund asked whose step nobody claimed yet (pending, retrying): listed, not settled."""
    if op.state in FINAL:
        return []
    claimed = {c.step for c in claims}
    amount, currency = op.params.get("amount"), str(op.params.get("currency") or "")
    return [
        Movement("refund", "", amount if isinstance(amount, int) else None, currency, op.state,
                 op, step)
        for step, counts_as in audited.items()
        if counts_as == REFUND and step not in claimed
    ]  # fmt: skip


def _hold(
    op: Operation, claims: list[StepClaim], roles: dict[str, str], captured: Movement | None
) -> tuple[list[Movement], list[Movement]]:
    """The hold the operation's steps made on the card, and what of it was released.

    ([the hold], [its release]): a capture of part releases the rest; a release step
    cancels it whole. The hold's state is its step's; its note says what became of it.
    """
    steps = {roles[c.step]: c for c in claims if roles.get(c.step)}
    hold, release = steps.get(HOLD), steps.get(RELEASES)
    if hold is None or hold.state == ClaimState.FAILED and not hold.provider_reference:
        return [], []
    amount, currency = _held(op, hold)
    row = Movement("hold", hold.provider_reference, amount, currency, hold.state, op, hold.step)
    money = format_money(amount, currency)
    released: list[Movement] = []
    if release is not None:  # a release step cancels the whole hold
        released.append(
            Movement("release", hold.provider_reference, amount, currency, release.state, op,
                     release.step, note=_RELEASE_WORDS.get(release.state, "not settled yet"))
        )  # fmt: skip
    taken = format_money(captured.amount, currency) if captured is not None else ""
    row.shown_succeeded = _shown_succeeded(hold)
    if row.shown_succeeded:  # the provider showed the hold made; its step is not settled yet
        row.note = "held at the provider, not settled yet"
        row.held_words = f"{money} {row.note}"
    elif hold.state != ClaimState.DONE:
        row.note = "nothing held" if hold.state == ClaimState.FAILED else "not settled yet"
        row.held_words = f"{money} asked, {row.note}"
    elif release is not None and release.state == ClaimState.DONE:
        row.note, row.held_words = "released", f"{money} released"
    elif captured is not None and captured.state == ClaimState.DONE:
        rest = (amount or 0) - (captured.amount or 0)
        row.note = f"captured {taken}"
        row.held_words = f"{taken} captured" + (
            f", {format_money(rest, currency)} released" if rest > 0 else ""
        )
        if rest > 0:  # the provider released the rest when the capture took part of it
            released.append(
                Movement("release", hold.provider_reference, rest, currency, ClaimState.DONE, op,
                         captured.step, note="the rest, released by the capture")
            )  # fmt: skip
    elif captured is not None and captured.state == AT_PROVIDER:
        row.note = f"captured {taken} at the provider, not settled yet"
        row.held_words = f"{taken} captured at the provider, not settled yet"
    elif release is not None and release.state in UNSETTLED_CLAIM_STATES:
        row.note = "held, its release not settled yet"
        row.held_words = "not released yet (its release is not settled)"
    elif captured is not None and captured.state in UNSETTLED_CLAIM_STATES:
        row.note = "held, its capture not settled yet"
        row.held_words = "not captured yet (its capture is not settled)"
    else:
        row.note, row.held_words = "held, not captured yet", "not captured yet"
    return [row], released


#: A release step's state in words, beside its badge.
_RELEASE_WORDS: dict[str, str] = {
    ClaimState.DONE: "the whole hold",
    ClaimState.FAILED: "refused: nothing released",
}


def _held(op: Operation, claim: StepClaim) -> tuple[int | None, str]:
    """What a hold step holds (its effect's `held` reading), else the amount it asks."""
    effect = get_handler(op.kind).effects.get(claim.step)
    reads = getattr(effect, "held", None)
    held = reads(claim.result or {}) if reads is not None and claim.result else None
    return held if held is not None else _money(op, claim)


def with_duplicates(rows: list[Movement], duplicates: list[str]) -> list[Movement]:
    """Add the audit's duplicate charges no step recorded (asked at the provider: call it
    outside any transaction) and mark every duplicate charge and its refunds."""
    charged = [m for m in rows if m.what == "charge" and m.state in (ClaimState.DONE, AT_PROVIDER)]
    known = {m.reference for m in rows}
    for reference in duplicates:
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
        if desk_refund.refunded_payment(op) != charge.reference:
            continue
        if op.state == OperationState.FAILED or m.state == REVERSED:
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
    """A success no step recorded: asked at its system (its declared `describe`) for its
    amount and state."""
    system = reference_system(reference)
    try:
        found = system.describe(reference) if system and system.describe else None
        if found is None:
            return Movement("charge", reference, None, "", "not looked up", None, "")
        return Movement("charge", reference, found.amount, found.currency, found.status, None, "")
    except Exception as exc:  # the page still shows the reference, and why no amount
        logger.warning("could not look up %s: %s", reference, type(exc).__name__)
        return Movement(
            "charge", reference, None, "", f"not looked up ({type(exc).__name__})", None, ""
        )


def money_summary(order: Any, rows: list[Movement]) -> dict[str, str]:
    """Amount asked, charged (every success, duplicates too, and those the provider showed
    for steps not settled yet), refunded (operations succeeded) and net, formatted; beside
    them the refunds not settled yet and the holds, each with what became of it. A step the
    provider reversed since counts as neither charged nor refunded."""
    currency = order.currency
    charged = sum(m.amount or 0 for m in rows if m.what == "charge" and m.state in CHARGED)
    unsettled = sum(m.amount or 0 for m in rows if m.what == "charge" and m.state == AT_PROVIDER)
    refunds = [(m, m.operation) for m in rows if m.what == "refund" and m.operation is not None]
    refunded = sum(
        int(op.params.get("amount") or 0)
        for m, op in refunds
        if op.state == OperationState.SUCCEEDED and m.state != REVERSED
    )
    waiting = [m for m, op in refunds if op.state not in FINAL and m.state != REVERSED]
    shown = sum(m.amount or 0 for m in waiting if m.shown_succeeded)
    holds = [m for m in rows if m.what == "hold"]
    held = sum(m.amount or 0 for m in holds if m.state == ClaimState.DONE or m.shown_succeeded)
    return {
        "amount": format_money(order.amount, currency),
        "charged": format_money(charged, currency),
        # Of which the provider showed succeeded for steps not settled yet ("" when none).
        "charged_at_provider": format_money(unsettled, currency) if unsettled else "",
        "refunded": format_money(refunded, currency),
        # Refunds whose operation has not ended, and what of them the provider showed done.
        "refunds_not_settled": (
            format_money(sum(m.amount or 0 for m in waiting), currency) if waiting else ""
        ),
        "refunds_shown_succeeded": format_money(shown, currency) if shown else "",
        "net": format_money(charged - refunded, currency),
        "held": format_money(held, currency) if holds else "",
        "held_words": "; ".join(m.held_words for m in holds),
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
    """(operation id, step) -> the actor of the step's claim row: its insert's audit row,
    the newest where one was withdrawn before (fence.withdraw_claim) and claimed again."""
    rows = (
        OperationEvent.objects.filter(operation__in=operation_ids, reason="claimed")
        .exclude(step="")
        .order_by("created_at", "id")
        .values_list("operation_id", "step", "actor")
    )
    return {(op_id, step): actor for op_id, step, actor in rows}  # the newest written last


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
    first_error = first_error_of(op)
    kind, first = not_found_kind(first_error, op.last_error), first_error.text
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
    """What the order's page shows beside its fields, read at one moment.

    The operations, their steps, the audit's findings, the timeline and the refund's
    refusal come from one snapshot: a worker committing meanwhile shows on the next
    reading, never on half of this one. A duplicate no step recorded is asked at the
    provider after it.
    """
    with one_moment():
        read_at = timezone.now()
        ops = entity_operations("order", order.pk)
        fenced = fenced_movements(ops)
        duplicates = audit_duplicates("order", order.pk)
        provider_timeline = timeline(ops)
        refused = desk_refund.refund_refused("order", order.pk)
    rows = with_duplicates(fenced, duplicates)
    may_refund = request.user.has_perm(desk_refund.refund_permission("order"))
    refund_url = reverse("admin:shop_order_refund", args=[order.pk])
    return {
        "read_at": when(read_at),
        "money": money_summary(order, rows),
        "movements": [m.row() for m in rows],
        "has_duplicate": any(m.duplicate for m in rows),
        "duplicate_open": any(m.refundable for m in rows),
        "timeline": provider_timeline,
        "refund_url": refund_url if desk_refund.refund_hook("order") is not None else "",
        "may_refund": may_refund,
        "refund_refused": refused,
        "refund_permission": desk_refund.refund_permission("order"),
        # Operations whose kind lost its handler: their steps' money cannot be read.
        "not_counted": [
            {"key": op.key, "kind": op.kind, "url": _op_url(op)}
            for op in ops
            if op.kind not in registered_handlers()
        ],
    }
