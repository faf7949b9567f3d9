"""A small chart of outcomes per hour, server-rendered as SVG: readable at a glance, no script.

Counted from the operations themselves (their state and the hour it last
changed), not from the audit trail: one row per operation, read over the
last day in one grouped query per state, each a range of that state's index
on `updated_at` (succeeded, failed) or of the unfinished operations' index:
a day's rows, however long the history. The day is FAILED_WINDOW, from the
same instant as "Failed (last 24 h)": the legend's "declined or failed" is
that figure, its first and last hours partial.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, QuerySet
from django.db.models.functions import TruncHour
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from payments.desk.display import BADGE_COLOURS
from payments.desk.views.queries import FAILED_WINDOW
from payments.models import Operation, OperationState

#: What the chart stacks, bottom up, with the words an operator reads.
SERIES = (
    (OperationState.SUCCEEDED, "succeeded"),
    (OperationState.FAILED, "declined or failed"),
    (OperationState.UNCERTAIN, "uncertain"),
    (OperationState.NEEDS_REVIEW, "needs review"),
)
HOURS = int(FAILED_WINDOW / timedelta(hours=1))
BAR, GAP, HEIGHT, AXIS = 14, 4, 90, 16


@dataclass(frozen=True)
class HourBar:
    start: datetime
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def outcomes_per_hour(queryset: QuerySet[Operation], now: datetime | None = None) -> list[HourBar]:
    """The last HOURS hours, oldest first: per hour, operations that ended there in each state.

    From now - FAILED_WINDOW on, as the failed ones are counted: a bar for each hour that
    window touches (HOURS + 1 of them, the first and the last partial).
    """
    since = (now or timezone.now()) - FAILED_WINDOW
    start = since.replace(minute=0, second=0, microsecond=0)
    found: dict[tuple[datetime, str], int] = {}
    for state, _label in SERIES:
        rows = (
            queryset.filter(state=state, updated_at__gte=since)
            .annotate(hour=TruncHour("updated_at"))
            .values("hour")
            .annotate(n=Count("pk"))
        )
        found.update({(r["hour"], state): r["n"] for r in rows})
    hours = [start + timedelta(hours=i) for i in range(HOURS + 1)]
    return [HourBar(h, {s: found.get((h, s), 0) for s, _ in SERIES}) for h in hours]


def outcomes_svg(bars: list[HourBar]) -> SafeString:
    """Stacked bars, one per hour, with a legend; each bar's title gives its numbers."""
    peak = max((b.total for b in bars), default=0) or 1
    width = len(bars) * (BAR + GAP)
    shapes = []
    for i, bar in enumerate(bars):
        x, y = i * (BAR + GAP), HEIGHT
        for state, _label in SERIES:
            h = round(bar.counts[state] * HEIGHT / peak)
            if h:
                y -= h
                shapes.append((x, y, BAR, h, BADGE_COLOURS[state]))
        if i % 6 == 0 and i < len(bars) - 4:
            local = timezone.localtime(bar.start)
            # The zone on every label: an operator elsewhere must not read it as local time.
            shapes.append((x, HEIGHT + 12, 0, 0, f"{local:%H:%M} {local.tzname() or ''}".rstrip()))
    rects = format_html_join(
        "",
        '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"></rect>',
        ((x, y, w, h, fill) for x, y, w, h, fill in shapes if w),
    )
    ticks = format_html_join(
        "",
        '<text x="{}" y="{}" font-size="10" fill="currentColor">{}</text>',
        ((x, y, text) for x, y, w, _h, text in shapes if not w),
    )
    titles = format_html_join(
        "",
        '<rect x="{}" y="0" width="{}" height="{}" fill="transparent"><title>{}</title></rect>',
        ((i * (BAR + GAP), BAR, HEIGHT, _title(bar)) for i, bar in enumerate(bars)),
    )
    now = format_html(
        '<text x="{}" y="{}" font-size="10" text-anchor="end" fill="currentColor">now</text>',
        width,
        HEIGHT + 12,
    )
    return format_html(
        '<svg class="desk-chart" role="img" viewBox="0 0 {} {}" width="100%" '
        'preserveAspectRatio="xMinYMin meet" aria-label="{}">{}{}{}{}</svg>',
        width,
        HEIGHT + AXIS,
        f"Outcomes per hour over the last {HOURS} hours",
        rects,
        ticks,
        now,
        titles,
    )


def _title(bar: HourBar) -> str:
    local = timezone.localtime(bar.start)
    parts = ", ".join(f"{bar.counts[s]} {label}" for s, label in SERIES)
    return f"{local:%Y-%m-%d %H:%M %Z}: {parts}"


def legend(bars: list[HourBar]) -> list[dict[str, object]]:
    """The chart's legend: each series' colour, words and total over the chart's hours."""
    return [
        {"state": s, "label": label, "colour": BADGE_COLOURS[s],
         "total": sum(b.counts[s] for b in bars)}
        for s, label in SERIES
    ]  # fmt: skip
