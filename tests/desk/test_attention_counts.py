"""Needs attention's figures agree with one another during an outage, or say what they count.

An operator's try during a provider outage: the states' counts, the cases' count,
the chart's legend and the incident banner disagreed, each counting another set
(the cases included the refunds that failed before anything ran, the chart's day
began at an hour, the banner read its figures from its first rows only). Real
PostgreSQL, the real HTTP fake provider, the real page.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from payments.desk.views.chart import legend, outcomes_per_hour
from payments.desk.views.queries import FAILED_WINDOW, counts_by_state, follow_up_q
from payments.engine.recovery import reconcile
from payments.engine.writes import fence_writes
from payments.models import Operation, OperationState
from tests.support import builders, flows
from tests.support.users import VIEW, client_for, make_user

NEEDS_ATTENTION = reverse("admin:payments_operation_needs_attention")
CASES = re.compile(
    r"(\d+) case\(s\): (\d+) uncertain, (\d+) needing review, (\d+) stale, (\d+) failed before "
    r"anything ran \(of the (\d+) failed in the last 24 h\)"
)


def words(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def tile(page: str, state: str) -> int:
    """The number on a state's tile at the top of the page."""
    found = re.search(rf'state-count-{state}[ "][^>]*><strong>(\d+)</strong>', page)
    assert found, state
    return int(found.group(1))


# Transactional: the refund runs in a real worker (a claim must commit before its call).
@pytest.mark.django_db(transaction=True)
def test_cases_count__made_of_the_states_counts_and_the_failed_before_anything_ran(provider, queue):
    """Three cases beside Uncertain 2, Needs review 0, Stale 0: the third, a refund the
    outage refused before it ran, was counted nowhere else on the page."""
    flows.refund_failed_by_an_outage(provider, queue, "outage-refund")
    builders.declined(key="declined")  # failed in the last 24 h, not a case
    builders.uncertain(key="lost-1", charged=False)
    builders.uncertain(key="lost-2", charged=True)

    page = client_for(make_user("vera", *VIEW)).get(NEEDS_ATTENTION).content.decode()

    found = CASES.search(words(page))
    assert found, "the cases' count names its parts"
    total, uncertain, review, stale, nothing_ran, failed = map(int, found.groups())
    assert total == uncertain + review + stale + nothing_ran == 3
    assert (uncertain, review, stale) == (
        tile(page, "uncertain"), tile(page, "needs_review"), tile(page, "stale"),
    )  # fmt: skip
    assert (nothing_ran, failed) == (1, tile(page, "failed")) == (1, 2)


@pytest.mark.django_db
def test_chart_legend__declined_or_failed_is_the_failed_count_of_the_same_24_hours(provider):
    """The chart's day began at the top of the hour after now - 24 h: a failure in between
    counted in "Failed (last 24 h)" and not in the legend's "declined or failed"."""
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    now = hour - timedelta(hours=2) + timedelta(minutes=30)  # a fixed "now", half past
    op, _ = builders.declined(key="declined-early")
    with fence_writes():  # hand-made state: failed 23 h 55 min before that "now"
        Operation.objects.filter(pk=op.pk).update(
            updated_at=now - FAILED_WINDOW + timedelta(minutes=5)
        )
    business = Operation.objects.exclude(follow_up_q())

    shown = {item["label"]: item["total"] for item in legend(outcomes_per_hour(business, now))}

    assert counts_by_state(business, now)[OperationState.FAILED] == 1
    assert shown["declined or failed"] == 1


@pytest.mark.django_db
def test_incident_banner__its_figures_count_every_operation_it_names(provider, viewer, settings):
    """The banner counted the waiting operations, then read the in-flight and unanswered
    ones and the money from the first 5,000 of them only: past that (an outage of
    thousands; in this test's first version the rows were cut to 2), "3 operations wait (0
    in flight, 2 unanswered), €39.98 at stake" for three charges of €19.99."""
    for n in range(3):
        builders.uncertain(key=f"inc-all-{n}", charged=True)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": "http://127.0.0.1:9"}
    reconcile()

    banner = words(client_for(viewer).get(NEEDS_ATTENTION).content.decode())

    assert (
        "3 operations wait for an answer (0 with a request in flight there, "
        "3 unanswered), €59.97 checkout at stake"
    ) in banner
