"""Give every RQ job a stable message id, and refuse enqueues from inbox handlers.

``settings.RQ["QUEUE_CLASS"]`` names :class:`MessageQueue`, so every queue
that django-rq builds is one.

Identity. ``create_job`` is the one path that ``enqueue``, ``enqueue_call``,
``enqueue_at``/``enqueue_in`` and ``enqueue_many`` all take, so the id is set
there:

* no ``job_id``: a fresh ``uuid4().hex`` becomes the job id and the message id;
* a ``job_id`` of 32 lowercase hex digits: it is the message id;
* any other ``job_id`` (rq allows letters, digits, ``_`` and ``-``): the
  message id is ``uuid5`` of it, so the same job id always gives the same
  message id.

The id lands in ``job.meta["message_id"]`` and the queue name in
``job.meta["consumer"]`` (kept when the caller's ``meta`` already names a
consumer). RQ never creates a new job to redeliver one: a ``Retry``, the
started-registry cleanup of an abandoned job and a requeue from the failed
registry all push the *same* job hash (same id, same meta, same origin) back,
so the message id and consumer survive every redelivery.

Failure TTL. A job without its own ``failure_ttl`` gets
``INBOX["REDELIVERY_HORIZON"]``: the failed registry (from which a job can be
requeued) never keeps it longer than the window inbox retention covers.

Follow-up guard. Inside an inbox-protected handler every enqueue through this
class raises :class:`~inbox.exceptions.FollowUpEnqueueRefused`; see there why.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django_rq.queues import DjangoRQ
from rq.job import Job

from inbox.conf import inbox_settings
from inbox.context import current_message
from inbox.exceptions import FollowUpEnqueueRefused, InvalidMessageId

MESSAGE_ID_META_KEY = "message_id"
CONSUMER_META_KEY = "consumer"

_MESSAGE_ID_RE = re.compile(r"[0-9a-f]{32}")
# A fixed namespace: uuid5 of a caller's job id must be the same in every
# process and every release, or a re-enqueue would get a new message id.
_JOB_ID_NAMESPACE = uuid.UUID("6c1e4f0a-3b2d-5e8f-9a7c-1d2e3f4a5b6c")


def new_message_id() -> str:
    """Return a fresh message id (32 lowercase hex digits)."""
    return uuid.uuid4().hex


def is_message_id(value: object) -> bool:
    """Return whether ``value`` is a well-formed message id."""
    return isinstance(value, str) and _MESSAGE_ID_RE.fullmatch(value) is not None


def message_id_for_job_id(job_id: str) -> str:
    """Return the message id of a job id: itself if it is one, else a stable uuid5."""
    if is_message_id(job_id):
        return job_id
    return uuid.uuid5(_JOB_ID_NAMESPACE, job_id).hex


class MessageQueue(DjangoRQ):
    """A django-rq queue whose jobs carry a stable message id and consumer."""

    def create_job(
        self,
        func: Any,
        *positional: Any,
        job_id: str | None = None,
        meta: dict[str, Any] | None = None,
        **options: Any,
    ) -> Job:
        """Create the job with ``meta["message_id"]`` and ``meta["consumer"]`` set."""
        if job_id is None:
            job_id = new_message_id()
        message_id = message_id_for_job_id(job_id)
        # Copy: the caller's dict may be reused for other jobs.
        meta = dict(meta or {})
        given = meta.get(MESSAGE_ID_META_KEY)
        if given is not None and given != message_id:
            raise InvalidMessageId(
                f"meta['message_id'] {given!r} differs from the one of job id {job_id!r} "
                f"({message_id}); pass the message id as job_id instead."
            )
        meta[MESSAGE_ID_META_KEY] = message_id
        meta.setdefault(CONSUMER_META_KEY, self.name)
        # A failed job can be requeued for as long as it is kept: keep it no
        # longer than the redelivery horizon that inbox retention is checked
        # against, so that the check holds by construction.
        if options.get("failure_ttl") is None:
            horizon = inbox_settings().redelivery_horizon
            options["failure_ttl"] = int(horizon.total_seconds())
        # Passed in `options`: mypy cannot tell that `positional` stops before job_id and meta.
        options["job_id"] = job_id
        options["meta"] = meta
        return super().create_job(func, *positional, **options)

    # DjangoRQ returns None when it defers the enqueue to on_commit; rq's Queue says Job.
    def enqueue_call(self, *args: Any, **kwargs: Any) -> Job | None:  # type: ignore[override]
        """Enqueue (deferred to on_commit inside atomic), unless inside an inbox handler."""
        self._refuse_inside_inbox_handler()
        return super().enqueue_call(*args, **kwargs)

    def enqueue_at(self, datetime: datetime, f: Any, *args: Any, **kwargs: Any) -> Job:
        """Schedule a job (written to Redis at once), unless inside an inbox handler.

        ``enqueue_in`` comes through here too.
        """
        self._refuse_inside_inbox_handler()
        return super().enqueue_at(datetime, f, *args, **kwargs)

    def enqueue_in(self, time_delta: timedelta, func: Any, *args: Any, **kwargs: Any) -> Job:
        """Schedule a job ``time_delta`` from now, unless inside an inbox handler."""
        self._refuse_inside_inbox_handler()
        return super().enqueue_in(time_delta, func, *args, **kwargs)

    def enqueue_many(self, job_datas: Iterable[Any], *args: Any, **kwargs: Any) -> list[Job]:
        """Enqueue several jobs at once, unless inside an inbox handler."""
        self._refuse_inside_inbox_handler()
        return super().enqueue_many(job_datas, *args, **kwargs)

    def _refuse_inside_inbox_handler(self) -> None:
        message = current_message()
        if message is not None:
            raise FollowUpEnqueueRefused(message.consumer, message.message_id, self.name)
