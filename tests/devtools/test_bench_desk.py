"""The bench's desk section: many operations seeded in SQL, each desk page timed."""

from __future__ import annotations

import pytest

from devtools.bench.desk import desk_pages, desk_rows
from payments.models import Operation, OperationState, StepClaim


@pytest.mark.django_db
def test_desk_pages__seeds_a_mix_of_states_and_times_every_page():
    figures = desk_pages(40, samples=2, say=lambda line: None)

    assert Operation.objects.count() == StepClaim.objects.count() == 40
    assert Operation.objects.filter(state=OperationState.UNCERTAIN).exists()
    pages = {"operations list", "needs attention", "payment page"}
    assert pages <= set(figures)
    assert all(figures[p]["p50_ms"] <= figures[p]["p95_ms"] for p in pages)
    assert any("payment page (40 operations)" in label for label, _ in desk_rows(figures))
