"""Retention: the history of finished operations is purged once it is older than RETENTION_DAYS.

What goes: an old finished operation's step claims, its audit rows
(OperationEvent) and the provider events about it, and the audit runs and
unmatched provider events as old. What stays: the operation row itself,
marked `purged_at`: its (tenant, scope, key) unique index still refuses the
key to anyone else, so a client's retry, a redelivered or replayed job, or a
new operation can never reuse a purged key (a replayed job finds a final
operation and does nothing); its kind, entity, params and state stay for
the business rules that read them (what an order's refunds reserved). See
docs/design.md, "Retention".

An operation is old enough when its last change (`updated_at`) is older than
the cutoff. It is never purged while it may still move or be read for a
decision: not final; failed with a claim that is not failed (the stranded
pass, a desk resume may take it up again); with an unhandled provider event;
with a follow-up or a retry that is not final.

Each batch is one short transaction: the batch's operations are locked
(FOR UPDATE SKIP LOCKED: one a desk action holds is left for the next run),
their rows deleted, the operations marked. Statements are written out whole
below; the purge changes no state and so asks no transition table. It runs
outside any transaction and can be stopped between two batches and run again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction

from payments.engine.history import first_id_from
from payments.engine.sql import named
from payments.models import Operation

logger = logging.getLogger("payments.engine.retention")

#: The operations of one batch, oldest id first, locked; the purgeable ones only.
PURGEABLE_BATCH = named(
    """
SELECT op.id FROM {Operation} AS op
WHERE op.purged_at IS NULL
  AND op.state IN ('succeeded', 'failed')
  AND op.updated_at < %(cutoff)s
  AND op.id > %(after)s
  AND op.id < %(before)s
  AND NOT EXISTS (
      SELECT 1 FROM {StepClaim} AS c
      WHERE c.operation_id = op.id
        AND (c.state IN ('claimed', 'uncertain') OR (op.state = 'failed' AND c.state = 'done'))
  )
  AND NOT EXISTS (
      SELECT 1 FROM {ProviderEvent} AS e
      WHERE e.operation_id = op.id AND e.handled_at IS NULL
  )
  AND NOT EXISTS (
      SELECT 1 FROM {Operation} AS child
      WHERE (child.parent_id = op.id OR child.retry_of_id = op.id)
        AND child.state NOT IN ('succeeded', 'failed')
  )
ORDER BY op.id
LIMIT %(batch)s
FOR UPDATE OF op SKIP LOCKED
"""
)

DELETE_PROVIDER_EVENTS = named(
    """
DELETE FROM {ProviderEvent} WHERE operation_id = ANY(%(ids)s)
"""
)

DELETE_AUDIT_ROWS = named(
    """
DELETE FROM {OperationEvent} WHERE operation_id = ANY(%(ids)s)
"""
)

DELETE_CLAIM_LOOKS = named(
    """
DELETE FROM {ClaimLook}
WHERE claim_id IN (SELECT id FROM {StepClaim} WHERE operation_id = ANY(%(ids)s))
"""
)

DELETE_CLAIMS = named(
    """
DELETE FROM {StepClaim} WHERE operation_id = ANY(%(ids)s)
"""
)

MARK_PURGED = named(
    """
UPDATE {Operation} SET purged_at = now() WHERE id = ANY(%(ids)s)
"""
)

#: Provider events about no operation (nothing matched them), handled before the cutoff.
DELETE_UNMATCHED_EVENTS = named(
    """
DELETE FROM {ProviderEvent} WHERE id IN (
    SELECT id FROM {ProviderEvent}
    WHERE handled_at < %(cutoff)s AND operation_id IS NULL
    LIMIT %(batch)s
)
"""
)

DELETE_AUDIT_RUNS = named(
    """
DELETE FROM {FenceAuditRun} WHERE finished_at < %(cutoff)s
"""
)

#: How many operations a purge at `cutoff` would take now (a dry run).
COUNT_PURGEABLE = named(
    """
SELECT count(*) FROM {Operation} AS op
WHERE op.purged_at IS NULL
  AND op.state IN ('succeeded', 'failed')
  AND op.updated_at < %(cutoff)s
  AND NOT EXISTS (
      SELECT 1 FROM {StepClaim} AS c
      WHERE c.operation_id = op.id
        AND (c.state IN ('claimed', 'uncertain') OR (op.state = 'failed' AND c.state = 'done'))
  )
  AND NOT EXISTS (
      SELECT 1 FROM {ProviderEvent} AS e
      WHERE e.operation_id = op.id AND e.handled_at IS NULL
  )
  AND NOT EXISTS (
      SELECT 1 FROM {Operation} AS child
      WHERE (child.parent_id = op.id OR child.retry_of_id = op.id)
        AND child.state NOT IN ('succeeded', 'failed')
  )
"""
)


@dataclass
class PurgeReport:
    """What a purge did (or, dry, would do)."""

    operations: int = 0
    claims: int = 0
    claim_looks: int = 0
    audit_rows: int = 0
    provider_events: int = 0
    audit_runs: int = 0
    batches: int = 0
    longest_batch_seconds: float = 0.0
    interrupted: bool = False
    dry_run: bool = False


def cutoff_for(retention_days: int, now: datetime) -> datetime:
    return now - timedelta(days=retention_days)


def purge_history(
    *,
    cutoff: datetime,
    batch_size: int,
    dry_run: bool = False,
    should_stop: Callable[[], bool] | None = None,
    progress: Callable[[PurgeReport], None] | None = None,
    max_batches: int | None = None,
) -> PurgeReport:
    """Purge the history older than `cutoff`, `batch_size` operations per transaction.

    Owns its transactions (refuses to run inside one). `should_stop` is
    asked before each batch: a stop leaves every batch committed or not begun.
    """
    if connection.in_atomic_block:
        raise RuntimeError("purge_history commits each batch: call it outside atomic()")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    report = PurgeReport(dry_run=dry_run)
    if dry_run:
        with connection.cursor() as cursor:
            cursor.execute(COUNT_PURGEABLE, {"cutoff": cutoff})
            report.operations = cursor.fetchone()[0]
        return report
    # Operations created since the cutoff changed since too: the walk stops before them
    # (ids grow with created_at), so a run reads the old end of the history, not all of it.
    before = first_id_from(Operation, "created_at", cutoff)
    after = 0
    while max_batches is None or report.batches < max_batches:
        if should_stop is not None and should_stop():
            report.interrupted = True
            return report
        ids = _purge_batch(cutoff, after, before, batch_size, report)
        if not ids:
            break
        after = max(ids)
        if progress is not None:
            progress(report)
    if not report.interrupted:
        _purge_the_rest(cutoff, batch_size, report, should_stop)
    return report


def _purge_batch(
    cutoff: datetime, after: int, before: int, size: int, report: PurgeReport
) -> list[int]:
    """One transaction: lock a batch of purgeable operations, delete their rows, mark them."""
    started = time.monotonic()
    params: dict[str, datetime | int] = {
        "cutoff": cutoff,
        "after": after,
        "before": before,
        "batch": size,
    }
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(PURGEABLE_BATCH, params)
        ids = [row[0] for row in cursor.fetchall()]
        if not ids:
            return []
        for statement, counter in (
            (DELETE_PROVIDER_EVENTS, "provider_events"),
            (DELETE_AUDIT_ROWS, "audit_rows"),
            (DELETE_CLAIM_LOOKS, "claim_looks"),
            (DELETE_CLAIMS, "claims"),
        ):
            cursor.execute(statement, {"ids": ids})
            setattr(report, counter, getattr(report, counter) + cursor.rowcount)
        cursor.execute(MARK_PURGED, {"ids": ids})
    seconds = time.monotonic() - started
    report.operations += len(ids)
    report.batches += 1
    report.longest_batch_seconds = max(report.longest_batch_seconds, seconds)
    logger.info(
        "purged the history of %s operations (ids %s-%s) in %.3fs",
        len(ids),
        min(ids),
        max(ids),
        seconds,
    )
    return ids


def _purge_the_rest(
    cutoff: datetime,
    batch_size: int,
    report: PurgeReport,
    should_stop: Callable[[], bool] | None,
) -> None:
    """Unmatched provider events and old audit runs, in batches too."""
    while True:
        if should_stop is not None and should_stop():
            report.interrupted = True
            return
        with transaction.atomic(durable=True), connection.cursor() as cursor:
            cursor.execute(DELETE_UNMATCHED_EVENTS, {"cutoff": cutoff, "batch": batch_size})
            deleted = cursor.rowcount
        report.provider_events += deleted
        if deleted < batch_size:
            break
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(DELETE_AUDIT_RUNS, {"cutoff": cutoff})
        report.audit_runs += cursor.rowcount
