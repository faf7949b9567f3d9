"""The desk log: what every operator did recently, newest first, a bounded read per page.

Read from the fence's own audit rows whose actor is an operator (`operator:<name>`,
`payments.desk.services.actor_of`): every desk service writes them with the reason
typed, whichever page, command or tool called it, and they are kept as long as the
operation's history. The audit table has no index on its actor, and none is added
for a page (each index is written on every audit row): a page walks the primary key
backwards through at most SPAN rows, an index range scan, and when it found fewer
than a page's rows there, says how far back it looked and links on from there. So a
page costs the same whether the history holds a day or a year, and whether the
operators acted a minute or a month ago.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import connection
from django.db.models import Max
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import urlencode

from payments.desk.display import LABELS, history_message, when
from payments.desk.views.actions import outcome_words
from payments.desk.views.base import VIEW_PERMISSION, DeskBase
from payments.models import Operation, OperationEvent

#: How an operator's audit rows name their actor (payments.desk.services.actor_of).
OPERATOR = "operator:"
#: How the desk words a look-up's row (payments.desk.services.query_provider).
QUERIED = "queried the provider"
#: Rows on one page.
ROWS_PER_PAGE = 50
#: Audit rows (of anyone) one page looks through at most, newest first by primary key.
SPAN = 20_000


_TABLE = OperationEvent._meta.db_table

#: The operators' audit rows among the `span` newest audit rows below `top`, newest first
#: (`operator` '': every operator's). The inner LIMIT bounds the read to a backward walk of
#: the primary key: the actor has no index, and a filter on it cannot pass that LIMIT.
OPERATOR_ROWS = f"""
SELECT recent.*
FROM (
    SELECT id, operation_id, step, from_state, to_state, actor, reason, created_at
    FROM {_TABLE}
    WHERE id < %(top)s
    ORDER BY id DESC
    LIMIT %(span)s
) AS recent
WHERE recent.actor LIKE 'operator:%%'
  AND (%(operator)s = '' OR recent.actor = 'operator:' || %(operator)s)
ORDER BY recent.id DESC
LIMIT %(rows)s
"""

#: The oldest audit row of that span (none: the span reaches the first row).
SPAN_END = f"""
SELECT id, created_at
FROM {_TABLE}
WHERE id < %(top)s
ORDER BY id DESC
OFFSET %(last)s
LIMIT 1
"""


@dataclass(frozen=True)
class LogPage:
    """One page of the log: its rows, and where the next (older) page starts."""

    rows: list[dict[str, Any]]
    #: The primary key the next page starts below; None: nothing older.
    older: int | None
    #: The oldest audit row this page looked at, when it ran out of span before a full page.
    looked_back_to: datetime | None


def read_page(before: int | None, operator: str = "") -> LogPage:
    """The operators' audit rows below `before` (None: the newest), at most one span's worth."""
    top = before if before is not None else _newest_pk() + 1
    params = {"top": top, "span": SPAN, "operator": operator, "rows": ROWS_PER_PAGE + 1}
    found = list(OperationEvent.objects.raw(OPERATOR_ROWS, params))
    rows = _rows(found[:ROWS_PER_PAGE])
    if len(found) > ROWS_PER_PAGE:
        return LogPage(rows, older=found[ROWS_PER_PAGE - 1].pk, looked_back_to=None)
    # Fewer than a page in the span: older audit rows may still hold desk actions.
    with connection.cursor() as cursor:
        cursor.execute(SPAN_END, {"top": top, "last": SPAN - 1})
        end = cursor.fetchone()
    if end is None or not OperationEvent.objects.filter(pk__lt=end[0]).exists():
        return LogPage(rows, older=None, looked_back_to=None)
    return LogPage(rows, older=int(end[0]), looked_back_to=end[1])


def _newest_pk() -> int:
    """The newest audit row's id (the primary key's last entry: no scan)."""
    return int(OperationEvent.objects.aggregate(newest=Max("pk"))["newest"] or 0)


def _rows(events: list[OperationEvent]) -> list[dict[str, Any]]:
    """Each audit row as the log shows it: when, who, what, which operation, why."""
    operations = {
        op.pk: op
        for op in Operation.objects.filter(pk__in={e.operation_id for e in events}).only(
            "pk", "key", "kind", "entity_type", "entity_id"
        )
    }
    rows = []
    for event in events:
        action, why = _what(event)
        change = _change(event)
        op = operations.get(event.operation_id)
        rows.append(
            {
                "event": event,
                "when": when(event.created_at),
                "who": event.actor.removeprefix(OPERATOR),
                "action": action or change or "-",
                "reason": why,
                "change": change if action else "",
                "operation": op,
                "url": reverse("admin:payments_operation_change", args=[event.operation_id]),
            }
        )
    return rows


def _what(event: OperationEvent) -> tuple[str, str]:
    """What the row says was done, and why: a desk row's reason reads "<what>: <why>"
    (payments.desk.services' wording), codes in words, as the History shows them."""
    action, colon, why = event.reason.partition(": ")
    if not colon:
        action, why = event.reason, ""
    if action == QUERIED:  # its "why" is the look-up's outcome, in the engine's words
        why = outcome_words().get(why.replace(" ", "_"), why)
    action = history_message(action, {})
    return action[:1].upper() + action[1:], history_message(why, {})


def _change(event: OperationEvent) -> str:
    """The state change the row records ("Uncertain → Retrying"), or "" when none."""
    if not event.from_state or event.from_state == event.to_state:
        return ""
    before = LABELS.get(event.from_state, event.from_state)
    after = LABELS.get(event.to_state, event.to_state)
    return f"{before} → {after}"


class DeskLogMixin(DeskBase):
    """The Desk log page of the operations admin."""

    def desk_log_view(self, request: HttpRequest) -> HttpResponse:
        """Every operator's desk actions, newest first; `?operator=` for one, `?before=` older."""
        if not self.has_view_permission(request):
            raise PermissionDenied(VIEW_PERMISSION)
        operator = request.GET.get("operator", "").strip()[:150]
        raw_before = request.GET.get("before", "")
        # A bigint's digits at most: anything else is the newest page.
        before = int(raw_before) if raw_before.isdigit() and len(raw_before) <= 18 else None
        page = read_page(before, operator)
        url = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_desk_log")
        context = {
            **self.admin_site.each_context(request),
            "title": f"Desk log: {operator}" if operator else "Desk log",
            "opts": self.opts,
            "page": page,
            "operator": operator,
            "first_page": before is None,
            "newest_url": _page_url(url, operator, None),
            "older_url": _page_url(url, operator, page.older) if page.older is not None else "",
            "all_url": url,
            "span": SPAN,
            "reached": when(page.looked_back_to) if page.looked_back_to else "",
            "needs_attention_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_needs_attention"
            ),
            "changelist_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist"
            ),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/payments/operation/desk_log.html", context)


def _page_url(url: str, operator: str, before: int | None) -> str:
    """The log's URL for one operator's (or everyone's) rows below `before` (None: newest)."""
    query = {"operator": operator} if operator else {}
    if before is not None:
        query["before"] = str(before)
    return f"{url}?{urlencode(query)}" if query else url
