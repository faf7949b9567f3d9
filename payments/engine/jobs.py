"""RQ entry points: ids in, the runtime called, nothing else."""

from __future__ import annotations

import os
from typing import Any

from rq import get_current_job

from payments.engine import fence, messages, runtime
from payments.engine.dispatch import KIND_META_KEY, dispatch
from payments.engine.failpoints import AFTER_INBOX_COMMIT, AFTER_RECORD_COMMIT, failpoint
from payments.exceptions import MalformedJob
from payments.models import Operation, OperationState


def run_operation(operation_id: int) -> str:
    """Run one operation under the fence; return what became of it."""
    job = get_current_job()
    _check(operation_id, job)
    try:
        outcome = runtime.execute(operation_id, worker_id=_worker_id(job), job=job)
    except Operation.DoesNotExist:
        _malformed(job, f"operation {operation_id} does not exist")
    failpoint(AFTER_RECORD_COMMIT, _kind(job))  # `after_record_commit@<kind>` names one kind
    if outcome == "deferred":  # another worker's live lease or claim: look again after it
        op = Operation.objects.get(pk=operation_id)
        at = op.lease_expires_at if op.state == OperationState.RUNNING else op.next_attempt_at
        dispatch(operation_id, at=at)
    return str(outcome)  # the result RQ stores: a plain string


def deliver_message(operation_id: int) -> str:
    """Deliver one message operation through the inbox; return what became of it."""
    job = get_current_job()
    _check(operation_id, job)
    try:
        kind = job.meta.get(KIND_META_KEY) if job is not None else None
        outcome = messages.deliver(operation_id, worker_id=_worker_id(job), job=job, kind=kind)
    except Operation.DoesNotExist:
        _malformed(job, f"operation {operation_id} does not exist")
    failpoint(AFTER_INBOX_COMMIT, _kind(job))
    return outcome


def _kind(job: Any) -> str:
    """The operation kind the job names (its meta), for a failpoint of one kind only."""
    return str(job.meta.get(KIND_META_KEY) or "") if job is not None else ""


def _worker_id(job: Any) -> str:
    """The owner of the leases and claims this job takes: unique to the worker process."""
    name = getattr(job, "worker_name", None)
    if name:  # RQ's worker names are unique per worker (a uuid unless set)
        return f"{name}/{os.getpid()}"
    return fence.process_actor("worker", os.getpid())


def _check(operation_id: object, job: Any) -> None:
    """Fail a job whose argument is not an operation id: no retry can fix it."""
    if isinstance(operation_id, bool) or not isinstance(operation_id, int):
        _malformed(job, f"takes an operation id, got {type(operation_id).__name__}")


def _malformed(job: Any, reason: str) -> None:
    """Send a malformed job straight to the failed registry, visibly."""
    if job is not None:
        job.retries_left = 0
    raise MalformedJob(reason)
