"""The operators' desk in the admin: confirmation pages, actions and the Needs attention page.

Each action follows django's `user_change_password`: explicit permission
checks, GET shows what will happen with the operation's steps and a reason
field, POST calls one service of `payments.desk.services` (which owns the transaction
and the audit row), then `log_change`, `message_user` and a redirect. Nothing
here edits a row itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypedDict, cast

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count, F, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.timesince import timesince
from rq.job import Job
from rq.registry import FailedJobRegistry

from payments.desk import services as desk
from payments.desk.display import state_badge
from payments.engine.queues import payments_queue, queue_index
from payments.exceptions import PaymentsError
from payments.models import FenceAuditRun, Operation, OperationEvent, OperationState

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser
    from django_stubs_ext import WithAnnotations

    # The mixin is only ever mixed into a ModelAdmin of Operation (OperationAdmin);
    # at run time its base stays `object`.
    _DeskAdminBase = admin.ModelAdmin[Operation]
else:
    _DeskAdminBase = object

logger = logging.getLogger("payments.admin")


class StateSince(TypedDict):
    """The annotation `with_state_since` adds."""

    state_since: datetime


def with_state_since(
    queryset: QuerySet[Operation],
) -> QuerySet[WithAnnotations[Operation, StateSince]]:
    """Annotate `state_since`: when the operation entered its current state."""
    entered = (
        OperationEvent.objects.filter(operation=OuterRef("pk"), step="", to_state=OuterRef("state"))
        .filter(~Q(from_state=F("to_state")))  # a note in the same state does not restart it
        .order_by("-created_at", "-id")
        .values("created_at")[:1]
    )
    return queryset.annotate(state_since=Coalesce(Subquery(entered), F("updated_at")))


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


# --- forms -----------------------------------------------------------------------


class ReasonForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        max_length=1000,
        help_text="Why you decide this (kept in the audit trail forever).",
    )


class QueryForm(forms.Form):
    """Querying the provider is not a judgement: no reason is asked."""


class NewAttemptForm(ReasonForm):
    payment_method = forms.CharField(
        max_length=255,
        required=False,
        label="Payment method",
        help_text="The payment method the customer authorised (pm_…); blank: the same as before.",
    )

    field_order = ["payment_method", "reason"]


class MarkSucceededForm(ReasonForm):
    reference = forms.CharField(
        max_length=255,
        label="Provider reference",
        help_text="The charge's id at the provider (pi_…); it is checked before anything changes.",
    )

    field_order = ["reference", "reason"]


@dataclass(frozen=True)
class DeskAction:
    """One button of the desk: its confirmation page and the service it calls."""

    name: str
    title: str
    verb: str
    form: type[forms.Form]
    permissions: tuple[str, ...]
    run: Callable[[Operation, str, HttpRequest, dict[str, Any]], str]


def _operator(request: HttpRequest) -> AbstractBaseUser:
    """The signed-in operator: `admin_view` lets only active staff reach the desk."""
    return cast("AbstractBaseUser", request.user)


def _run_query(op: Operation, step: str, request: HttpRequest, data: dict[str, Any]) -> str:
    report = desk.query_provider([op.pk], user=_operator(request))
    row = report.rows[0] if report.rows else None
    if row is None:
        return "Queried the provider: nothing to settle."
    return f"Queried the provider: {row.outcome.replace('_', ' ')} (now {row.state_after})."


def _run_resume(op: Operation, step: str, request: HttpRequest, data: dict[str, Any]) -> str:
    desk.resume(op, user=_operator(request), reason=data["reason"])
    return f"Resumed with the same key: {data['reason']}"


def _run_mark_succeeded(op: Operation, step: str, request: HttpRequest, data: dict) -> str:
    ref = data["reference"]
    desk.mark_step_succeeded(
        op, step, reference=ref, user=_operator(request), reason=data["reason"]
    )
    return f"Marked step {step} succeeded with {ref}: {data['reason']}"


def _run_mark_failed(op: Operation, step: str, request: HttpRequest, data: dict) -> str:
    desk.mark_step_failed(op, step, user=_operator(request), reason=data["reason"])
    return f"Marked step {step} failed: {data['reason']}"


def _run_new_attempt(op: Operation, step: str, request: HttpRequest, data: dict) -> str:
    new = desk.start_new_attempt(
        op,
        user=_operator(request),
        reason=data["reason"],
        payment_method=data.get("payment_method") or None,
    )
    return f"Started a new attempt {new.key}: {data['reason']}"


RECONCILE = ("payments.reconcile_operation",)
DESK_ACTIONS = {
    a.name: a
    for a in (
        DeskAction("query_provider", "Query provider now", "Query the provider", QueryForm,
                   RECONCILE, _run_query),
        DeskAction("resume", "Resume with the same key", "Resume", ReasonForm, RECONCILE,
                   _run_resume),
        DeskAction("mark_succeeded", "Mark step succeeded", "Check and mark succeeded",
                   MarkSucceededForm, RECONCILE, _run_mark_succeeded),
        DeskAction("mark_failed", "Mark step failed", "Check and mark failed", ReasonForm,
                   RECONCILE, _run_mark_failed),
        DeskAction("new_attempt", "Start a new attempt", "Start a new attempt", NewAttemptForm,
                   (*RECONCILE, "payments.start_new_attempt"), _run_new_attempt),
    )
}  # fmt: skip


class DeskViewsMixin(_DeskAdminBase):
    """The desk's extra admin views, mixed into OperationAdmin."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        desk_urls = [
            path(
                "needs-attention/",
                view(self.needs_attention_view),
                name=f"{info}_needs_attention",
            ),
            path(
                "<path:object_id>/steps/<str:step>/<str:action>/",
                view(self.desk_action_view),
                name=f"{info}_desk_step",
            ),
            path("<path:object_id>/desk/<str:action>/", view(self.desk_action_view), name=f"{info}_desk"),
        ]  # fmt: skip
        return desk_urls + super().get_urls()

    # --- permissions ---------------------------------------------------------

    def has_reconcile_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("payments.reconcile_operation")

    def has_new_attempt_permission(self, request: HttpRequest) -> bool:
        return self.has_reconcile_permission(request) and request.user.has_perm(
            "payments.start_new_attempt"
        )

    def _check_permissions(self, request: HttpRequest, permissions: tuple[str, ...]) -> None:
        if not self.has_view_permission(request):
            raise PermissionDenied
        if not all(request.user.has_perm(p) for p in permissions):
            raise PermissionDenied

    # --- one action on one operation -------------------------------------------

    def desk_action_view(
        self, request: HttpRequest, object_id: str, action: str, step: str = ""
    ) -> HttpResponse:
        """GET: confirm what will happen; POST: do it through the desk, log, redirect."""
        spec = DESK_ACTIONS.get(action)
        if spec is None or (action in ("mark_succeeded", "mark_failed")) != bool(step):
            raise Http404("no such desk action")
        self._check_permissions(request, spec.permissions)
        op = self.get_object(request, unquote(object_id))
        if op is None:
            raise Http404(f"operation {object_id!r} does not exist")
        change_url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[op.pk]
        )
        form = spec.form(request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            try:
                # The desk service owns the transaction (and keeps HTTP calls out of it).
                message = spec.run(op, step, request, form.cleaned_data)
            except PaymentsError as exc:
                self.message_user(request, f"Nothing was changed: {exc}", messages.ERROR)
                return HttpResponseRedirect(change_url)
            self.log_change(request, op, message)
            self.message_user(request, message, messages.SUCCESS)
            return HttpResponseRedirect(change_url)
        context = {
            **self.admin_site.each_context(request),
            "title": f"{spec.title}: {op.key}" + (f" / {step}" if step else ""),
            "opts": self.opts,
            "original": op,
            "action": spec,
            "step": step,
            "form": form,
            "claims": [
                {"claim": c, "badge": state_badge(c.state)}
                for c in op.claims.order_by("claimed_at", "pk")
            ],
            "next_key": _next_key_or_blank(op) if action == "new_attempt" else "",
            "change_url": change_url,
            "refused": _refusal(op, action, step),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/payments/operation/desk_confirm.html", context)

    # --- the changelist bulk action ------------------------------------------------

    @admin.action(description="Query provider now", permissions=["reconcile"])
    def query_selected(self, request: HttpRequest, queryset: QuerySet[Operation]):
        """Ask the provider about the selected operations, after a confirmation page."""
        if request.POST.get("post"):
            ops = list(queryset)
            try:
                report = desk.query_provider([op.pk for op in ops], user=_operator(request))
            except PaymentsError as exc:
                self.message_user(request, f"Nothing was changed: {exc}", messages.ERROR)
                return None
            for row in report.rows:
                op = next(o for o in ops if o.pk == row.operation_id)
                self.log_change(request, op, f"Queried the provider: {row.outcome}")
            self.message_user(
                request,
                f"Queried the provider for {len(report.rows)} operation(s): {report.summary()}.",
                messages.SUCCESS,
            )
            return None  # back to the changelist
        context = {
            **self.admin_site.each_context(request),
            "title": "Query provider now",
            "opts": self.opts,
            "queryset": queryset,
            "action_checkbox_name": "_selected_action",
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/payments/operation/query_selected_confirmation.html", context
        )

    # --- Needs attention -----------------------------------------------------------

    def needs_attention_view(self, request: HttpRequest) -> HttpResponse:
        """Counts by state, the oldest unknowns, RQ's failed jobs and the last fence audit."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        now = timezone.now()
        counts = dict(Operation.objects.values_list("state").annotate(n=Count("pk")))
        changelist = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        states = [
            {"state": s, "label": s.label, "count": counts.get(s.value, 0),
             "url": f"{changelist}?state__exact={s.value}"}
            for s in OperationState
        ]  # fmt: skip
        oldest = {
            name: _oldest(state, now)
            for name, state in (
                ("uncertain", OperationState.UNCERTAIN),
                ("needs_review", OperationState.NEEDS_REVIEW),
            )
        }
        audit = FenceAuditRun.objects.order_by("-finished_at").first()
        context = {
            **self.admin_site.each_context(request),
            "title": "Needs attention",
            "opts": self.opts,
            "states": states,
            "oldest_uncertain": oldest["uncertain"],
            "oldest_needs_review": oldest["needs_review"],
            "failed_jobs": _failed_jobs(),
            "audit": audit,
            "audit_rows": _audit_rows(audit),
            "changelist_url": changelist,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/payments/operation/needs_attention.html", context)


def _oldest(state: OperationState, now) -> dict[str, Any] | None:
    op = with_state_since(Operation.objects.filter(state=state)).order_by("state_since").first()
    if op is None:
        return None
    return {
        "operation": op,
        "age": timesince(op.state_since, now),
        "url": reverse("admin:payments_operation_change", args=[op.pk]),
    }


def _failed_jobs() -> dict[str, Any]:
    """RQ's failed jobs of the payments queue; Redis may be down, the page must still show."""
    try:
        count = FailedJobRegistry(queue=payments_queue()).count
    except Exception as exc:  # shown on the page: a desk that hides Redis being down is worse
        logger.warning("could not read the failed job registry: %s", type(exc).__name__)
        return {"count": None, "error": type(exc).__name__, "url": None}
    return {"count": count, "error": "", "url": _rq_url("failed_jobs", queue_index())}


def _refusal(op: Operation, action: str, step: str) -> str:
    """Say why the state forbids `action` now ("" when it allows it); POST re-checks anyway."""
    available = desk.available_actions(op)
    if step:
        return (
            ""
            if step in available.settleable_steps
            else f"step {step} is not waiting to be settled"
        )
    return available.refused.get(action, "")


def _audit_rows(run: FenceAuditRun | None) -> list[tuple[str, str]]:
    """The audit summary as (label, text) rows: lists shown as a count and their first items."""
    if run is None:
        return []
    rows = []
    for name, value in sorted((run.summary or {}).items()):
        if isinstance(value, list):
            shown = ", ".join(json.dumps(v) if isinstance(v, dict) else str(v) for v in value[:5])
            text = (
                f"{len(value)}" + (f": {shown}" if shown else "") + (" …" if len(value) > 5 else "")
            )
        elif value is None or value == "":
            text = "-"
        else:
            text = str(value)
        rows.append((name.replace("_", " ").capitalize(), text))
    return rows


def _next_key_or_blank(op: Operation) -> str:
    try:
        return desk.next_attempt_key(op)
    except desk.DeskError:
        return ""
