"""A date range filter for the desk's lists: from a day, to a day (both included)."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.dateparse import parse_date


class DateRangeFilter(admin.FieldListFilter):
    """Filter a date-time field by `<field>__from` and `<field>__to` (days, in the desk's zone).

    Shown in the sidebar as two date inputs. A value that is no day (`2026-02-30`,
    `abc`) is not filtered by, and a message names it; the last day of the calendar
    means no upper bound.
    """

    template = "admin/payments/date_range_filter.html"

    def __init__(self, field: Any, request: HttpRequest, params: Any, model: Any,
                 model_admin: Any, field_path: str) -> None:  # fmt: skip
        self.from_param, self.to_param = f"{field_path}__from", f"{field_path}__to"
        super().__init__(field, request, params, model, model_admin, field_path)
        # The base class took the expected parameters out of `params` into used_parameters.
        self.start = self._day_or_say(request, self.from_param, "from")
        self.end = self._day_or_say(request, self.to_param, "to")

    def _day_or_say(self, request: HttpRequest, param: str, side: str) -> date | None:
        """The day a parameter names; a value that is no day is dropped with a message."""
        text = _last(self.used_parameters.get(param))
        day = _day(text)
        if text and day is None:
            label = self.title if isinstance(self.title, str) else str(self.title)
            messages.warning(
                request,
                f"Not filtered by {label} ({side}): “{text}” is not a day (YYYY-MM-DD).",
            )
        return day

    def expected_parameters(self) -> list[str | None]:
        return [self.from_param, self.to_param]

    def has_output(self) -> bool:
        return True

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.start is not None:
            queryset = queryset.filter(**{f"{self.field_path}__gte": _midnight(self.start)})
        if self.end is not None and self.end < date.max:  # the last day: no upper bound
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


def _last(value: Any) -> str:
    """The last value of a query parameter, as text ("" when none)."""
    text = value[-1] if isinstance(value, list) and value else value
    return str(text) if text else ""


def _day(text: str) -> date | None:
    try:
        return parse_date(text) if text else None
    except ValueError:  # well formed, but no such day (2026-02-30)
        return None


def _midnight(day: date) -> datetime:
    return timezone.make_aware(datetime.combine(day, time.min))


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
