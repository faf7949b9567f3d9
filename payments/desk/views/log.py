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


#: Seconds apart, at most, two audit rows of one press (the same operator) may be.
PRESS_SECONDS = 2.0
#: How a claim's hand-over to a new owner reads (payments.engine.fence.take_over_claim).
HANDED_OVER = "taken over from"


def _rows(events: list[OperationEvent]) -> list[dict[str, Any]]:
    """Each press as the log shows it, from its audit rows: when, who, what, which
    operation, why, and every state change the press made (`_presses`)."""
    operations = {
        op.pk: op
        for op in Operation.objects.filter(pk__in={e.operation_id for e in events}).only(
            "pk", "key", "kind", "entity_type", "entity_id", "retry_of_id"
        )
    }
    rows = []
    for press in _presses(events, operations):
        # Named by its newest row that is not a hand-over (a look's row, the new attempt).
        main = next((e for e in press if not _handed_over(e)), press[0])
        action, why = _what(main)
        op = operations.get(main.operation_id)
        changes = [
            {"change": change, "step": event.step}
            for event in reversed(press)  # in the order they were made
            if (change := _change(event))
        ]
        others = [operations.get(pk) for pk in dict.fromkeys(e.operation_id for e in press)]
        rows.append(
            {
                "event": main,
                "events": " ".join(str(e.pk) for e in press),
                "when": when(main.created_at),
                "who": main.actor.removeprefix(OPERATOR),
                "action": action or (changes[0]["change"] if changes else "-"),
                "reason": why,
                "changes": changes if action else changes[1:],
                "operation": op,
                "url": reverse("admin:payments_operation_change", args=[main.operation_id]),
                "also": [
                    {"operation": other, "url": _change_url(other.pk)}
                    for other in others
                    if other is not None and other.pk != main.operation_id
                ],
            }
        )
    return rows


def _change_url(pk: int) -> str:
    return reverse("admin:payments_operation_change", args=[pk])


def _handed_over(event: OperationEvent) -> bool:
    """A claim handed to the operator before a press acted on it: an owner's change, no
    state's (the fence audits it; the press's own row follows)."""
    return event.reason.startswith(HANDED_OVER) and event.from_state == event.to_state


def _presses(
    events: list[OperationEvent], operations: dict[int, Operation]
) -> list[list[OperationEvent]]:
    """The audit rows (newest first) grouped by the press that wrote them: one operator's
    rows within PRESS_SECONDS of the group's newest, on an operation of the group (the step
    and the operation it resumed, the claim handed over before a look) or on the new
    attempt of one (its creation, then the attempt itself). A bulk query's operations stay
    apart: each is its own look."""
    presses: list[list[OperationEvent]] = []
    for event in events:
        # A hand-over joins its look's line wherever it is among this press's: a bulk
        # query hands every claim over first and writes the looks' rows after.
        candidates = _recent(presses, event) if _handed_over(event) else presses[-1:]
        group = next((g for g in candidates if _same_press(g, event, operations)), None)
        if group is not None:
            group.append(event)
        else:
            presses.append([event])
    return presses


def _recent(
    presses: list[list[OperationEvent]], event: OperationEvent
) -> list[list[OperationEvent]]:
    """The lines, the latest first, whose newest row is within PRESS_SECONDS of `event`."""
    found = []
    for group in reversed(presses):
        if abs((group[0].created_at - event.created_at).total_seconds()) > PRESS_SECONDS:
            break
        found.append(group)
    return found


def _same_press(
    group: list[OperationEvent], event: OperationEvent, operations: dict[int, Operation]
) -> bool:
    first = group[0]
    if event.actor != first.actor:
        return False
    if abs((first.created_at - event.created_at).total_seconds()) > PRESS_SECONDS:
        return False
    if not _handed_over(event) and _what(event)[0] in {
        _what(e)[0] for e in group if not _handed_over(e)
    }:
        return False  # the same action again: a second press (a double click), its own line
    ops = {e.operation_id for e in group}
    if event.operation_id in ops:
        # One operation: the same reason typed, or a row that carries none of its own.
        why, other = _what(event)[1], _what(first)[1]
        return why == other or not why or not other or _handed_over(event)
    op = operations.get(event.operation_id)
    return op is not None and op.retry_of_id in ops  # the new attempt of one of them


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
