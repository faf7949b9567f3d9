"""RQ entry points: ids in, the runtime called, nothing else."""

from __future__ import annotations

import os

from rq import get_current_job

from payments import runtime
from payments.dispatch import dispatch
from payments.exceptions import MalformedJob
from payments.failpoints import AFTER_RECORD_COMMIT, failpoint
from payments.models import Operation, OperationState


def run_operation(operation_id: int) -> str:
    """Run one operation under the fence; return what became of it."""
    job = get_current_job()
    if isinstance(operation_id, bool) or not isinstance(operation_id, int):
        _no_retry(job)
        raise MalformedJob(
            f"run_operation takes an operation id, got {type(operation_id).__name__}"
        )
    if not Operation.objects.filter(pk=operation_id).exists():
        _no_retry(job)
        raise MalformedJob(f"operation {operation_id} does not exist")
    worker = f"{getattr(job, 'worker_name', None) or 'local'}/{os.getpid()}"
    outcome = runtime.execute(operation_id, worker_id=worker, job=job)
    failpoint(AFTER_RECORD_COMMIT)
    if outcome == "deferred":  # another worker's live lease or claim: look again after it
        op = Operation.objects.get(pk=operation_id)
        at = op.lease_expires_at if op.state == OperationState.RUNNING else op.next_attempt_at
        dispatch(operation_id, at=at)
    return outcome


def _no_retry(job: object) -> None:
    """Send a malformed job straight to the failed registry: retrying cannot fix it."""
    if job is not None:
        job.retries_left = 0
