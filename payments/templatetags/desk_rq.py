"""Tags of the project's overrides of django-rq's pages (templates/django_rq/): each job of
the engine names the operation it delivers, linked to its desk page.

django-rq's failed-jobs page shows a job's function and id, not what it is
about; an operator there could not reach the operation. The overrides extend
django-rq's own templates (its `extra_columns` blocks, its job page's
`content`) and ask `operation_of_job` for each job.
"""

from __future__ import annotations

from django import template
from rq.job import Job

from payments.desk.views.rq_links import JobOperation, operations_of_jobs

register = template.Library()

#: Where one page's lookup is kept while it renders (one query for all its jobs).
_PAGE_KEY = "desk_rq_operations"


@register.simple_tag(takes_context=True)
def operation_of_job(context: template.Context, job: Job) -> JobOperation | None:
    """The operation `job` delivers, or None for a job of another function. Read once for
    every job on the page (django-rq's `jobs`), not once per row. Without
    `payments.view_operation` the operation is named, not linked (its page would refuse)."""
    page: dict[str, JobOperation | None] | None = context.render_context.get(_PAGE_KEY)
    if page is None or job.id not in page:
        jobs = [*(context.get("jobs") or []), job]
        page = {each.id: None for each in jobs} | operations_of_jobs(jobs)
        context.render_context[_PAGE_KEY] = page
    found = page[job.id]
    request = context.get("request")
    user = getattr(request, "user", None)
    if found is not None and found.url and not (user and user.has_perm("payments.view_operation")):
        return JobOperation(found.pk, found.key, found.state, "")
    return found
