"""Finding a moment in a long table by its primary key.

Rows of the fence are inserted at their own time (`created_at`, a claim's
`claimed_at`: the database's clock, in short transactions), so their ids
grow with it. A bisection over the primary key finds where a moment falls
in a few index lookups, where a range on the unindexed time would read
every row: the audit finds one day's claims this way, the purge where the
kept history begins.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Model


def first_id_from(model: type[Model], time_field: str, moment: datetime) -> int:
    """An id that splits `model`'s rows at `moment`: those below it are older, those from
    it on at or after (one past the last id if none is)."""
    ids = model._default_manager.order_by("pk").values_list("pk", flat=True)
    low, last = ids.first(), ids.reverse().first()
    if low is None or last is None:
        return 1
    high = last + 1
    while low < high:
        middle = (low + high) // 2  # <= last: a row exists at or after it
        found, at = (
            model._default_manager.filter(pk__gte=middle)
            .order_by("pk")
            .values_list("pk", time_field)
            .first()
        ) or (last, moment)
        if at >= moment:
            high = middle  # no row between middle and the one found
        else:
            low = found + 1
    return low
