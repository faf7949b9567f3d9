"""The inbox: which message each consumer has already handled."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

CONSUMER_MESSAGE_UNIQUE = "inbox_entry_consumer_message_uniq"
PURGE_INDEX = "inbox_entry_purge_idx"


class InboxEntry(models.Model):
    """One message handled by one consumer; its insert is the dedup claim.

    Written inside the handler's transaction, by
    :func:`inbox.services.record_message` or by the ``record`` a caller
    passes to :func:`inbox.handlers.inbox_guard` (which must insert the same
    row), and deleted only by
    :func:`inbox.services.purge_expired` once the retention has passed.
    """

    consumer = models.CharField(max_length=200, help_text="Queue name or explicit consumer name.")
    message_id = models.CharField(max_length=255, help_text="Stable id of the delivered message.")
    handled_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = "inbox entry"
        verbose_name_plural = "inbox entries"
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "message_id"], name=CONSUMER_MESSAGE_UNIQUE
            ),
        ]
        # No index on handled_at alone (dropped in migration 0003): the admin lists the
        # newest entries first by id, in the order they were recorded, through the
        # primary key; one consumer's, through the purge's index.
        indexes = [
            # The purge walks each consumer's rows oldest first, by (handled_at, id).
            models.Index(fields=["consumer", "handled_at", "id"], name=PURGE_INDEX),
        ]

    def __str__(self) -> str:
        return f"{self.consumer}:{self.message_id}"
