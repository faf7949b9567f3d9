"""Catch up on provider events the endpoint missed: list them and feed them through the same path.

The provider keeps its events listed (`GET /v1/events`) long after it gave up
pushing them. `sync_events` reads those created in a window, oldest first,
stores the ones of handled types (`store_event`, as the endpoint does) and
handles each at once behind the inbox (`handle_event`): an event handled
before is skipped ("Skipping message"), so running it twice, or beside the
webhooks, changes nothing twice. Stored events whose job was lost (Redis
down at the enqueue) are handled too.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

from django.utils import timezone

from payments.engine import fence
from payments.models import ProviderEvent
from payments.provider.client import ProviderClient
from payments.webhooks.events import facts_of, handled_types
from payments.webhooks.handling import enqueue_handling, handle_event, store_event

logger = logging.getLogger("payments.webhooks")


@dataclass
class SyncReport:
    listed: int = 0
    stored: int = 0  # new rows (missed deliveries)
    not_handled_types: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)


def sync_events(
    *, since: timedelta, client: ProviderClient | None = None, actor: str | None = None
) -> SyncReport:
    """List the provider's events of the last `since` and handle those not handled yet."""
    actor = actor or fence.process_actor("provider-events-sync", os.getpid())
    client = client or ProviderClient.from_settings()
    start = timezone.now() - since
    report = SyncReport()
    listed = list(client.list_events(created_gte=int(start.timestamp())))
    listed.reverse()  # the list is newest first; feed them in the provider's order
    listed.sort(key=lambda event: event.created)
    seen = set()
    for event in listed:
        report.listed += 1
        seen.add(event.id)
        if event.type not in handled_types():
            report.not_handled_types += 1
            continue
        try:
            facts_of(event.type, event.raw)
        except ValueError as exc:
            logger.warning("listed provider event %s is malformed (%s); skipped", event.id, exc)
            report.outcomes["malformed"] += 1
            continue
        _, created = store_event(event, enqueue=False)
        report.stored += created
        _handle(event.id, actor, report)
    left = (
        ProviderEvent.objects.filter(handled_at__isnull=True, received_at__gte=start)
        .exclude(id__in=seen)
        .order_by("created", "id")
        .values_list("id", flat=True)
    )
    for event_id in left:
        _handle(event_id, actor, report)
    return report


def _handle(event_id: str, actor: str, report: SyncReport) -> None:
    outcome = handle_event(event_id, actor=actor)
    if outcome == "busy":
        enqueue_handling(event_id)  # a claim's owner is alive: the job tries again later
    report.outcomes[outcome] += 1
