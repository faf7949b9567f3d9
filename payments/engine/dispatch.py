"""Deliver operations to RQ. The operation row is the record; a job is only a delivery.

The job id (32 hex, also the message id) is written on the operation before
the enqueue, so the sweeper can tell a live delivery from a lost one. Inside a
transaction it is written in that transaction (no commit of its own) and the
job is enqueued once it commits. The operations created together (a paid
order's follow-ups) are enqueued after its commit in one Redis pipeline: one
round trip for all of them.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone
from django_rq.queues import get_result_ttl
from rq import Retry

from payments.conf import payments_settings
from payments.engine import driver, fence
from payments.engine.follow_ups import written_once
from payments.engine.handlers import get_handler
from payments.engine.queues import payments_queue
from payments.exceptions import ConfigurationError
from payments.models import KeyScope, Operation, OperationState

logger = logging.getLogger("payments.engine.dispatch")


def message_id_for(operation_key: str, scope: str = KeyScope.CLIENT, tenant: str = "") -> str:
    """Return the stable 32-hex message id of a message operation (the same on every delivery).

    Named as its key is (scope and tenant, fence.derive_idempotency_key): two
    tenants' messages under the same key are two jobs and two inbox rows, never
    one skipped as the other's duplicate.
    """
    return hashlib.sha256(fence.key_name(operation_key, scope, tenant).encode()).hexdigest()[:32]


#: The job's meta entry naming the operation's kind.
KIND_META_KEY = "operation_kind"
#: The job's meta entry holding what the operation was created with (`operation_hint`).
HINT_META_KEY = "operation"
#: The operation's fields the hint holds: what its first step's request and key are
#: built from (payments.engine.runtime, the claim that rides the lease). None changes
#: after the operation is created.
HINT_FIELDS = (
    "key",
    "scope",
    "tenant",
    "kind",
    "entity_type",
    "entity_id",
    "params",
    "retry_of_id",
)

#: The RQ entry points, named by path: RQ stores the path with the job, and
#: naming them keeps this module free of an import of the jobs (which import it).
RUN_OPERATION = "payments.engine.jobs.run_operation"
DELIVER_MESSAGE = "payments.engine.jobs.deliver_message"


def _delivery(op: Operation) -> tuple[str, str]:
    """Return the job function's path and a job id for one delivery of `op`."""
    return _delivery_of(op.kind, op.key, op.scope, op.tenant)


def _delivery_of(kind: str, key: str, scope: str, tenant: str) -> tuple[str, str]:
    """Return the job function's path and a job id for one delivery of an operation."""
    try:
        consumer = get_handler(kind).consumer
    except ConfigurationError:  # no handler: run_operation parks it in needs_review
        consumer = None
    if consumer is not None:
        # An inbox message: every delivery of it must carry the same id.
        return DELIVER_MESSAGE, message_id_for(key, scope, tenant)
    # The fence guards operations; each delivery is a job of its own.
    return RUN_OPERATION, uuid.uuid4().hex


def _options(op: Operation, job_id: str) -> dict[str, Any]:
    """The RQ options of one delivery: its job id, timeout, description and retries."""
    conf = payments_settings()
    retries = conf.max_attempts - 1
    return {
        "job_id": job_id,
        "timeout": conf.job_timeout,
        "description": f"{op.kind} operation {op.pk}",
        "retry": Retry(max=retries, interval=list(conf.retry_backoff)) if retries else None,
        # The worker finds the handler without reading the row first (a hint: the
        # row read in the handler's own statement must agree).
        "meta": {KIND_META_KEY: op.kind, **operation_hint(op)},
    }


def operation_hint(op: Operation) -> dict[str, Any]:
    """The operation's HINT_FIELDS for its job's meta, when its handler declares
    `opens_with` and `op` was read with them; else nothing (a job then takes its lease
    before it builds a request). The meta is RQ's, in Redis: the hint copies the
    operation's params there, and the RQ job page shows them.

    A worker builds the first step's request from them before the lease, so that its
    claim is written in the lease's round trip; that claim is inserted only if the
    leased row holds the same values (queries.sql, insert_claim_with_lease): a stale or
    forged hint costs the worker one more round trip, never a claim the row disagrees with.
    """
    if op.pk is None or op.get_deferred_fields() & set(HINT_FIELDS):
        return {}
    try:
        if get_handler(op.kind).opens_with is None:
            return {}  # nothing to build before the lease: params stay out of Redis
    except ConfigurationError:
        return {}
    return {HINT_META_KEY: {name: getattr(op, name) for name in HINT_FIELDS}}


def _enqueue(
    op: Operation, func: str, job_id: str, at: datetime | None, first: bool = False
) -> None:
    queue = payments_queue()
    options = _options(op, job_id)
    options["job_timeout"] = options.pop("timeout")
    if at is not None and at > timezone.now():
        queue.enqueue_at(at, func, op.pk, **options)
    else:
        queue.enqueue(func, op.pk, at_front=first, **options)


@dataclass(frozen=True)
class _Delivery:
    op: Operation
    func: str
    job_id: str
    first: bool = False  # at the front of the queue


class _EnqueueAfterCommit:
    """Deliveries made together, enqueued after their transaction's commit in one Redis pipeline.

    The jobs are the ones `_enqueue` makes (same ids, message ids, timeouts,
    retries, result and failure TTLs): `enqueue_many` creates each through the
    queue's `create_job`, as `enqueue` does; only the writes share a round trip.
    """

    def __init__(self, deliveries: list[_Delivery]) -> None:
        self.deliveries = deliveries

    def __call__(self) -> None:
        try:
            _enqueue_together(self.deliveries)
        except Exception:  # Redis down: the rows are durable, the sweeper delivers them
            logger.warning(
                "enqueue of operations %s failed; the sweeper will deliver them",
                ", ".join(str(d.op.pk) for d in self.deliveries),
                exc_info=True,
            )


def _enqueue_together(deliveries: Sequence[_Delivery]) -> None:
    """Enqueue the deliveries, in order, in one pipeline (one Redis round trip).

    A batch goes all to the back or all to the front; pushed to the front one
    by one, the last would come first, so those are pushed in reverse.
    """
    if deliveries[0].first:
        deliveries = deliveries[::-1]
    queue = payments_queue()
    # DjangoRQ adds the configured result TTL in enqueue_call; enqueue_many does not.
    result_ttl = get_result_ttl(queue.name)
    jobs = [
        queue.prepare_data(
            d.func,
            (d.op.pk,),
            result_ttl=result_ttl,
            at_front=d.first,
            **_options(d.op, d.job_id),
        )
        for d in deliveries
    ]
    with queue.connection.pipeline() as pipe:
        queue.enqueue_many(jobs, pipeline=pipe)
        pipe.execute()


def dispatch(operation_id: int, *, at: datetime | None = None, first: bool = False) -> str:
    """Record a new job id, then enqueue the job (at `at`, else now; with `first`, at the
    front of the queue); return the job id."""
    op = Operation.objects.only("key", "kind", "scope", "tenant").get(pk=operation_id)
    func, job_id = _delivery(op)
    fence.record_dispatch_in_tx(op.pk, job_id)
    _enqueue(op, func, job_id, at, first)
    return job_id


def dispatch_on_commit(operation: Operation | int, *, first: bool = False) -> None:
    """Record the job id in the caller's transaction; enqueue once it commits.

    Runs inside the caller's transaction. A lost
    enqueue (Redis down, a crash right after the commit) is delivered later by
    the sweeper. With `first`, the job goes to the front of the queue, ahead
    of new work: an operation resumed once the provider's outcome is known.
    """
    op = (
        operation
        if isinstance(operation, Operation)
        else Operation.objects.only("key", "kind", "scope", "tenant").get(pk=operation)
    )
    func, job_id = _delivery(op)
    fence.record_dispatch_in_tx(op.pk, job_id)
    _enqueue_on_commit([_Delivery(op, func, job_id, first)])


def create_and_dispatch_in_tx(
    *, key: str, kind: str, scope: str = KeyScope.CLIENT, **create: Any
) -> tuple[Operation, bool]:
    """Create an operation (fence.create_operation_in_tx) and enqueue it once the caller commits.

    The job id is written by the INSERT itself (no statement of its own); an
    existing operation (same key) is returned as it is and nothing is enqueued.
    Runs inside the caller's transaction.
    """
    (created,) = create_and_dispatch_all_in_tx(
        [fence.NewOperation(key=key, kind=kind, scope=scope, **create)]
    )
    return created


def create_and_dispatch_all_in_tx(
    new: list[fence.NewOperation],
) -> list[tuple[Operation, bool]]:
    """`create_and_dispatch_in_tx` for each of `new`: their INSERTs in one round trip
    (fence.create_operations_in_tx), the new ones enqueued together after the commit."""
    deliveries = [_delivery_of(one.kind, one.key, one.scope, one.tenant) for one in new]
    results = fence.create_operations_in_tx(
        [replace(one, job_id=job_id) for one, (_func, job_id) in zip(new, deliveries, strict=True)]
    )
    _enqueue_on_commit(
        [
            _Delivery(op, func, job_id)
            for (op, created), (func, job_id) in zip(results, deliveries, strict=True)
            if created
        ]
    )
    return results


def create_follow_ups_in_tx(parent: Operation, new: list[fence.NewOperation]) -> None:
    """Write `parent`'s follow-ups (`new`, derived keys) in the caller's transaction.

    Those declared `inline=True` run here instead, in one savepoint, when the
    caller is a local step's function (its claim makes them once) and
    PAYMENTS["INLINE_FOLLOW_UPS"] holds: their writes commit with the event's,
    and no operation, audit or inbox row is written for them. If one raises,
    the savepoint rolls back and all of them are written and delivered as the
    others are, once the caller commits. The savepoint goes with their first
    statement and is not released (driver.savepoints_with_next_statement): it
    costs no round trip.
    """
    inline = [one for one in new if get_handler(one.kind).inline is not None]
    if inline and written_once() and payments_settings().inline_follow_ups:
        try:
            with driver.savepoints_with_next_statement(), transaction.atomic():
                for one in inline:
                    write = get_handler(one.kind).inline
                    assert write is not None  # chosen above for having one
                    write(_unsaved(parent, one))
        except Exception as exc:  # rolled back to the savepoint; delivered on their own instead
            if driver.is_interruption(exc) or transaction.get_connection().needs_rollback:
                raise  # the job's timeout, or a transaction that can only roll back
            logger.warning(
                "follow-ups %s of operation %s failed in its transaction; queued instead",
                ", ".join(one.kind for one in inline),
                parent.key,
                exc_info=True,
            )
        else:
            new = [one for one in new if one not in inline]
    if new:
        create_and_dispatch_all_in_tx(new)


def _unsaved(parent: Operation, one: fence.NewOperation) -> Operation:
    """The operation an inline follow-up's function gets: never saved, so no id."""
    return Operation(
        key=one.key,
        scope=one.scope,
        parent=parent,
        kind=one.kind,
        entity_type=one.entity_type,
        entity_id=str(one.entity_id),
        params=one.params,
        state=OperationState.SUCCEEDED,
        created_at=timezone.now(),
    )


def _enqueue_on_commit(deliveries: list[_Delivery]) -> None:
    """Enqueue `deliveries` together, in one pipeline, once the caller's transaction commits.

    One on-commit callback of Django's public `transaction.on_commit` per call:
    a rolled-back savepoint drops it with the rows it was for, and callbacks
    keep their order. The deliveries of one call are the ones batched; two
    calls are two callbacks, so nothing reads Django's list of callbacks.
    Outside a transaction, on_commit runs it at once.
    """
    if deliveries:
        transaction.on_commit(_EnqueueAfterCommit(deliveries))
