"""Run a message handler at most once per (consumer, message id), atomically with its writes.

Two entry points:

* :func:`inbox_handler` decorates an RQ job function; it reads the message id
  and consumer from the current job's meta (set by
  :class:`inbox.queues.MessageQueue`).
* :func:`inbox_guard` is the context manager underneath it, for callers
  outside RQ (or tests) that know the consumer and message id themselves.

Both protect the database only: a handler's e-mails or HTTP calls are not
rolled back with its transaction and need a fence of their own.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, overload

from django.db import transaction
from rq import get_current_job
from rq.job import Job

from inbox.conf import inbox_settings
from inbox.context import handling
from inbox.exceptions import MissingMessageId
from inbox.queues import CONSUMER_META_KEY, MESSAGE_ID_META_KEY
from inbox.services import check_identity, purge_expired, record_message
from inbox.signals import duplicate_skipped

logger = logging.getLogger("inbox")

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def inbox_guard(
    consumer: str, message_id: str, *, record: Callable[[], bool] | None = None
) -> Iterator[bool]:
    """Open ``atomic()``, record the message and yield whether to handle it.

    Yield True on the first delivery: run the handler inside the ``with``
    block, so its writes and the inbox row commit or roll back together.
    Yield False on a redelivery (the row exists; logged at INFO as
    ``Skipping message <id> for <consumer>``): do nothing. A concurrent
    delivery of the same message blocks in the insert until the first one
    commits (then it gets False) or rolls back (then it gets True).

    Inside the block, enqueueing through :class:`~inbox.queues.MessageQueue`
    raises :class:`~inbox.exceptions.FollowUpEnqueueRefused`.

    Nested in an outer ``atomic()``, this becomes a savepoint and commits
    with the outer transaction; the opportunistic purge runs after that.

    ``record`` replaces :func:`~inbox.services.record_message` for a caller
    that inserts the row in a statement of its own, together with its first
    write (one round trip instead of two): it must insert exactly the row
    ``record_message`` would, ``ON CONFLICT (consumer, message_id) DO
    NOTHING``, in the current transaction, and return whether it inserted it.
    """
    if record is not None:
        check_identity(consumer, message_id)  # record_message checks its own
    with transaction.atomic():
        handle = record() if record is not None else record_message(consumer, message_id)
        if handle:
            _schedule_purge(consumer)
        else:
            logger.info("Skipping message %s for %s", message_id, consumer)
            duplicate_skipped.send(sender=None, consumer=consumer, message_id=message_id)
        # Reset before the atomic block exits, so on_commit callbacks (which run
        # after the commit, when a failure can no longer roll the row back) are
        # not mistaken for code inside the handler.
        with handling(consumer, message_id):
            yield handle


def _schedule_purge(consumer: str) -> None:
    """With ``INBOX["PURGE_CHANCE"]``, purge one batch of ``consumer`` after commit.

    After, never inside: the handler's transaction must stay short and must
    not fail because housekeeping did.
    """
    conf = inbox_settings()
    # Not a security decision; any uniform source spreads the purges.
    if conf.purge_chance and random.random() < conf.purge_chance:
        transaction.on_commit(
            functools.partial(_purge_after_commit, consumer, conf.purge_batch_size)
        )


def _purge_after_commit(consumer: str, batch_size: int) -> None:
    try:
        result = purge_expired(consumer=consumer, batch_size=batch_size, max_batches=1)
    except Exception:
        # The message is already committed; failing the job now would only
        # make RQ redeliver it to be skipped. Log and let a later message retry.
        logger.exception("Inbox purge for %s failed; a later message will try again", consumer)
        return
    if result.deleted:
        logger.debug(
            "Purged %d expired inbox entries of %s in %.3fs",
            result.deleted,
            consumer,
            result.longest_batch_seconds,
        )


def current_message(consumer: str | None = None) -> tuple[str | None, str | None]:
    """Return (consumer, message id) of the running job, as :func:`inbox_handler` reads them.

    The consumer is, in order: ``consumer``, ``job.meta["consumer"]``, the
    job's origin queue. Either may be None (no job, or no message id).
    """
    return _message_of(get_current_job(), consumer)


def _message_of(job: Job | None, consumer: str | None) -> tuple[str | None, str | None]:
    """Return (consumer, message id) of ``job``; either may be None."""
    meta = job.meta if job is not None else {}
    message_id = meta.get(MESSAGE_ID_META_KEY)
    if not isinstance(message_id, str) or not message_id:
        message_id = None
    name = consumer or meta.get(CONSUMER_META_KEY) or (job.origin if job is not None else None)
    return name, message_id


@overload
def inbox_handler(func: F, *, consumer: str | None = None) -> F: ...
@overload
def inbox_handler(func: None = None, *, consumer: str | None = None) -> Callable[[F], F]: ...
def inbox_handler(func: F | None = None, *, consumer: str | None = None) -> F | Callable[[F], F]:
    """Make an RQ job function run at most once per message, atomically with its writes.

    Use as ``@inbox_handler()`` or ``@inbox_handler(consumer="emails")``. The
    consumer is, in order: this argument, ``job.meta["consumer"]``, the job's
    origin queue. The message id is ``job.meta["message_id"]``. A redelivered
    message returns None without calling the function.

    A job without a message id (enqueued by another tool, or the function
    called outside RQ) runs unprotected after a WARNING, or raises
    :class:`~inbox.exceptions.MissingMessageId` when
    ``INBOX["STRICT_MESSAGE_ID"]`` is on.
    """

    def decorate(handler: F) -> F:
        @functools.wraps(handler)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            job = get_current_job()
            name, message_id = _message_of(job, consumer)
            if name is None or message_id is None:
                job_id = job.id if job is not None else None
                if inbox_settings().strict_message_id:
                    raise MissingMessageId(name, job_id)
                logger.warning(
                    "Message without a message id for %s (job %s); running it without "
                    "inbox protection",
                    name,
                    job_id,
                )
                return handler(*args, **kwargs)
            with inbox_guard(name, message_id) as handle:
                if not handle:
                    return None
                return handler(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    if func is not None:
        return decorate(func)
    return decorate
