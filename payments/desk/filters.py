"""A date range filter for the desk's lists: from a day, to a day (both included)."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.dateparse import parse_date


class DateRangeFilter(admin.FieldListFilter):
    """Filter a date-time field by `<field>__from` and `<field>__to` (days, in the desk's zone).

    Shown in the sidebar as two date inputs; a day the browser cannot parse is
    ignored (the list then says it is not filtered by it).
    """

    template = "admin/payments/date_range_filter.html"

    def __init__(self, field: Any, request: HttpRequest, params: Any, model: Any,
                 model_admin: Any, field_path: str) -> None:  # fmt: skip
        self.from_param, self.to_param = f"{field_path}__from", f"{field_path}__to"
        super().__init__(field, request, params, model, model_admin, field_path)
        # The base class took the expected parameters out of `params` into used_parameters.
        self.start = _day(self.used_parameters.get(self.from_param))
        self.end = _day(self.used_parameters.get(self.to_param))

    def expected_parameters(self) -> list[str | None]:
        return [self.from_param, self.to_param]

    def has_output(self) -> bool:
        return True

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.start is not None:
            queryset = queryset.filter(**{f"{self.field_path}__gte": _midnight(self.start)})
        if self.end is not None:
            end = _midnight(self.end + timedelta(days=1))
            queryset = queryset.filter(**{f"{self.field_path}__lt": end})
        return queryset

    def choices(self, changelist: Any) -> Any:
        """One "choice": the form's values and the query string to keep (the other filters)."""
        keep = {
            k: v for k, v in changelist.get_filters_params().items()
            if k not in (self.from_param, self.to_param)
        }  # fmt: skip
        if changelist.query:
            keep["q"] = changelist.query
        yield {
            "from_param": self.from_param,
            "to_param": self.to_param,
            "start": self.start.isoformat() if self.start else "",
            "end": self.end.isoformat() if self.end else "",
            "keep": [(k, v) for k, values in keep.items() for v in _listed(values)],
            "clear": changelist.get_query_string(remove=[self.from_param, self.to_param]),
            "selected": self.start is not None or self.end is not None,
            "display": "",
            "query_string": "",
        }


def _day(value: Any) -> date | None:
    text = value[-1] if isinstance(value, list) and value else value
    try:
        return parse_date(str(text)) if text else None
    except ValueError:
        return None


def _midnight(day: date) -> datetime:
    return timezone.make_aware(datetime.combine(day, time.min))


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
