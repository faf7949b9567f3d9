"""Needs attention: counts and money by state, the oldest waits, failed jobs, the last audit."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.text import Truncator
from django.utils.timesince import timesince

from payments.desk.display import AGED_STATES, is_stale, money_line, state_badge, when
from payments.desk.evidence import (
    incident,
    incident_html,
    operation_label,
    taken_not_settled,
    why_waiting,
)
from payments.desk.lists import NothingRanFilter
from payments.desk.rules import a_new_attempt
from payments.desk.views.audit import audit_view
from payments.desk.views.base import VIEW_PERMISSION, DeskBase
from payments.desk.views.chart import legend, outcomes_per_hour, outcomes_svg
from payments.desk.views.nothing_ran import (
    FAILED_BEFORE_RUNNING_MOST,
    failed_before_running,
    failed_before_running_not_listed,
)
from payments.desk.views.queries import (
    business_kinds,
    counts_by_state,
    follow_up_kinds,
    follow_up_q,
    money_by_state_and_kind,
    recently_failed_q,
    stale_q,
    state_label,
    totals_by_kind,
    window_words,
    with_last_reason,
    with_waiting_since,
)
from payments.desk.views.rq_links import failed_jobs
from payments.models import UNFINISHED_OPERATION_STATES, FenceAuditRun, Operation, OperationState


class NeedsAttentionMixin(DeskBase):
    """The Needs attention page of the operations admin."""

    # --- Needs attention -----------------------------------------------------------

    def needs_attention_view(self, request: HttpRequest) -> HttpResponse:
        """Counts and money by state, the oldest waits, RQ's failed jobs, the last fence audit.

        Follow-ups (ledger, sales counter) are counted apart: the headline
        figures are the customers' payments. Every figure reads unfinished
        operations, the ones failed within FAILED_WINDOW or the chart's last
        hours, each through its partial index: never the history. The cases
        failed before anything ran are the window's; the page says how many
        more there are, and whether older ones are (nothing_ran's bounds).
        """
        if not self.has_view_permission(request):
            raise PermissionDenied(VIEW_PERMISSION)
        now = timezone.now()
        business = Operation.objects.exclude(follow_up_q())
        counts = counts_by_state(business, now)
        failed = business.filter(recently_failed_q(now))
        # A failed operation with a new attempt is counted failed; its money is the attempt's,
        # under the attempt's own state (one probe each of the retry_of partial index).
        retried = Exists(Operation.objects.filter(retry_of=OuterRef("pk")))
        totals = {
            **money_by_state_and_kind(business.filter(state__in=UNFINISHED_OPERATION_STATES)),
            **money_by_state_and_kind(failed.exclude(retried)),
        }
        retried_count = failed.filter(retried).count()
        # A refund's money is not a charge's: with more than one kind registered, every
        # total names its kind, whichever kinds happen to be unfinished now.
        labelled = len(business_kinds()) > 1
        changelist = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        states = []
        for s in OperationState:
            if s == OperationState.SUCCEEDED:
                continue  # nothing to do there; the chart shows how many succeeded
            lines = totals_by_kind(totals.get(s.value, {}), labelled=labelled)
            if s == OperationState.FAILED and retried_count:
                lines.append(
                    "1 retried: its money under its attempt"
                    if retried_count == 1
                    else f"{retried_count} retried: their money under their attempts"
                )
            states.append(
                {"state": s, "label": state_label(s), "count": counts.get(s.value, 0),
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
        bars = outcomes_per_hour(business, now)
        follow_ups = Operation.objects.filter(follow_up_q())
        # Two counts, each through its partial index (one IN list could use neither).
        follow_ups_open = (
            follow_ups.filter(state__in=UNFINISHED_OPERATION_STATES).count()
            + follow_ups.filter(state=OperationState.FAILED).count()
        )
        audit = FenceAuditRun.objects.order_by("-finished_at").first()
        stale_count = business.filter(stale_q(now)).count()
        nothing_ran = failed_before_running(now, among=business)
        context = {
            **self.admin_site.each_context(request),
            "title": "Needs attention",
            "opts": self.opts,
            "states": states,
            "stale_count": stale_count,
            "stale_url": f"{changelist}?lease=stale",
            "oldest": oldest,
            "oldest_uncertain": next(o["oldest"] for o in oldest if o["state"] == "uncertain"),
            "oldest_needs_review": next(
                o["oldest"] for o in oldest if o["state"] == "needs_review"
            ),
            "follow_ups_open": follow_ups_open,
            "follow_up_kinds": ", ".join(follow_up_kinds()) or "none registered",
            "follow_ups_url": f"{changelist}?followups=open",
            "failed_jobs": failed_jobs(),
            "audit": audit,
            "audit_view": audit_view(audit, request),
            "changelist_url": changelist,
            "cases": cases_page(business, request, now, nothing_ran),
            # The cases' count in the parts the figures above count (the same queries).
            "cases_parts": {
                "uncertain": counts.get(OperationState.UNCERTAIN.value, 0),
                "needs_review": counts.get(OperationState.NEEDS_REVIEW.value, 0),
                "stale": stale_count,
                "nothing_ran": len(nothing_ran),
                "failed": counts.get(OperationState.FAILED.value, 0),
            },
            "window": window_words(),
            "not_listed": failed_before_running_not_listed(business, now, listed=len(nothing_ran)),
            "listed_most": FAILED_BEFORE_RUNNING_MOST,
            "nothing_ran_url": f"{changelist}?{NothingRanFilter.parameter_name}=yes",
            "chart": outcomes_svg(bars),
            "legend": legend(bars),
            "incident": incident_html(incident(), need_a_person=len(nothing_ran)),
            # What the provider showed taken for steps not settled yet (evidence, not verdict).
            "taken_not_settled": " and ".join(taken_not_settled()),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/payments/operation/needs_attention.html", context)


def _oldest(
    queryset: QuerySet[Operation], state: OperationState, now: datetime
) -> dict[str, Any] | None:
    op = with_waiting_since(queryset.filter(state=state)).order_by("waiting_since").first()
    if op is None:
        return None
    return {
        "operation": op,
        "age": timesince(op.waiting_since, now),  # as the cases below count it
        "amount": money_line(op),
        "stale": is_stale(op, now),
        "url": reverse("admin:payments_operation_change", args=[op.pk]),
    }


def _nothing_ran(op: Operation) -> str:
    """A case failed before anything ran (failed_before_running): what to do with it."""
    how = a_new_attempt(op)
    return (
        f"Nothing ran at {operation_label(op)}: every request was refused before it "
        f"executed, and the fence gave up. If it is still wanted: {how}. ({op.last_error})"
    )


#: The states an operator works: the provider must be asked, or a person decide.
CASE_STATES = (OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW)
CASES_PER_PAGE = 25


def cases_page(
    business: QuerySet[Operation], request: HttpRequest, now: datetime, nothing_ran: list[int]
) -> Any:
    """The cases to work, the longest waiting first, one page of them, with age and money:
    uncertain, under review, stale, and `nothing_ran` (failed_before_running's). An
    operation moved from uncertain to review waits since it went uncertain."""
    cases = with_last_reason(
        with_waiting_since(
            business.filter(Q(state__in=CASE_STATES) | stale_q(now) | Q(pk__in=nothing_ran))
        )
    )
    paginator = Paginator(cases.order_by("waiting_since", "pk"), CASES_PER_PAGE)
    page = paginator.get_page(request.GET.get("page"))
    # What the fence saw at its last look says more than its last audit row's reason.
    seen = why_waiting([op.pk for op in page.object_list])
    page.rows = [  # type: ignore[attr-defined]
        {
            "operation": op,
            "url": reverse("admin:payments_operation_change", args=[op.pk]),
            "badge": state_badge(op.state),
            "stale": is_stale(op, now),
            "age": timesince(op.waiting_since, now),
            "since": when(op.waiting_since),
            "amount": money_line(op),
            # As the operation's page: the last error, else its last audit row's reason.
            "error": Truncator(
                _nothing_ran(op)
                if op.state == OperationState.FAILED
                else seen.get(op.pk) or op.last_error or getattr(op, "last_reason", "") or ""
            ).chars(240),
        }
        for op in page.object_list
    ]
    return page
