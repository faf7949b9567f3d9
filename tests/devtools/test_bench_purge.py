"""The bench's purge comparison runs both sides on the same rows and reports each figure.

No timing is asserted: only that both sides deleted every row and the figures are there.
"""

from __future__ import annotations

import pytest

from devtools.bench.runner import purge_rate
from inbox.models import InboxEntry

# transaction=True: the bench vacuums the table, which cannot run in a transaction.
pytestmark = pytest.mark.django_db(transaction=True)


def test_purge_rate__both_sides_delete_every_row_and_report_the_longest_batch() -> None:
    figures = purge_rate(2000, batch_size=300, rounds=1)

    assert figures["rows"] == figures["unbounded_rows"] == 2000
    assert 0 < figures["largest_batch"] <= 300
    assert figures["batches"] >= 2000 // 300
    assert figures["longest_batch_seconds"] > 0
    assert figures["ratio_batched_to_unbounded_rate"] == pytest.approx(
        figures["batched_rows_per_second"] / figures["unbounded_rows_per_second"]
    )
    assert InboxEntry.objects.count() == 0
