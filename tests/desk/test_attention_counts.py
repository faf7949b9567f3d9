"""Needs attention's figures agree with one another during an outage, or say what they count.

An operator's try during a provider outage: the states' counts and the cases'
count disagreed, each counting another set (the cases included the refunds that
failed before anything ran, counted nowhere else). Real
PostgreSQL, the real HTTP fake provider, the real page.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

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
