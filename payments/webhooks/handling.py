"""Store provider events, and handle each once behind the inbox.

Why a plain job and not an Operation with a message handler. An event is
already a durable record of its own (`ProviderEvent`, written by the
endpoint before it answers 200): its `handled_at` is the outbox flag, and
`sync_provider_events` re-feeds any row a lost job left unhandled. An
Operation per event would add a second record of the same fact, a lease and
audit rows for a short local transaction, would show every event on the
desk's list of business operations, and its message id would be derived
from the operation's key, while the issue asks for the provider's own event
id as the message id, so that the same event, however it comes (a webhook, a
duplicate delivery, the catch-up list), is one message. So the endpoint
enqueues `payments.webhooks.jobs.handle_provider_event(event_id)` on commit
to the payments queue, and the job runs `handle_event` under
`inbox_guard("provider-events", event_id)`: the claim's settlement, the
operation's move, the event's `handled_at` and the inbox row commit together
or not at all, and a redelivery is skipped ("Skipping message").

A fact about a claim whose owner is alive ("busy": a worker is inside its own
call, or runs the operation) is not handled now: the transaction rolls back
(inbox row included) and the job raises `EventDeferred`, so RQ brings it
again after `RETRY_DELAYS` (longer in all than a claim lease).
"""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone
from rq import Retry

from inbox.handlers import inbox_guard
from payments.conf import payments_settings
from payments.engine import exchanges, fence, recovery
from payments.engine.facts import SystemUnavailable
from payments.engine.outcomes import Outcome
from payments.engine.queues import payments_queue
from payments.exceptions import ConfigurationError
from payments.models import ClaimState, Operation, ProviderEvent
from payments.provider.client import Event
from payments.webhooks.events import Fact, claim_for, facts_of, settled_by, source

logger = logging.getLogger("payments.webhooks")
alerts = logging.getLogger("payments.alerts")

#: The inbox consumer; the message id is the provider's event id.
CONSUMER = "provider-events"
#: The RQ job that handles one stored event.
HANDLE_JOB = "payments.webhooks.jobs.handle_provider_event"
#: Seconds between tries of an event whose claim has a live owner (about 2 min in all).
RETRY_DELAYS = (1, 2, 4, 8, 15, 30, 60)

#: Which outcome of several facts (a charge.refunded with its refunds) names the event.
_WEIGHT = {
    "needs_review": 11,
    "unknown_object": 10,
    "alerted": 9,
    "reversed": 8,
    "unfenced": 7,
    "done": 6,
    "failed": 5,
    "no_handler": 4,
    "stale": 3,
    "already_settled": 2,
    "pending": 1,
    "unmatched": 0,
}


class _Busy(Exception):
    """A fact met a claim with a live owner: roll everything back, try again later."""


def store_event(event: Event, *, enqueue: bool = True) -> tuple[ProviderEvent, bool]:
    """Store a verified event once; return (row, created).

    With `enqueue`, the handling job is enqueued after the commit, for a new
    event and for a stored one not handled yet (its job may have been lost):
    the inbox skips whichever comes second.
    """
    with transaction.atomic():
        row, created = ProviderEvent.objects.get_or_create(
            id=event.id,
            defaults={
                "type": event.type,
                "created": datetime.fromtimestamp(event.created, tz=UTC),
                "payload": dict(event.raw),
                "object_id": str(event.object.get("id") or "")[:255],
            },
        )
        if enqueue and row.handled_at is None:
            transaction.on_commit(functools.partial(enqueue_handling, event.id))
    return row, created


def enqueue_handling(event_id: str) -> None:
    """Enqueue the job that handles a stored event (retried while its claim is busy).

    At the front of the queue, and so are its retries: an event tells of money
    already taken or given back, and must not wait behind a burst of new
    checkouts (the operation it resumes goes first too: `recovery._move`).
    """
    try:
        payments_queue().enqueue(
            HANDLE_JOB,
            event_id,
            job_timeout=payments_settings().job_timeout,
            retry=Retry(max=len(RETRY_DELAYS), interval=list(RETRY_DELAYS), enqueue_at_front=True),
            description=f"provider event {event_id}",
            at_front=True,
        )
    except Exception:  # Redis down: the row is durable; sync_provider_events handles it
        logger.warning(
            "enqueue of provider event %s failed; sync_provider_events will handle it",
            event_id,
            exc_info=True,
        )


def seconds_until_free(event_id: str) -> float | None:
    """Seconds until every lease that keeps the event "busy" has run out, by the database's
    clock: its claims' (claimed, leased) and their operations' (a worker runs them).

    None when no such lease is live (or the event is not stored, or unreadable).
    A worker SIGKILLed in its call leaves its claim leased: the event can
    settle it as soon as the lease runs out, so its job comes back then.
    """
    row = ProviderEvent.objects.filter(pk=event_id).only("type", "payload").first()
    if row is None:
        return None
    try:
        facts = facts_of(row.type, row.payload)
    except ValueError:
        return None
    now = fence.db_now()
    ends: list[datetime | None] = []
    for fact in facts:
        claim = claim_for(fact)
        if claim is None:
            continue
        if claim.state == ClaimState.CLAIMED and claim.lease_expires_at is not None:
            ends.append(claim.lease_expires_at)
        if fence.lease_alive(claim.operation, now):
            ends.append(claim.operation.lease_expires_at)
    live = [end for end in ends if end is not None and end > now]
    return max((end - now).total_seconds() for end in live) if live else None


@exchanges.recorded
def handle_event(event_id: str, *, actor: str) -> str:
    """Handle one stored event once (inbox: consumer provider-events, message id = event id).

    The retrieve of the event's object (what decides, not the event's snapshot) is
    kept on the row that settles a claim, as a worker's call is on its own.

    Returns the outcome: "duplicate" (handled before: skipped), "busy" (a
    claim's owner is alive: nothing changed, bring it again later),
    "missing" (no such stored event), or what its facts did: "done",
    "failed", "already_settled", "stale", "needs_review", "alerted",
    "unfenced", "unmatched", "pending", "ignored", "malformed", "no_handler",
    "reversed" (a done step the provider took back), "unknown_object" (the provider has
    no object by the event's id: nothing moves).
    """
    stored = ProviderEvent.objects.filter(pk=event_id).only("type", "payload", "handled_at").first()
    if stored is None:
        logger.error("provider event %s is not stored; nothing to handle", event_id)
        return "missing"
    try:
        # Retrieved before the transaction opens: none is held across an HTTP call.
        facts = None if stored.handled_at is not None else _current_facts(stored)
    except SystemUnavailable as exc:  # the system cannot say now: nothing moves, try again
        logger.warning(
            "provider event %s: its object could not be retrieved (%s); trying again later",
            event_id,
            str(exc).partition(":")[0],
        )
        ProviderEvent.objects.filter(pk=event_id, handled_at__isnull=True).update(outcome="busy")
        return "busy"
    try:
        with inbox_guard(CONSUMER, event_id) as first:
            if not first:
                return "duplicate"
            row = ProviderEvent.objects.select_for_update().get(pk=event_id)
            if row.handled_at is not None:  # its inbox row was purged since (INBOX_RETENTION)
                logger.info("provider event %s was handled before; skipped", event_id)
                return "duplicate"
            outcome, operation = _apply(row, facts, actor)
            if outcome == "busy":
                raise _Busy
            row.handled_at = timezone.now()
            row.outcome = outcome
            row.operation = operation
            row.save(update_fields=["handled_at", "outcome", "operation"])
    except _Busy:
        ProviderEvent.objects.filter(pk=event_id, handled_at__isnull=True).update(outcome="busy")
        logger.info("provider event %s: a claim's owner is alive; trying again later", event_id)
        return "busy"
    logger.info("provider event %s (%s) handled: %s", event_id, row.type, outcome)
    return outcome


def _current_facts(row: ProviderEvent) -> list[Fact] | None:
    """The event's facts as the system shows them now (None: the event is malformed)."""
    try:
        facts = facts_of(row.type, row.payload)
    except ValueError as exc:  # the endpoint checked it; a listed one may still be odd
        logger.warning("provider event %s is malformed (%s); ignored", row.id, exc)
        return None
    if not facts:
        return []
    events = source()
    return [events.current(fact) for fact in facts]


def _apply(
    row: ProviderEvent, facts: list[Fact] | None, actor: str
) -> tuple[str, Operation | None]:
    """Settle what the event's facts say; return the outcome and the operation it touched."""
    if facts is None:
        return "malformed", None
    if not facts:
        return "ignored", None
    outcomes: list[str] = []
    operation: Operation | None = None
    for fact in facts:
        outcome, touched = _settle(fact, row.id, actor)
        if outcome == "busy":
            return "busy", touched
        outcomes.append(outcome)
        operation = operation or touched
    return max(outcomes, key=lambda name: _WEIGHT.get(name, 0)), operation


def _settle(fact: Fact, event_id: str, actor: str) -> tuple[str, Operation | None]:
    if fact.missing:
        # Signed, yet about an object the provider does not have: forged (a leaked
        # secret) or from another account. It moves nothing.
        alerts.error(
            "provider event %s names %s %s, which the provider does not have; ignored",
            event_id,
            fact.object_type,
            fact.object_id,
        )
        return "unknown_object", None
    claim = claim_for(fact)
    if claim is None:
        if fact.found is not None and fact.found.outcome == Outcome.SUCCESS:
            # What fence_audit reports as unfenced: money taken that no claim carries.
            alerts.error(
                "provider event %s: %s %s succeeded (%s %s, step %s) but no claim fences it: "
                "unfenced %s",
                event_id,
                fact.object_type,
                fact.object_id,
                fact.amount,
                fact.currency,
                fact.metadata.get("step", "-"),
                fact.noun or fact.object_type,
            )
            return "unfenced", None
        logger.info(
            "provider event %s: %s %s matches no claim; ignored",
            event_id,
            fact.object_type,
            fact.object_id,
        )
        return "unmatched", None
    operation = claim.operation
    try:
        found = settled_by(fact, claim)
        if found is None:
            return "pending", operation  # no fact about this claim yet: a later event settles
        outcome = recovery.settle_from_provider(
            claim, found, actor=actor, source=f"provider event {event_id}"
        )
    except (
        ConfigurationError,
        KeyError,
    ):  # a kind no handler declares: the worker parks it for review
        logger.error("provider event %s: operation %s has no handler", event_id, operation.key)
        return "no_handler", operation
    return outcome, operation
