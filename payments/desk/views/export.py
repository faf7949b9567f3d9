"""The operations list as CSV, with the list's filters, search and order."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator
from typing import cast

from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied
from django.db.models import Prefetch, QuerySet
from django.http import HttpRequest, HttpResponseBadRequest, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone

from payments.desk.display import AGED_STATES, is_stale, when
from payments.desk.views.base import VIEW_PERMISSION, DeskBase
from payments.desk.views.queries import (
    attempts_of,
    external_kinds,
    follow_up_kinds,
    lookups_of,
)
from payments.models import Operation, StepClaim
from payments.money import decimal_amount

CSV_COLUMNS = (
    "key", "kind", "entity_type", "entity_id", "amount", "currency", "state", "stale",
    "in_state_since", "attempts", "lookups", "last_error", "provider_references", "follow_up",
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
    kinds, external = set(follow_up_kinds()), set(external_kinds())
    now = timezone.now()
    for op in cast("QuerySet[Operation]", operations).iterator(chunk_size=500):
        params = op.params if isinstance(op.params, dict) else {}
        currency = str(params.get("currency") or "")
        shown_amount = decimal_amount(params.get("amount"), currency)
        claims = list(op.claims.all())
        references = ";".join(c.provider_reference for c in claims if c.provider_reference)
        values = (
            op.key, op.kind, op.entity_type, op.entity_id, shown_amount, currency.upper(),
            op.state, "yes" if is_stale(op, now) else "",
            when(getattr(op, "state_since", None)) if op.state in AGED_STATES else "",
            attempts_of(op), lookups_of(op), op.last_error, references,
            "yes" if (op.parent_id is not None and op.kind not in external) or op.kind in kinds
            else "",
            when(op.created_at), when(op.updated_at),
        )  # fmt: skip
        yield writer.writerow([_csv_safe(v) for v in values])


class CsvExportMixin(DeskBase):
    """The CSV export view of the operations admin."""

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
