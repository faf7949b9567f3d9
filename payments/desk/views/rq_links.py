"""Links between the desk and django-rq's pages: from an operation to its job and to the
failed jobs; from a job on django-rq's pages to the operation it delivers (the
`desk_rq` template tags, in the project's overrides of django-rq's templates)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.urls import NoReverseMatch, reverse
from rq.job import Job
from rq.registry import FailedJobRegistry

from payments.engine.dispatch import DELIVER_MESSAGE, RUN_OPERATION
from payments.engine.queues import payments_queue, queue_index
from payments.models import Operation, OperationState

logger = logging.getLogger("payments.admin")


# --- RQ links --------------------------------------------------------------------


def _rq_url(name: str, *args: object) -> str | None:
    """Reverse a django-rq view (mounted at /admin/rq/, else inside the admin)."""
    for viewname in (f"django_rq:{name}", f"admin:django_rq_{name}"):
        try:
            return reverse(viewname, args=args)
        except NoReverseMatch:
            continue
    return None


@dataclass(frozen=True)
class JobLink:
    """The RQ job of an operation, as the operation page shows it."""

    job_id: str
    status: str  # an RQ status, "gone" when Redis no longer has it, "unknown" when unreachable
    url: str | None


def job_link(op: Operation) -> JobLink | None:
    """Find the operation's last RQ job; link it when Redis still has it."""
    if not op.job_id:
        return None
    try:
        job = Job.fetch(op.job_id, connection=payments_queue().connection)
        raw_status = job.get_status(refresh=False)
        status: str = getattr(raw_status, "value", raw_status) or "unknown"
    except Exception:  # NoSuchJobError, or Redis unreachable: show the id without a link
        return JobLink(op.job_id, "gone", None)
    return JobLink(op.job_id, status, _rq_url("job_detail", queue_index(), op.job_id))


def failed_jobs() -> dict[str, Any]:
    """RQ's failed jobs of the payments queue; Redis may be down, the page must still show."""
    try:
        count = FailedJobRegistry(queue=payments_queue()).count
    except Exception as exc:  # shown on the page: a desk that hides Redis being down is worse
        logger.warning("could not read the failed job registry: %s", type(exc).__name__)
        return {"count": None, "error": type(exc).__name__, "url": None}
    return {"count": count, "error": "", "url": _rq_url("failed_jobs", queue_index())}


# --- from a job to its operation -----------------------------------------------------

#: The engine's job functions (payments.engine.jobs): their one argument is an operation id.
OPERATION_JOBS = frozenset({RUN_OPERATION, DELIVER_MESSAGE})


@dataclass(frozen=True)
class JobOperation:
    """The operation an RQ job delivers, as django-rq's pages name it."""

    pk: int
    key: str  # "" when no operation has the job's id
    state: str  # the state's label ("Failed")
    url: str  # the operation's desk page; "" when there is none


def operation_id_of(job: Job) -> int | None:
    """The operation id an engine job carries; None for another function's job, or one
    whose data cannot be read (django-rq's page says so itself)."""
    try:
        if job.func_name not in OPERATION_JOBS:
            return None
        args = job.args
    except Exception:  # a payload that does not deserialize: not ours to explain
        return None
    if len(args) != 1 or isinstance(args[0], bool) or not isinstance(args[0], int):
        return None
    return args[0]


def operations_of_jobs(jobs: Iterable[Job]) -> dict[str, JobOperation]:
    """The operations the engine's jobs among `jobs` deliver, by job id: one query for a
    page of jobs (django-rq shows up to 100)."""
    wanted = {job.id: op_id for job in jobs if (op_id := operation_id_of(job)) is not None}
    rows = Operation.objects.filter(pk__in=set(wanted.values())).values_list("pk", "key", "state")
    found = {pk: (key, state) for pk, key, state in rows}
    linked: dict[str, JobOperation] = {}
    for job_id, op_id in wanted.items():
        key, state = found.get(op_id, ("", ""))
        label = str(OperationState(state).label) if state else ""
        url = reverse("admin:payments_operation_change", args=[op_id]) if key else ""
        linked[job_id] = JobOperation(op_id, key, label, url)
    return linked
