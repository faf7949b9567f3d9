"""The operators' desk in the admin: confirmation pages, actions, Needs attention, CSV export.

Each action follows django's `user_change_password`: explicit permission
checks, GET shows what will happen with the operation's steps and a reason
field, POST calls one service of `payments.desk.services` (which owns the transaction
and the audit row), then `log_change`, `message_user` and a redirect. A
refused action shows the form again with what was typed and why nothing
changed. Nothing here edits a row itself.
"""

from __future__ import annotations

import csv
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypedDict, cast

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import (
    BigIntegerField,
    Count,
    F,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce, Greatest, Lower
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.http.response import HttpResponseBase
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.timesince import timesince
from rq.job import Job
from rq.registry import FailedJobRegistry

from payments.conf import payments_settings
from payments.desk import services as desk
from payments.desk.display import (
    AGED_STATES,
    is_stale,
    money_line,
    provider_view_table,
    reference_link,
    state_badge,
    when,
)
from payments.desk.rules import FoundSucceeded
from payments.engine import fence
from payments.engine.handlers import get_handler, registered_handlers
from payments.engine.queues import payments_queue, queue_index
from payments.engine.steps import replay_allowed
from payments.exceptions import PaymentsError
from payments.models import (
    UNFINISHED_OPERATION_STATES,
    FenceAuditRun,
    Operation,
    OperationEvent,
    OperationState,
    ProviderEvent,
    StepClaim,
)
from payments.money import decimal_amount, format_totals

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


class ClaimAttempts(TypedDict):
    """The annotation `with_attempts` adds."""

    all_attempts: int


def with_attempts(queryset: QuerySet[Any]) -> QuerySet[Any]:
    """Annotate `all_attempts`: the operation's attempts or its busiest claim's, the larger.

    A resumed operation starts a fresh budget (attempts 0) while its charge
    claim remembers every call made under it: an operator must see both.
    """
    busiest = (
        StepClaim.objects.filter(operation=OuterRef("pk"))
        .order_by("-attempts")
        .values("attempts")[:1]
    )
    return queryset.annotate(all_attempts=Greatest(F("attempts"), Coalesce(Subquery(busiest), 0)))


def attempts_of(op: Operation) -> int:
    """The attempts an operator sees: annotated by `with_attempts`, else read from the claims."""
    annotated = getattr(op, "all_attempts", None)
    if annotated is not None:
        return int(annotated)
    claims = [c.attempts for c in op.claims.all()]
    return max([op.attempts, *claims])


def follow_up_kinds() -> list[str]:
    """The kinds registered as message handlers (the follow-ups of a paid order)."""
    return sorted(kind for kind, spec in registered_handlers().items() if spec.consumer is not None)


def follow_up_q() -> Q:
    """Operations that follow up another one: written by a parent step, or a message handler's."""
    return Q(parent__isnull=False) | Q(kind__in=follow_up_kinds())


def stale_q(now: datetime | None = None) -> Q:
    """Running operations whose lease has run out: their worker died or hangs."""
    return Q(state=OperationState.RUNNING, lease_expires_at__lt=now or timezone.now())


def last_error_of(op: Operation) -> str:
    """The operation's last error, else the reason of its last audit row that gives one."""
    if op.last_error:
        return op.last_error
    last = (
        OperationEvent.objects.filter(operation=op)
        .exclude(reason="")
        .order_by("-created_at", "-id")
        .values_list("reason", flat=True)
        .first()
    )
    return last or ""


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
        # Wide enough for a whole `pi_…` id (27 characters at Stripe) and then some.
        widget=forms.TextInput(
            attrs={
                "class": "vTextField desk-reference",
                "size": 48,
                "style": "width: 48ch; max-width: 100%",
                "spellcheck": "false",
                "autocomplete": "off",
            }
        ),
        help_text="The step's id at the provider; it is checked before anything changes.",
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


VIEW_PERMISSION = "payments.view_operation"
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


def _mark_failed_plan(op: Operation, step: str) -> dict[str, Any]:
    """What "mark failed" will do for this step, for its confirmation page to say."""
    claim = op.claims.filter(step=step).first()
    if claim is None:
        return {}
    request = claim.request or {}
    effect = get_handler(op.kind).effects.get(step)
    voids = str(getattr(effect, "VOIDS", ""))
    # The provider's object the step works on, voided first (an intent is cancelled).
    target = claim.provider_reference or str(request.get("payment_intent") or "")
    return {
        "may_have_happened": str(getattr(effect, "MAY_HAVE_HAPPENED", "")),
        "voids": voids,
        "void_target": target if voids else claim.provider_reference,
        "last_request_at": fence.last_request_at(claim),
        "grace_minutes": payments_settings().reconcile_grace // 60,
        "replay_first": op.state not in desk.WORKER_STATES
        and not claim.provider_reference
        and replay_allowed(claim),
    }


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
            path("export.csv", view(self.export_csv_view), name=f"{info}_export_csv"),
            path(
                "<path:object_id>/steps/<str:step>/<str:action>/",
                view(self.desk_action_view),
                name=f"{info}_desk_step",
            ),
            path("<path:object_id>/desk/<str:action>/", view(self.desk_action_view), name=f"{info}_desk"),
        ]  # fmt: skip
        return desk_urls + super().get_urls()

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Operation | None = None,
    ) -> HttpResponse:
        """The operation page, with the provider events that touched the operation."""
        if obj is not None:
            context["provider_events"] = provider_events_of(obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    # --- permissions ---------------------------------------------------------

    def has_reconcile_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("payments.reconcile_operation")

    def has_new_attempt_permission(self, request: HttpRequest) -> bool:
        return self.has_reconcile_permission(request) and request.user.has_perm(
            "payments.start_new_attempt"
        )

    def _check_permissions(self, request: HttpRequest, permissions: tuple[str, ...]) -> None:
        """Raise PermissionDenied naming the first permission the user lacks (the 403 shows it)."""
        if not self.has_view_permission(request):
            raise PermissionDenied(VIEW_PERMISSION)
        for permission in permissions:
            if not request.user.has_perm(permission):
                raise PermissionDenied(permission)

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
        form = _form_for(spec, op, step, request.POST if request.method == "POST" else None)
        status = 200
        if request.method == "POST" and form.is_valid():
            try:
                # The desk service owns the transaction (and keeps HTTP calls out of it).
                message = spec.run(op, step, request, form.cleaned_data)
            except FoundSucceeded as exc:  # the provider's answer was recorded instead
                form.add_error(None, f"Not marked failed: {exc.detail}")
                status = 409
                op = self.get_object(request, unquote(object_id)) or op
            except PaymentsError as exc:
                # Refused: the same form again, with what was typed and why nothing changed.
                form.add_error(None, f"Nothing was changed: {getattr(exc, 'detail', exc)}")
                status = 409
                op = self.get_object(request, unquote(object_id)) or op  # it may have moved
            else:
                self.log_change(request, op, message)
                self.message_user(request, message, messages.SUCCESS)
                return HttpResponseRedirect(change_url)
        handler = get_handler(op.kind)
        context = {
            **self.admin_site.each_context(request),
            "title": f"{action_title(spec, step)}: {op.key}",
            "action_title": action_title(spec, step),
            "opts": self.opts,
            "original": op,
            "action": spec,
            "step": step,
            "form": form,
            # How the page words this operation: the handler's steps and money line,
            # never a checkout's (a refund is not a charge).
            "money_line": money_line(op),
            "provider_steps": sorted(handler.effects),
            "other_steps": sorted(handler.steps),
            "on_failure": _hook_says(handler.on_failure),
            "on_resume": _hook_says(handler.on_resume),
            "asks_payment_method": isinstance(form, NewAttemptForm),
            "claims": [
                {
                    "claim": c,
                    "badge": state_badge(c.state),
                    "reference": reference_link(c.provider_reference),
                }
                for c in op.claims.order_by("claimed_at", "pk")
            ],
            "state_badge": state_badge(op.state),
            "provider_view": provider_view_table(
                op.claims.order_by("claimed_at", "pk"), op.params, what=money_line(op)
            ),
            "next_key": _next_key_or_blank(op) if action == "new_attempt" else "",
            **(_mark_failed_plan(op, step) if action == "mark_failed" else {}),
            "change_url": change_url,
            "refused": _refusal(op, action, step),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/payments/operation/desk_confirm.html", context, status=status
        )

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
            by_pk = {op.pk: op for op in ops}
            for row in report.rows:
                self.log_change(
                    request, by_pk[row.operation_id], f"Queried the provider: {row.outcome}"
                )
            self.message_user(
                request, _query_report_message(report.rows, report.summary()), messages.SUCCESS
            )
            return None  # back to the changelist
        context = {
            **self.admin_site.each_context(request),
            "title": "Query provider now",
            "opts": self.opts,
            "queryset": queryset,
            "rows": [
                {"op": op, "badge": state_badge(op.state), "amount": money_line(op)}
                for op in queryset
            ],
            "action_checkbox_name": "_selected_action",
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/payments/operation/query_selected_confirmation.html", context
        )

    # --- Needs attention -----------------------------------------------------------

    def needs_attention_view(self, request: HttpRequest) -> HttpResponse:
        """Counts and money by state, the oldest waits, RQ's failed jobs, the last fence audit.

        Follow-ups (ledger, sales counter) are counted apart: the headline
        figures are the customers' payments.
        """
        if not self.has_view_permission(request):
            raise PermissionDenied(VIEW_PERMISSION)
        now = timezone.now()
        business = Operation.objects.exclude(follow_up_q())
        counts = dict(business.values_list("state").annotate(n=Count("pk")))
        totals = money_by_state_and_kind(business)
        # A refund's money is not a charge's: with more than one kind, one total per kind.
        kinds = sorted({kind for by_kind in totals.values() for kind in by_kind})
        changelist = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        states = []
        for s in OperationState:
            lines = _totals_by_kind(totals.get(s.value, {}), labelled=len(kinds) > 1)
            states.append(
                {"state": s, "label": s.label, "count": counts.get(s.value, 0),
                 "totals": lines, "total": " · ".join(lines),
                 "url": f"{changelist}?state__exact={s.value}"}
            )  # fmt: skip
        oldest = [
            {
                "state": state,
                "id": state.replace("_", "-"),
                "label": state.label,
                "oldest": _oldest(business, state, now),
            }
            for state in OperationState
            if state in AGED_STATES
        ]
        follow_ups = Operation.objects.filter(follow_up_q())
        audit = FenceAuditRun.objects.order_by("-finished_at").first()
        context = {
            **self.admin_site.each_context(request),
            "title": "Needs attention",
            "opts": self.opts,
            "states": states,
            "stale_count": business.filter(stale_q(now)).count(),
            "stale_url": f"{changelist}?lease=stale",
            "oldest": oldest,
            "oldest_uncertain": next(o["oldest"] for o in oldest if o["state"] == "uncertain"),
            "oldest_needs_review": next(
                o["oldest"] for o in oldest if o["state"] == "needs_review"
            ),
            "follow_ups_open": follow_ups.exclude(state=OperationState.SUCCEEDED).count(),
            "follow_ups_url": f"{changelist}?followups=only",
            "failed_jobs": _failed_jobs(),
            "audit": audit,
            "audit_view": audit_view(audit, request),
            "changelist_url": changelist,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/payments/operation/needs_attention.html", context)

    # --- CSV export of the filtered list ----------------------------------------------

    def export_csv_view(self, request: HttpRequest) -> HttpResponseBase:
        """The operations list as CSV, with the same filters, search and order as the page."""
        if not self.has_view_permission(request):
            raise PermissionDenied(VIEW_PERMISSION)
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            return HttpResponseBadRequest("Unknown filter in the query string.")
        rows = changelist.queryset.prefetch_related(
            Prefetch("claims", queryset=StepClaim.objects.order_by("pk"))
        )
        stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
        response = StreamingHttpResponse(_csv_lines(rows), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="operations-{stamp}.csv"'
        return response


# --- queries of the desk ------------------------------------------------------------------


#: The most provider events listed on an operation's page (the newest).
PROVIDER_EVENTS_SHOWN = 50


def provider_events_of(op: Operation) -> list[dict[str, Any]]:
    """The provider events that touched `op` (webhooks and catch-up), oldest first, for its page."""
    rows = ProviderEvent.objects.filter(operation=op).order_by("-created", "-id")
    return [
        {
            "id": row.id,
            "type": row.type,
            "object": reference_link(row.object_id),
            "created": when(row.created),
            "received": when(row.received_at),
            "handled": when(row.handled_at),
            "outcome": row.outcome or "-",
        }
        for row in reversed(rows[:PROVIDER_EVENTS_SHOWN])
    ]


def money_by_state_and_kind(
    queryset: QuerySet[Operation],
) -> dict[str, dict[str, list[tuple[str, int]]]]:
    """Sum the params' amounts per state, kind and currency: {state: {kind: [(currency, n)]}}.

    Only operations whose params carry an integer amount count (a checkout or a
    refund does; a kind without money does not). A refund's amount gives money
    back, a checkout's takes it: they are never added together.
    """
    rows = (
        queryset.annotate(amount_text=KT("params__amount"), currency=Lower(KT("params__currency")))
        .filter(amount_text__regex=r"^[0-9]{1,18}$")
        .exclude(currency__isnull=True)
        .values("state", "kind", "currency")
        .annotate(total=Sum(Cast("amount_text", BigIntegerField())))
        .order_by("state", "kind", "currency")
    )
    totals: dict[str, dict[str, list[tuple[str, int]]]] = defaultdict(dict)
    for row in rows:
        by_kind = totals[row["state"]].setdefault(row["kind"], [])
        by_kind.append((row["currency"], int(row["total"] or 0)))
    return dict(totals)


def _totals_by_kind(by_kind: dict[str, list[tuple[str, int]]], *, labelled: bool) -> list[str]:
    """One line per kind ("€25.00 checkout", "€6.00 refund"); unlabelled when one kind has money."""
    if not by_kind:
        return ["-"]
    return [
        f"{format_totals(totals)} {kind}" if labelled else format_totals(totals)
        for kind, totals in sorted(by_kind.items())
    ]


def desk_counts() -> list[dict[str, Any]]:
    """What the admin's home page shows of the desk: unfinished and failed payments per state."""
    # Each state named, so that each count reads a partial index (unfinished or failed
    # operations, migration 0014), never every operation.
    business = Operation.objects.exclude(follow_up_q())
    unfinished = business.filter(state__in=UNFINISHED_OPERATION_STATES)
    counts = dict(unfinished.values_list("state").annotate(n=Count("pk")))
    counts[OperationState.FAILED.value] = business.filter(state=OperationState.FAILED).count()
    changelist = reverse("admin:payments_operation_changelist")
    rows = [
        {"state": s, "label": s.label, "count": counts.get(s.value, 0),
         "url": f"{changelist}?state__exact={s.value}"}
        for s in OperationState
        if s != OperationState.SUCCEEDED
    ]  # fmt: skip
    rows.append(
        {"state": "stale", "label": "Stale (lease expired)",
         "count": unfinished.filter(stale_q()).count(), "url": f"{changelist}?lease=stale"}
    )  # fmt: skip
    return rows


CSV_COLUMNS = (
    "key", "kind", "entity_type", "entity_id", "amount", "currency", "state", "stale",
    "in_state_since", "attempts", "last_error", "provider_references", "follow_up",
    "created_at", "updated_at",
)  # fmt: skip


class _Echo:
    """A file-like object whose write returns the line, for a streamed csv.writer."""

    def write(self, value: str) -> str:
        return value


def _csv_safe(value: object) -> str:
    """Keep a spreadsheet from reading a cell as a formula (keys and errors come from outside)."""
    text = "" if value is None else str(value)
    return f"'{text}" if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _csv_lines(operations: Iterable[Operation]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(CSV_COLUMNS)
    kinds = set(follow_up_kinds())
    now = timezone.now()
    for op in cast("QuerySet[Operation]", operations).iterator(chunk_size=500):
        params = op.params if isinstance(op.params, dict) else {}
        currency = str(params.get("currency") or "")
        shown_amount = decimal_amount(params.get("amount"), currency)
        claims = list(op.claims.all())
        attempts = max([op.attempts, *(c.attempts for c in claims)])
        references = ";".join(c.provider_reference for c in claims if c.provider_reference)
        values = (
            op.key, op.kind, op.entity_type, op.entity_id, shown_amount, currency.upper(),
            op.state, "yes" if is_stale(op, now) else "",
            when(getattr(op, "state_since", None)) if op.state in AGED_STATES else "",
            attempts, op.last_error, references,
            "yes" if op.parent_id is not None or op.kind in kinds else "",
            when(op.created_at), when(op.updated_at),
        )  # fmt: skip
        yield writer.writerow([_csv_safe(v) for v in values])


# --- the last fence audit, as tables ------------------------------------------------------

#: Summary keys shown as figures, in this order (anything else appears under "Other").
AUDIT_FIGURES = (
    ("findings", "Findings"),
    ("provider_successes", "Provider successes"),
    ("done_claims", "Done claims"),
)
AUDIT_TABLES = (
    "window_start",
    "double_charges",
    "double_charged_entities",
    "unfenced",
    "unknown_references",
    "stale_uncertain",
    "steps",
    "clean",
)
#: At most this many rows per finding table (the command's output has them all).
AUDIT_ROWS = 50


def audit_view(run: FenceAuditRun | None, request: HttpRequest) -> dict[str, Any] | None:
    """The last fence audit's summary as tables, with links to operations, orders and references."""
    if run is None:
        return None
    summary = run.summary if isinstance(run.summary, dict) else {}
    raw_steps = summary.get("steps")
    steps: dict[str, Any] = raw_steps if isinstance(raw_steps, dict) else {}
    links = _OperationLinks(summary, steps)
    may_view_orders = request.user.has_perm("payments.view_order")

    def where(reference: str) -> str:
        place = str(steps.get(reference) or "")
        if not place or "/" not in place:
            return place or "-"
        key, step = place.rsplit("/", 1)
        return format_html("{} / {}", links.link(key), step)

    def entity(item: dict[str, Any]) -> str:
        kind, pk = str(item.get("entity_type") or ""), str(item.get("entity_id") or "")
        if kind == "order" and pk and may_view_orders:
            url = reverse("admin:payments_order_change", args=[pk])
            return format_html('<a href="{}">Order {}</a>', url, pk)
        return f"{kind} {pk}".strip() or "-"

    def references(refs: Any) -> str:
        return format_html_join(", ", "{}", ((reference_link(str(r)),) for r in _listed(refs)))

    def operations(ops: Any) -> str:
        keys = [_key_of(o) for o in _listed(ops)]
        return format_html_join(", ", "{}", ((links.link(k),) for k in keys if k))

    double = [
        {"operation": links.link(str(d.get("operation_key") or "")), "step": d.get("step", ""),
         "references": references(d.get("references"))}
        for d in _listed(summary.get("double_charges")) if isinstance(d, dict)
    ]  # fmt: skip
    entities = [
        {"entity": entity(d), "references": references(d.get("references")),
         "operations": operations(d.get("operations"))}
        for d in _listed(summary.get("double_charged_entities")) if isinstance(d, dict)
    ]  # fmt: skip
    unfenced = [
        {"reference": reference_link(str(r)), "where": where(str(r))}
        for r in _listed(summary.get("unfenced"))
    ]
    unknown = [
        {"reference": reference_link(str(r)), "where": where(str(r))}
        for r in _listed(summary.get("unknown_references"))
    ]
    stale = []
    for item in _listed(summary.get("stale_uncertain")):
        key, _, step = str(item).rpartition("/")
        stale.append({"operation": links.link(key or str(item)), "step": step if key else "-"})
    known = {name for name, _ in AUDIT_FIGURES} | set(AUDIT_TABLES)
    return {
        "clean": summary.get("clean"),
        "finished": when(run.finished_at),
        "finished_ago": timesince(run.finished_at, timezone.now()),
        "window_start": when(run.window_start),
        "figures": [(label, summary.get(name, "-")) for name, label in AUDIT_FIGURES],
        "tables": [
            {
                "id": "audit-double-charges",
                "title": "Double charges per step",
                "columns": ("Operation", "Step", "References"),
                "rows": [(d["operation"], d["step"], d["references"]) for d in double],
                "total": _total(summary, "double_charges"),
            },
            {
                "id": "audit-double-charged-entities",
                "title": "Double charges per order",
                "columns": ("Order", "References", "Operations"),
                "rows": [(d["entity"], d["references"], d["operations"]) for d in entities],
                "total": _total(summary, "double_charged_entities"),
                "absent": "double_charged_entities" not in summary,
            },
            {
                "id": "audit-unfenced",
                "title": "Provider successes without a done claim (unfenced)",
                "columns": ("Reference", "Operation / step (from the provider's metadata)"),
                "rows": [(u["reference"], u["where"]) for u in unfenced],
                "total": _total(summary, "unfenced"),
            },
            {
                "id": "audit-unknown",
                "title": "Done claims the provider does not show succeeded",
                "columns": ("Reference", "Operation / step"),
                "rows": [(u["reference"], u["where"]) for u in unknown],
                "total": _total(summary, "unknown_references"),
            },
            {
                "id": "audit-stale",
                "title": "Uncertain past the grace period",
                "columns": ("Operation", "Step"),
                "rows": [(u["operation"], u["step"]) for u in stale],
                "total": _total(summary, "stale_uncertain"),
            },
        ],  # fmt: skip
        "other": [
            (name.replace("_", " ").capitalize(), _plain(value))
            for name, value in sorted(summary.items())
            if name not in known
        ],
    }


def _listed(value: Any) -> list[Any]:
    return list(value)[:AUDIT_ROWS] if isinstance(value, list | tuple) else []


def _count(value: Any) -> int:
    return len(value) if isinstance(value, list | tuple) else 0


def _total(summary: dict[str, Any], kind: str) -> int:
    """How many findings of `kind` the audit counted (it stores only the first ones)."""
    counts = summary.get("counts")
    if isinstance(counts, dict) and isinstance(counts.get(kind), int):
        return int(counts[kind])
    return _count(summary.get(kind))


def _key_of(item: Any) -> str:
    if isinstance(item, dict):
        return str(item.get("operation_key") or item.get("key") or "")
    return str(item)


def _plain(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or "-"
    if value is None or value == "":
        return "-"
    return str(value)


class _OperationLinks:
    """Links to the operations an audit names by key (one query for all of them)."""

    def __init__(self, summary: dict[str, Any], steps: dict[str, Any]) -> None:
        keys: set[str] = set()
        for item in _listed(summary.get("double_charges")):
            if isinstance(item, dict):
                keys.add(str(item.get("operation_key") or ""))
        for item in _listed(summary.get("double_charged_entities")):
            if isinstance(item, dict):
                keys.update(_key_of(o) for o in _listed(item.get("operations")))
        keys.update(str(v).rpartition("/")[0] for v in _listed(summary.get("stale_uncertain")))
        keys.update(str(v).rpartition("/")[0] for v in steps.values())
        keys.discard("")
        found: dict[str, list[int]] = defaultdict(list)
        for key, pk in Operation.objects.filter(key__in=keys).values_list("key", "pk"):
            found[key].append(pk)
        self.pks = dict(found)
        self.changelist = reverse("admin:payments_operation_changelist")

    def link(self, key: str) -> str:
        if not key:
            return "-"
        pks = self.pks.get(key, [])
        if len(pks) == 1:
            url = reverse("admin:payments_operation_change", args=[pks[0]])
        elif pks:  # the same key in two scopes: let the list show both
            url = f"{self.changelist}?{urlencode({'q': key, 'followups': 'all'})}"
        else:
            return format_html("<code>{}</code> <small>(no such operation)</small>", key)
        return format_html('<a href="{}">{}</a>', url, key)


def _query_report_message(rows: list[Any], summary: str) -> str:
    """The bulk query's result: the counts, then each operation with what came back."""
    items = format_html_join(
        "",
        '<li class="desk-query-row"><a href="{}">{}</a>: {} <small>({} → {})</small></li>',
        (
            (
                reverse("admin:payments_operation_change", args=[row.operation_id]),
                row.key,
                str(row.outcome).replace("_", " "),
                state_badge(row.state_before),
                state_badge(row.state_after),
            )
            for row in rows
        ),
    )
    return format_html(
        'Queried the provider for {} operation(s): {}.<ul class="desk-query-report">{}</ul>',
        len(rows),
        summary,
        items,
    )


def _oldest(
    queryset: QuerySet[Operation], state: OperationState, now: datetime
) -> dict[str, Any] | None:
    op = with_state_since(queryset.filter(state=state)).order_by("state_since").first()
    if op is None:
        return None
    return {
        "operation": op,
        "age": timesince(op.state_since, now),
        "amount": money_line(op),
        "stale": is_stale(op, now),
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


def action_title(spec: DeskAction, step: str) -> str:
    """The action as its button names it: "Mark refund succeeded" for step refund."""
    return spec.title.replace("step", step) if step else spec.title


def _form_for(spec: DeskAction, op: Operation, step: str, data: Any) -> forms.Form:
    """The action's form, worded for this operation's kind and step."""
    form_class = spec.form
    if form_class is NewAttemptForm and "payment_method" not in (op.params or {}):
        form_class = ReasonForm  # this kind's attempts take no payment method (a refund)
    form = form_class(data)
    if "reference" in form.fields:
        example = _reference_example(op, step)
        form.fields["reference"].help_text = (
            f"The id of step {step} at the provider{f' ({example})' if example else ''}; "
            "it is checked with the provider before anything changes."
        )
    return form


def _reference_example(op: Operation, step: str) -> str:
    """What a reference of this kind's step looks like ("re_…"), from one already recorded."""
    known = (
        StepClaim.objects.filter(operation__kind=op.kind, step=step)
        .exclude(provider_reference="")
        .order_by("-pk")
        .values_list("provider_reference", flat=True)
        .first()
    )
    prefix, underscore, _ = (known or "").partition("_")
    return f"{prefix}_…" if underscore and prefix else ""


def _hook_says(hook: Callable[..., Any] | None) -> str:
    """What a handler's hook does, in its own words (the first sentence of its docstring)."""
    if hook is None:
        return ""
    doc = (hook.__doc__ or "").strip()
    first = doc.split(". ", 1)[0].splitlines()[0].strip().rstrip(".") if doc else ""
    return first or hook.__name__.replace("_", " ")


def _next_key_or_blank(op: Operation) -> str:
    try:
        return desk.next_attempt_key(op)
    except desk.DeskError:
        return ""
