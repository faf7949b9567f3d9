"""RQ entry point: handle one stored provider event behind the inbox."""

from __future__ import annotations

import math
import os
from typing import Any

from rq import get_current_job

from payments.engine import fence
from payments.exceptions import MalformedJob
from payments.webhooks.handling import handle_event, seconds_until_free

#: Seconds after a blocking lease ends before the event comes back (clocks, the scheduler).
LEASE_MARGIN = 0.25


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
        if job is not None:
            _come_back_when_free(job, event_id)
        raise EventDeferred(f"provider event {event_id}: a claim's owner is alive")
    return outcome


def _come_back_when_free(job: Any, event_id: str) -> None:
    """Bring the next retry forward to when the blocking leases run out; never put it off.

    RQ retries after `RETRY_DELAYS`; a lease that runs out sooner (its owner
    died in its call) is the moment the event can settle the claim. RQ reads
    the interval from this very job object when the job fails, right after.
    """
    intervals = list(getattr(job, "retry_intervals", None) or [])
    retries_left = getattr(job, "retries_left", None) or 0
    wait = seconds_until_free(event_id)
    if not intervals or retries_left <= 0 or wait is None:
        return
    index = max(len(intervals) - retries_left, 0)  # the one RQ's get_retry_interval picks
    intervals[index] = min(intervals[index], max(1, math.ceil(wait + LEASE_MARGIN)))
    job.retry_intervals = intervals


def _actor(job: Any) -> str:
    """The owner of the claims this job takes over: unique to the worker process and role.

    Not the worker's own id: a claim that this very worker left behind (its job
    was cut off mid-call) must not look like the event handler's own.
    """
    name = getattr(job, "worker_name", None)
    if name:
        return f"provider-events:{name}/{os.getpid()}"
    return fence.process_actor("provider-events", os.getpid())
