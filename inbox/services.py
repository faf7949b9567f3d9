"""Record handled messages and purge expired ones: the only writers of InboxEntry."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeAlias, cast

from django.db import connection, transaction
from django.utils import timezone

from inbox.conf import inbox_settings
from inbox.exceptions import InvalidMessageId, TransactionRequired
from inbox.models import InboxEntry

ProgressCallback = Callable[[int, int, float], None]
"""Called after each batch with (batch number, rows deleted so far, batch seconds)."""

SqlParam: TypeAlias = str | datetime | list[str]
"""A parameter of the purge's WHERE clauses: a consumer, a cutoff or a list of consumers."""


@dataclass(frozen=True)
class PurgeResult:
    """What a purge did (or, in a dry run, would do)."""

    deleted: int
    """Rows deleted; 0 in a dry run."""
    matched: int
    """Expired rows found: equal to ``deleted``, or the would-be count in a dry run."""
    batches: int
    """Batches that deleted at least one row."""
    longest_batch_seconds: float
    """Wall time of the slowest batch, the longest the purge held row locks."""
    dry_run: bool


def _check_identity(consumer: str, message_id: str) -> None:
    # Both are CharFields, whose max_length is always set.
    consumer_max = cast(int, InboxEntry._meta.get_field("consumer").max_length)
    message_id_max = cast(int, InboxEntry._meta.get_field("message_id").max_length)
    if not consumer or len(consumer) > consumer_max:
        raise InvalidMessageId(f"Consumer name must be 1-200 characters, got {consumer!r}.")
    if not message_id or len(message_id) > message_id_max:
        raise InvalidMessageId(f"Message id must be 1-255 characters, got {message_id!r}.")


def record_message(consumer: str, message_id: str) -> bool:
    """Record that ``consumer`` handles ``message_id``; runs in the caller's transaction.

    Return True when this call inserted the row (first delivery), False when
    the row already exists (a redelivery: skip the handler). The unique key
    decides, never a prior SELECT: a second transaction inserting the same
    key waits for the first to commit (then gets False) or to roll back (then
    gets True), so concurrent deliveries serialise here.

    Raise :class:`~inbox.exceptions.TransactionRequired` outside
    ``transaction.atomic()``: in autocommit the row would commit before the
    handler's writes, and a crash in between would skip the message for good.
    """
    _check_identity(consumer, message_id)
    if not connection.in_atomic_block:
        raise TransactionRequired(consumer, message_id)
    table = connection.ops.quote_name(InboxEntry._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (consumer, message_id, handled_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING id",
            [consumer, message_id, timezone.now()],
        )
        return cursor.fetchone() is not None


def _purge_groups(
    consumer: str | None, older_than: timedelta | None, now: datetime
) -> list[tuple[str, list[SqlParam]]]:
    """Return (WHERE clause, params) pairs that together select every expired row.

    Without a consumer and without ``older_than``, each consumer with its own
    retention gets its own cutoff and all others share the default one; this
    avoids a ``SELECT DISTINCT consumer`` over the whole table.
    """
    conf = inbox_settings()
    if consumer is not None:
        cutoff = now - (older_than or conf.retention_for(consumer))
        return [("consumer = %s AND handled_at < %s", [consumer, cutoff])]
    if older_than is not None:
        return [("handled_at < %s", [now - older_than])]
    named = conf.named_consumers
    groups: list[tuple[str, list[SqlParam]]] = [
        ("consumer = %s AND handled_at < %s", [name, now - conf.retention_for(name)])
        for name in named
    ]
    default_cutoff = now - conf.default_retention
    if named:
        groups.append(("consumer <> ALL(%s) AND handled_at < %s", [named, default_cutoff]))
    else:
        groups.append(("handled_at < %s", [default_cutoff]))
    return groups


def purge_expired(
    consumer: str | None = None,
    older_than: timedelta | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
    max_batches: int | None = None,
    now: datetime | None = None,
) -> PurgeResult:
    """Delete inbox rows older than their retention, in batches; owns its transactions.

    ``consumer`` limits the purge to one consumer; ``older_than`` replaces
    the configured retention (``INBOX["RETENTION"]``); ``batch_size`` defaults
    to ``INBOX["PURGE_BATCH_SIZE"]``; ``max_batches`` bounds the work (the
    opportunistic purge does one batch). A row is expired when its
    ``handled_at`` is strictly older than ``now`` minus the retention.

    Each batch is ``DELETE ... WHERE id IN (SELECT id ... LIMIT n FOR UPDATE
    SKIP LOCKED)`` in its own durable transaction, so no lock is held for
    long and two purges running at once do not wait on each other. Call it
    outside any ``atomic()`` block (``durable=True`` refuses a nested one).
    A dry run only counts.
    """
    if batch_size is None:
        batch_size = inbox_settings().purge_batch_size
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be positive, got {max_batches}.")
    if older_than is not None and older_than <= timedelta(0):
        raise ValueError("older_than must be a positive duration.")
    groups = _purge_groups(consumer, older_than, now or timezone.now())
    table = connection.ops.quote_name(InboxEntry._meta.db_table)

    if dry_run:
        matched = 0
        with connection.cursor() as cursor:
            for where, params in groups:
                cursor.execute(f"SELECT count(*) FROM {table} WHERE {where}", params)
                matched += cursor.fetchone()[0]
        return PurgeResult(
            deleted=0, matched=matched, batches=0, longest_batch_seconds=0.0, dry_run=True
        )

    deleted = batches = 0
    longest = 0.0
    for where, params in groups:
        while max_batches is None or batches < max_batches:
            started = time.monotonic()
            with transaction.atomic(durable=True), connection.cursor() as cursor:
                cursor.execute(
                    f"DELETE FROM {table} WHERE id IN ("
                    f"SELECT id FROM {table} WHERE {where} LIMIT %s FOR UPDATE SKIP LOCKED)",
                    [*params, batch_size],
                )
                count = cursor.rowcount
            elapsed = time.monotonic() - started
            if count:
                batches += 1
                deleted += count
                longest = max(longest, elapsed)
                if progress is not None:
                    progress(batches, deleted, elapsed)
            # A short batch means this group is done (or its rest is being
            # purged by someone else right now: SKIP LOCKED left it to them).
            if count < batch_size:
                break
    return PurgeResult(
        deleted=deleted,
        matched=deleted,
        batches=batches,
        longest_batch_seconds=longest,
        dry_run=False,
    )
