"""Links from the desk to django-rq's pages: an operation's job, the failed jobs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.urls import NoReverseMatch, reverse
from rq.job import Job
from rq.registry import FailedJobRegistry

from payments.engine.queues import payments_queue, queue_index
from payments.models import Operation

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
