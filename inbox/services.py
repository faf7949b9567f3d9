"""Record handled messages and purge expired ones: the only writers of InboxEntry."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import cast

from django.db import connection, transaction
from django.utils import timezone

from inbox.conf import inbox_settings
from inbox.exceptions import InvalidMessageId, TransactionRequired
from inbox.models import InboxEntry

ProgressCallback = Callable[[int, int, float], None]
"""Called after each batch with (batch number, rows deleted so far, batch seconds)."""


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
    """Longest time one batch held its row locks, from its DELETE to its COMMIT."""
    dry_run: bool
    largest_batch: int = 0
    """Rows deleted by the largest batch."""
    interrupted: bool = False
    """True when ``should_stop`` ended the purge early, between two batches."""


def check_identity(consumer: str, message_id: str) -> None:
    """Raise InvalidMessageId unless both fit the inbox row's columns."""
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
    check_identity(consumer, message_id)
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


# The consumers present in the table, by a loose index scan: one index probe per
# consumer over the (consumer, handled_at, id) index instead of a DISTINCT over
# every row.
_CONSUMERS_SQL = """
WITH RECURSIVE consumers(name) AS (
    SELECT min(consumer) FROM {table}
    UNION ALL
    SELECT (SELECT min(consumer) FROM {table} WHERE consumer > name)
    FROM consumers WHERE name IS NOT NULL
)
SELECT name FROM consumers WHERE name IS NOT NULL
"""

# Opens each purge batch. One batch at a time per consumer: a second purge of
# the same consumer (the cron command and an opportunistic batch) waits here,
# at the start of its transaction and before it holds any row lock, for the
# current batch to commit. And the batch commits without waiting for its WAL
# to reach the disk: a batch lost in a crash only leaves expired rows that the
# next purge deletes, so the purge needs no durable commit, and the flush is
# most of a batch's fixed cost.
_PURGE_BEGIN_SQL = (
    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0)), "
    "set_config('synchronous_commit', 'off', true)"
)

# Where the next batch starts: the consumer's oldest expired row after the
# cursor, found by one probe of the (consumer, handled_at, id) index.
_NEXT_EXPIRED_SQL = """
SELECT handled_at, id FROM {table}
WHERE consumer = %(consumer)s AND handled_at < %(cutoff)s
  AND (handled_at, id) > (%(after_at)s, %(after_id)s)
ORDER BY handled_at, id
LIMIT 1
"""

# One batch: the consumer's expired rows among `span` consecutive primary keys
# from that row on. A primary-key range scan visits the rows in the order they
# were written, page after page, which is nearly as cheap per row as the
# sequential scan of one unbounded DELETE; and it deletes at most `span` rows.
# No FOR UPDATE: a row a handler is still writing is uncommitted and so
# invisible here, and other purges of the consumer wait on the advisory lock
# (_PURGE_BEGIN_SQL).
_PURGE_RANGE_SQL = """
DELETE FROM {table}
WHERE id >= %(first_id)s AND id < %(first_id)s + %(span)s
  AND consumer = %(consumer)s AND handled_at < %(cutoff)s
"""

_COUNT_SQL = "SELECT count(*) FROM {table} WHERE consumer = %s AND handled_at < %s"

#: Rows in the first batch of an adaptive purge (or ``batch_size``, if smaller).
FIRST_BATCH_SIZE = 1000

_START_CURSOR = (datetime(1, 1, 1, tzinfo=UTC), 0)


def _table() -> str:
    return connection.ops.quote_name(InboxEntry._meta.db_table)


def _consumers() -> list[str]:
    """Return every consumer that has inbox rows."""
    with connection.cursor() as cursor:
        cursor.execute(_CONSUMERS_SQL.format(table=_table()))
        return [name for (name,) in cursor.fetchall()]


def _cutoffs(
    consumer: str | None, older_than: timedelta | None, now: datetime
) -> list[tuple[str, datetime]]:
    """Return (consumer, cutoff) for every consumer to purge: rows older than the cutoff go."""
    conf = inbox_settings()
    names = [consumer] if consumer is not None else _consumers()
    return [(name, now - (older_than or conf.retention_for(name))) for name in names]


def _next_batch_size(size: int, seconds: float, target: float, limit: int) -> int:
    """Size the next batch so it takes about ``target`` seconds at the last batch's rate.

    It grows by at most a quarter per batch, as a fast batch may have been
    luck on a busy machine; it shrinks to no less than a quarter at once; and
    it stays within 1..``limit``.
    """
    wanted = int(size * target / max(seconds, 1e-4))
    return max(1, size // 4, min(wanted, size + max(1, size // 4), limit))


def _purge_batch(
    consumer: str, cutoff: datetime, after: tuple[datetime, int], span: int
) -> tuple[int, tuple[datetime, int] | None, float]:
    """Delete one batch in its own transaction; return (rows, its first key or None, seconds).

    The first key is the cursor of the next batch; None means the consumer
    has no expired row after ``after``. The seconds run from the DELETE's
    start to its COMMIT: how long the batch held its row locks.
    """
    table = _table()
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(_PURGE_BEGIN_SQL, [f"inbox.purge:{consumer}"])
        cursor.execute(
            _NEXT_EXPIRED_SQL.format(table=table),
            {"consumer": consumer, "cutoff": cutoff, "after_at": after[0], "after_id": after[1]},
        )
        first = cursor.fetchone()
        if first is None:
            return 0, None, 0.0
        started = time.monotonic()
        cursor.execute(
            _PURGE_RANGE_SQL.format(table=table),
            {"first_id": first[1], "span": span, "consumer": consumer, "cutoff": cutoff},
        )
        count = cursor.rowcount
    return count, (first[0], first[1]), time.monotonic() - started


def purge_expired(
    consumer: str | None = None,
    older_than: timedelta | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
    max_batches: int | None = None,
    now: datetime | None = None,
    batch_seconds: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PurgeResult:
    """Delete inbox rows older than their retention, in batches; owns its transactions.

    ``consumer`` limits the purge to one consumer; ``older_than`` replaces
    the configured retention (``INBOX["RETENTION"]``). A row is expired when
    its ``handled_at`` is strictly older than ``now`` minus the retention.
    ``max_batches`` bounds the work (the opportunistic purge does one batch);
    ``should_stop`` is asked before each batch (the command's SIGTERM), and a
    stop leaves every batch either committed or not begun.

    Each consumer is purged oldest first. A batch finds the consumer's oldest
    expired row after the previous batch's (one probe of the (consumer,
    handled_at, id) index, a keyset: no batch walks the dead entries of
    earlier ones), then deletes the consumer's expired rows among the next
    ``size`` primary keys, in its own durable transaction. ``batch_size``
    (default ``INBOX["PURGE_BATCH_SIZE"]``) is the largest ``size``, so no
    batch deletes more rows than that; with a ``batch_seconds`` target
    (default ``INBOX["PURGE_BATCH_SECONDS"]``, 0 for fixed batches) batches
    start at :data:`FIRST_BATCH_SIZE` and are sized to hold their locks about
    that long. A consumer whose rows are sparse among others' pays for the
    range scans over the others' rows (bounded per batch, like the rest). Call it outside any ``atomic()`` block
    (``durable=True`` refuses a nested one). A dry run only counts.
    """
    conf = inbox_settings()
    if batch_size is None:
        batch_size = conf.purge_batch_size
    if batch_seconds is None:
        batch_seconds = conf.purge_batch_seconds
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be positive, got {max_batches}.")
    if older_than is not None and older_than <= timedelta(0):
        raise ValueError("older_than must be a positive duration.")
    if batch_seconds < 0:
        raise ValueError(f"batch_seconds must not be negative, got {batch_seconds}.")
    cutoffs = _cutoffs(consumer, older_than, now or timezone.now())

    if dry_run:
        matched = 0
        with connection.cursor() as cursor:
            for name, cutoff in cutoffs:
                cursor.execute(_COUNT_SQL.format(table=_table()), [name, cutoff])
                matched += cursor.fetchone()[0]
        return PurgeResult(
            deleted=0, matched=matched, batches=0, longest_batch_seconds=0.0, dry_run=True
        )

    size = min(batch_size, FIRST_BATCH_SIZE) if batch_seconds else batch_size
    deleted = batches = largest = 0
    longest = 0.0
    interrupted = False
    for name, cutoff in cutoffs:
        after = _START_CURSOR
        while True:
            if max_batches is not None and batches >= max_batches:
                break
            if should_stop is not None and should_stop():
                interrupted = True
                break
            count, first, seconds = _purge_batch(name, cutoff, after, size)
            if first is None:
                break
            if count:
                batches += 1
                deleted += count
                largest = max(largest, count)
                longest = max(longest, seconds)
                if progress is not None:
                    progress(batches, deleted, seconds)
            after = first
            if batch_seconds:
                size = _next_batch_size(size, seconds, batch_seconds, batch_size)
        if interrupted:
            break
    return PurgeResult(
        deleted=deleted,
        matched=deleted,
        batches=batches,
        longest_batch_seconds=longest,
        dry_run=False,
        largest_batch=largest,
        interrupted=interrupted,
    )
