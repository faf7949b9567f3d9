"""RQ entry point: handle one stored provider event behind the inbox."""

from __future__ import annotations

import os
from typing import Any

from rq import get_current_job

from payments.engine import fence
from payments.exceptions import MalformedJob
from payments.webhooks.handling import handle_event


class EventDeferred(Exception):
    """A claim the event settles has a live owner: RQ brings the event again later."""


def handle_provider_event(event_id: str) -> str:
    """Handle one stored event; raise EventDeferred while a claim's owner is alive."""
    job = get_current_job()
    if not isinstance(event_id, str) or not event_id:
        if job is not None:
            job.retries_left = 0
        raise MalformedJob(f"takes an event id, got {type(event_id).__name__}")
    outcome = handle_event(event_id, actor=_actor(job))
    if outcome == "busy":
        raise EventDeferred(f"provider event {event_id}: a claim's owner is alive")
    return outcome


def _actor(job: Any) -> str:
    """The owner of the claims this job takes over: unique to the worker process and role.

    Not the worker's own id: a claim that this very worker left behind (its job
    was cut off mid-call) must not look like the event handler's own.
    """
    name = getattr(job, "worker_name", None)
    if name:
        return f"provider-events:{name}/{os.getpid()}"
    return fence.process_actor("provider-events", os.getpid())
