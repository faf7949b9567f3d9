"""Errors of the inbox app; every one is an :class:`InboxError`."""

from __future__ import annotations


class InboxError(Exception):
    """Base class of every inbox error."""


class TransactionRequired(InboxError):
    """An inbox row was to be recorded outside a transaction.

    The row must commit or roll back together with the handler's writes; in
    autocommit it would commit on its own and a crash would skip the handler.
    """

    def __init__(self, consumer: str, message_id: str) -> None:
        self.consumer = consumer
        self.message_id = message_id
        super().__init__(
            f"record_message({consumer!r}, {message_id!r}) must run inside transaction.atomic(), "
            "so the inbox row commits together with the handler's writes."
        )


class InvalidMessageId(InboxError, ValueError):
    """A message id or consumer name is empty, too long or malformed."""


class MissingMessageId(InboxError):
    """A job reached an inbox handler without a message id (STRICT_MESSAGE_ID is on)."""

    def __init__(self, consumer: str | None, job_id: str | None) -> None:
        self.consumer = consumer
        self.job_id = job_id
        super().__init__(
            f"Job {job_id} for consumer {consumer} carries no message id; refusing to run it "
            "unprotected (INBOX['STRICT_MESSAGE_ID'] is on). Enqueue it through "
            "inbox.queues.MessageQueue, or requeue it once the id is set."
        )


class FollowUpEnqueueRefused(InboxError):
    """An inbox-protected handler tried to enqueue a job.

    The enqueue would run after the inbox row committed (django-rq defers it
    to on_commit) or before it (enqueue_at, auto commit mode); a crash in
    between loses the follow-up or sends it for a rolled-back handler, and the
    redelivery is skipped, so nothing ever repairs it.
    """

    def __init__(self, consumer: str, message_id: str, queue_name: str) -> None:
        self.consumer = consumer
        self.message_id = message_id
        self.queue_name = queue_name
        super().__init__(
            f"Refusing to enqueue on queue {queue_name!r} inside the inbox handler for message "
            f"{message_id} of {consumer!r}: the job could be lost after the inbox row commits. "
            "Write an outbox/operation row in the same transaction instead, and let its "
            "dispatcher enqueue the job."
        )
