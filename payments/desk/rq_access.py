"""Who may see and change RQ's queues: guards around django-rq's pages under /admin/rq/.

django-rq checks only `is_staff`; a staff user who may not see a single
operation could delete payment jobs, empty the queue and requeue or stop jobs
there. `project/urls.py` serves django-rq's URL patterns through
`guarded_urlpatterns()` instead, which wraps each view by its URL name:

- reading (the dashboard, job lists, a job, workers): staff with
  `payments.view_operation` or `payments.manage_queues`;
- changing (delete, empty, requeue, enqueue, stop, the bulk actions and their
  confirmation): staff with `payments.manage_queues`; a view this module does
  not know (a newer django-rq) counts as changing;
- the JSON statistics and RQ's own metrics: a reader's session, else
  `RQ_API_TOKEN` compared as bytes (a non-ASCII token is a 401, not a 500).

Whatever the permission, a job whose operation (`Operation.job_id`) is not
finished is never deleted (one job, the bulk "delete", "empty queue" or "clear
failed jobs"): the operation row is the record and its job the delivery, and
docs/deployment.md promises that failed jobs are never dropped. The operator resolves
the operation on the desk first. Unknown queue or scheduler indexes, jobs and
workers are 404s, and the `next_url` and `Referer` redirects only go to a
relative URL on this host.

`payments.manage_queues` is declared without a model migration: `QueueAccessConfig`
(in INSTALLED_APPS) creates it after every `migrate`, on the Operation content
type, beside the model permissions. Nothing here imports models at module level:
Django imports this module while it loads the apps.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any
from urllib.parse import urlsplit

from django.apps import AppConfig
from django.apps import apps as global_apps
from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS, router
from django.db.models.signals import post_migrate
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.urls import URLPattern, URLResolver, reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import url_has_allowed_host_and_scheme
from django_rq.queues import get_queue_by_index
from django_rq.settings import get_queues_list
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.worker import Worker

View = Callable[..., HttpResponse]

MANAGE_QUEUES = "payments.manage_queues"
VIEW_OPERATION = "payments.view_operation"
MANAGE_QUEUES_CODENAME = "manage_queues"
MANAGE_QUEUES_NAME = "Can manage the job queues (delete, empty, requeue, stop RQ jobs)"

#: django-rq's URL names (django_rq/urls.py, 4.2) that only show.
READ_VIEWS = frozenset(
    {
        "home",
        "jobs",
        "queue_details",
        "finished_jobs",
        "failed_jobs",
        "scheduled_jobs",
        "started_jobs",
        "deferred_jobs",
        "job_detail",
        "result_detail",
        "workers",
        "worker_details",
        "scheduler_jobs",
        "cron_scheduler_detail",
        "cron_job_detail",
    }
)
#: The ones with their own token authentication (JSON statistics, Prometheus).
TOKEN_VIEWS = frozenset({"home_json", "metrics"})
#: The ones that change the queues; any other name is treated as one of these.
MANAGE_VIEWS = frozenset(
    {
        "delete_failed_jobs",
        "clear",
        "requeue_all",
        "delete_job",
        "requeue_job",
        "enqueue_job",
        "stop_job",
        "confirm_action",
        "actions",
    }
)


# --- who may do what ---------------------------------------------------------------


def is_staff(user: Any) -> bool:
    return bool(user is not None and user.is_active and user.is_staff)


def may_view_queues(user: Any) -> bool:
    """Staff who may see operations, or who manage the queues."""
    return is_staff(user) and (user.has_perm(VIEW_OPERATION) or user.has_perm(MANAGE_QUEUES))


def may_manage_queues(user: Any) -> bool:
    return is_staff(user) and user.has_perm(MANAGE_QUEUES)


# --- redirects ---------------------------------------------------------------------


def safe_relative_url(url: str | None, request: HttpRequest) -> str | None:
    """Return `url` as a relative URL on this host, or None if it points anywhere else."""
    if not url:
        return None
    if not url_has_allowed_host_and_scheme(
        url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return None
    parts = urlsplit(url)
    relative = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # "http://host//evil.example" has the path "//evil.example": protocol-relative.
    if not relative.startswith("/") or not url_has_allowed_host_and_scheme(
        relative, allowed_hosts=set()
    ):
        return None
    return relative


def _sanitise_redirects(request: HttpRequest) -> None:
    """Keep only same-host relative targets in `Referer` and the POSTed `next_url`."""
    referer = safe_relative_url(request.META.get("HTTP_REFERER"), request)
    if referer is None:
        request.META.pop("HTTP_REFERER", None)
    else:
        request.META["HTTP_REFERER"] = referer
    if request.method == "POST" and "next_url" in request.POST:
        post = request.POST.copy()
        target = safe_relative_url(post.get("next_url"), request)
        if target is None:
            del post["next_url"]
        else:
            post["next_url"] = target
        post._mutable = False
        request.POST = post  # type: ignore[assignment]  # immutable again, as Django's


# --- what exists -------------------------------------------------------------------


def _check_indexes(kwargs: dict[str, Any]) -> None:
    """404 for a queue or scheduler index django-rq would turn into an IndexError (500)."""
    count = len(get_queues_list())
    for name in ("queue_index", "scheduler_index"):
        if name in kwargs and not 0 <= int(kwargs[name]) < count:
            raise Http404(f"No queue with index {kwargs[name]}")


def _check_objects(kwargs: dict[str, Any]) -> None:
    """404 for a job or worker that Redis does not have (django-rq raises on both)."""
    if "queue_index" not in kwargs:
        return
    if "job_id" in kwargs or "key" in kwargs:
        queue = get_queue_by_index(kwargs["queue_index"])
        if "job_id" in kwargs and not Job.exists(kwargs["job_id"], connection=queue.connection):
            raise Http404("No such job")
        if "key" in kwargs:
            try:
                worker = Worker.find_by_key(kwargs["key"], connection=queue.connection)
            except ValueError:  # not an RQ worker key at all
                worker = None
            if worker is None:
                raise Http404("No such worker")


# --- deletions of jobs whose operation is unfinished -------------------------------


def unfinished_operations_of(job_ids: Iterable[str]) -> dict[str, str]:
    """Map each job id that is the current delivery of an unfinished operation to its key."""
    from payments.models import FINAL_OPERATION_STATES, Operation

    ids = [job_id for job_id in job_ids if job_id]
    if not ids:
        return {}
    rows = (
        Operation.objects.filter(job_id__in=ids)
        .exclude(state__in=FINAL_OPERATION_STATES)
        .values_list("job_id", "key")
    )
    return dict(rows)


def _jobs_deleted_by(name: str, request: HttpRequest, kwargs: dict[str, Any]) -> list[str] | None:
    """Return the job ids a POST to view `name` would delete, or None if it deletes none."""
    if request.method != "POST":
        return None
    if name == "delete_job":
        return [kwargs["job_id"]]
    if name == "actions" and request.POST.get("action") == "delete":
        return request.POST.getlist("job_ids")
    if name in ("clear", "delete_failed_jobs"):
        queue = get_queue_by_index(kwargs["queue_index"])
        if name == "clear":
            return list(queue.get_job_ids())
        return list(FailedJobRegistry(queue=queue).get_job_ids())
    return None


def _refuse_deletion(
    request: HttpRequest, kwargs: dict[str, Any], unfinished: dict[str, str]
) -> HttpResponse:
    keys = ", ".join(sorted(set(unfinished.values()))[:5])
    more = len(set(unfinished.values())) - 5
    messages.error(
        request,
        f"Nothing was deleted: {len(unfinished)} job(s) deliver operations that are not "
        f"finished ({keys}{f' and {more} more' if more > 0 else ''}). Resolve them on the "
        "operations desk first; a failed job is never dropped.",
    )
    if "job_id" in kwargs:
        return redirect("django_rq:job_detail", kwargs["queue_index"], kwargs["job_id"])
    return redirect("django_rq:failed_jobs", kwargs["queue_index"])


# --- requeues that cannot do anything -----------------------------------------------


#: The requeued jobs a warning reads at most (a failed registry may hold thousands; the
#: warning is about the first ones, django-rq's own loop requeues them all).
WARN_READS = 500


def _runs_requeued_by(
    name: str, request: HttpRequest, kwargs: dict[str, Any]
) -> tuple[list[int], int]:
    """Return the operation ids of the fenced runs' jobs (`run_operation`) a POST to view
    `name` would requeue, of the first WARN_READS jobs, and how many jobs it names (none
    for other views). A job is
    matched by the operation it carries, not by `Operation.job_id`: a job the sweeper
    sent again has a new id, and the old one's requeue runs the same operation. A
    message's job is not one: requeued, it may still deliver its failed message
    (failed -> succeeded). A job that cannot be read is left to django-rq."""
    from payments.desk.views.rq_links import operation_id_of
    from payments.engine.dispatch import RUN_OPERATION

    if request.method != "POST" or "queue_index" not in kwargs:
        return [], 0
    queue = get_queue_by_index(kwargs["queue_index"])
    if name == "requeue_job":
        ids = [kwargs["job_id"]]
    elif name == "actions" and request.POST.get("action") == "requeue":
        ids = request.POST.getlist("job_ids")
    elif name == "requeue_all":
        ids = list(FailedJobRegistry(queue=queue).get_job_ids(0, WARN_READS - 1))
    else:
        return [], 0
    found = []
    for job_id in ids[:WARN_READS]:
        try:
            job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
            if job.func_name != RUN_OPERATION:
                continue
        except Exception:  # gone, or a payload that does not deserialize: django-rq's to say
            continue
        if (op_id := operation_id_of(job)) is not None:
            found.append(op_id)
    return found, len(ids)


def unrunnable_operations_of(operation_ids: Iterable[int]) -> list[Any]:
    """Of these operations, those no worker will run again (succeeded, failed, uncertain,
    needs review): requeueing their jobs runs them to "skipped" and changes nothing."""
    from payments.models import RUNNABLE_OPERATION_STATES, Operation

    ids = set(operation_ids)
    if not ids:
        return []
    rows = Operation.objects.filter(pk__in=ids).exclude(state__in=RUNNABLE_OPERATION_STATES)
    return list(rows.only("pk", "key", "state").order_by("pk"))


#: What an operation no worker runs again needs instead of its job, by its state.
NEEDS = {
    "failed": "a new attempt, if it is still wanted",
    "uncertain": "a query of the provider that settles it",
    "needs_review": "a person's decision",
    "succeeded": "nothing: it is done",
}


def _named(request: HttpRequest, operations: list[Any]) -> str:
    """The operations as "key (state)", each linked to its page for who may view it."""
    linked = request.user.has_perm(VIEW_OPERATION)
    return format_html_join(
        ", ",
        '<a href="{}">{}</a> ({})' if linked else "{}{} ({})",
        (
            (
                reverse("admin:payments_operation_change", args=[op.pk]) if linked else "",
                op.key,
                op.get_state_display().lower(),
            )
            for op in operations
        ),
    )


def _warn_requeued_for_nothing(request: HttpRequest, operations: list[Any], requeued: int) -> None:
    """Say, beside django-rq's "successfully requeued", which requeued jobs will change
    nothing and what their operations need instead, on their pages (in an operator's
    incident walk a failed checkout's requeued job "succeeded" and the operation stayed
    failed, unsaid). `requeued`: how many jobs the press requeued (one, or more)."""
    shown = operations[:5]
    links = _named(request, shown)
    if len(operations) == 1:
        text = format_html(
            "{} delivers {}, which no worker will run again: the job will run and change "
            "nothing. What it needs is on its page: {}.",
            "The requeued job" if requeued == 1 else "One of the requeued jobs",
            links,
            NEEDS.get(operations[0].state, "a look"),
        )
    else:
        more = f" and {len(operations) - len(shown)} more" if len(operations) > 5 else ""
        states = sorted({op.state for op in operations})
        needs = "; ".join(f"{s.replace('_', ' ')}: {NEEDS.get(s, 'a look')}" for s in states)
        text = format_html(
            "{} requeued jobs deliver operations no worker will run again: {}{}. Each job "
            "will run and change nothing. What each needs is on its page ({}).",
            len(operations),
            links,
            more,
            needs,
        )
    messages.warning(request, text)


# --- the guards --------------------------------------------------------------------


def guard(view: View, name: str) -> View:
    """Wrap one django-rq view by its URL name (see the module docstring)."""
    if name in TOKEN_VIEWS:
        return _token_guard(view)
    manage = name not in READ_VIEWS

    @wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        allowed = may_manage_queues if manage else may_view_queues
        if not allowed(request.user):
            raise PermissionDenied(MANAGE_QUEUES if manage else VIEW_OPERATION)
        _check_indexes(kwargs)
        _check_objects(kwargs)
        _sanitise_redirects(request)
        deleted = _jobs_deleted_by(name, request, kwargs)
        if deleted:
            unfinished = unfinished_operations_of(deleted)
            if unfinished:
                return _refuse_deletion(request, kwargs, unfinished)
        runs, requeued = _runs_requeued_by(name, request, kwargs)
        for_nothing = unrunnable_operations_of(runs)
        try:
            response = view(request, *args, **kwargs)
        except NoSuchJobError as exc:  # a job that vanished between the check and the view
            raise Http404("No such job") from exc
        if for_nothing and response.status_code == 302:
            _warn_requeued_for_nothing(request, for_nothing, requeued)
        if not manage and not may_manage_queues(request.user):
            _disable_managing_links(response)
        return response

    # Not staff at all: the admin's login page, as django-rq itself does.
    return staff_member_required(guarded)


#: django-rq's links that change the queue or a job ("Empty Queue", a job's "Delete"...),
#: its job page's buttons (Stop, Requeue, Enqueue) and its lists' bulk action button
#: (Go), as its pages write them (django-rq 4.2; tests/hardening/test_rq_pages.py).
_MANAGING_LINK = re.compile(
    r'<a href="[^"]*" class="(deletelink|requeuelink)">'
    r"(Empty Queue|Requeue All|Delete All|Delete)</a>"
)
_MANAGING_BUTTON = re.compile(
    r'<input type="submit" value="(Stop|Requeue|Enqueue)" class="(deletelink|default)" '
    r'name="\w+">'
)
_BULK_ACTION = re.compile(
    r'<button type="submit" class="button" title="Execute selected action" name="index" '
    r'value="0">Go</button>'
)
_OFF = (
    'aria-disabled="true" style="opacity:.5;cursor:not-allowed" '
    f'title="needs the permission {MANAGE_QUEUES}"'
)


def _disable_managing_links(response: HttpResponse) -> None:
    """Show a user who may not manage queues every control that changes one off, naming the
    permission they need (the views refuse them anyway: a 403 page, mid-incident)."""
    if getattr(response, "streaming", False) or "html" not in response.get("Content-Type", ""):
        return
    if hasattr(response, "render") and not getattr(response, "is_rendered", True):
        response.render()
    needs = f"(needs {MANAGE_QUEUES})"
    html = _MANAGING_LINK.sub(
        rf'<span class="\1 desk-button-off" {_OFF}>\2 {needs}</span>', response.content.decode()
    )
    html = _MANAGING_BUTTON.sub(
        rf'<input type="submit" value="\1 {needs}" class="\2" disabled {_OFF}>', html
    )
    html = _BULK_ACTION.sub(
        # name="index": the admin's actions.js looks the button up by it on every list.
        rf'<button type="button" class="button" name="index" value="0" disabled {_OFF}>'
        rf"Go {needs}</button>",
        html,
    )
    response.content = html.encode()


def _bearer(request: HttpRequest) -> str:
    header = request.headers.get("Authorization", "")
    return header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""


def _token_guard(view: View) -> View:
    @wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not may_view_queues(request.user):
            expected = str(getattr(settings, "RQ_API_TOKEN", "") or "").encode()
            supplied = (kwargs.get("token") or _bearer(request)).encode("utf-8", "replace")
            if not (expected and supplied and hmac.compare_digest(expected, supplied)):
                return JsonResponse(
                    {"error": True, "description": "Not authorised to read the queues."},
                    status=401,
                )
        return view(request, *args, **kwargs)

    return guarded


def guarded_urlpatterns(patterns: Iterable[URLPattern | URLResolver]) -> list[URLPattern]:
    """Return django-rq's URL patterns, each view wrapped by `guard` under its own name."""
    guarded: list[URLPattern] = []
    for pattern in patterns:
        if not isinstance(pattern, URLPattern):
            raise TypeError(f"unexpected nested URL resolver in django-rq: {pattern!r}")
        name = pattern.name or ""
        guarded.append(
            URLPattern(pattern.pattern, guard(pattern.callback, name), pattern.default_args, name)
        )
    return guarded


# --- the permission, created after every migrate -----------------------------------


def create_manage_queues_permission(
    sender: Any = None,
    app_config: AppConfig | None = None,
    using: str = DEFAULT_DB_ALIAS,
    apps: Any = global_apps,
    **kwargs: Any,
) -> None:
    """Create `payments.manage_queues` on the Operation content type (idempotent)."""
    if app_config is None or app_config.label != "payments":
        return
    try:
        content_type_model = apps.get_model("contenttypes", "ContentType")
        permission_model = apps.get_model("auth", "Permission")
    except LookupError:
        return
    if not router.allow_migrate_model(using, permission_model):
        return
    content_type, _ = content_type_model.objects.db_manager(using).get_or_create(
        app_label="payments", model="operation"
    )
    permission_model.objects.db_manager(using).get_or_create(
        content_type=content_type,
        codename=MANAGE_QUEUES_CODENAME,
        defaults={"name": MANAGE_QUEUES_NAME},
    )


class QueueAccessConfig(AppConfig):
    """Installed only to create `payments.manage_queues` after `migrate` (no models)."""

    name = "payments.desk.rq_access"
    label = "payments_rq_access"
    verbose_name = "RQ page guards"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(create_manage_queues_permission, dispatch_uid="payments.manage_queues")
