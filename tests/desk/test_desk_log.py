"""The desk log: what every operator did recently (issue 37, finding 8: "there is no log
across operators").

Read from the fence's audit rows an operator's desk action wrote (actor `operator:<name>`):
newest first, who, what, which operation, why; a page at a time, each page a bounded walk
of the audit rows' primary key (tests/desk/test_bounded_lists.py checks its plans).

Inside one test transaction (no worker runs): real PostgreSQL, the real HTTP fake provider.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from payments.desk import services as desk
from payments.desk.display import when
from payments.desk.views import log as desk_log
from payments.models import OperationEvent
from tests.support import builders
from tests.support.history import write_history
from tests.support.users import client_for, make_user

pytestmark = pytest.mark.django_db

DESK_LOG = reverse("admin:payments_operation_desk_log")


def log_rows(page: str) -> list[str]:
    """The log's table rows, in order."""
    if 'id="desk-log"' not in page:
        return []
    body = page.split('id="desk-log"', 1)[1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return body.split("<tr")[1:]


def words(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def event_ids(page: str) -> list[int]:
    """The audit rows the page lists, by id, in order."""
    return [int(i) for i in re.findall(r'<tr class="desk-log-row" id="event-(\d+)"', page)]


def older_link(page: str) -> str:
    found = re.search(r'<a class="desk-log-older" href="([^"]+)"', page)
    return found.group(1).replace("&amp;", "&") if found else ""


@pytest.fixture
def two_operators_acted(provider, operator, senior):
    """alice queried the provider about an uncertain charge, then sam started a new attempt
    of a declined one; a worker's rows in between."""
    lost, _, _ = builders.uncertain(key="lost-answer", charged=False)
    desk.query_provider([lost.pk], user=operator)
    declined, _ = builders.declined(key="order-6-checkout")
    new = desk.start_new_attempt(
        declined, user=senior, reason="customer gave a new card", payment_method="pm_card_visa"
    )
    return lost, declined, new


def test_desk_log__every_operator_s_actions_newest_first_with_who_what_where_why(
    two_operators_acted, viewer
):
    lost, declined, new = two_operators_acted

    page = client_for(viewer).get(DESK_LOG).content.decode()

    rows = log_rows(page)
    expected = OperationEvent.objects.filter(actor__startswith="operator:").order_by("-pk")
    assert len(rows) == expected.count() >= 3
    newest = rows[0]
    # sam's new attempt, on the declined operation: who, what, which, why, when.
    assert "sam" in words(newest) and "alice" not in words(newest)
    assert "new attempt" in words(newest).lower()
    assert "customer gave a new card" in words(newest)
    assert reverse("admin:payments_operation_change", args=[declined.pk]) in newest or (
        reverse("admin:payments_operation_change", args=[new.pk]) in newest
    )
    assert when(expected.first().created_at) in words(newest)
    # alice's look-up, older: the operation it was about, linked.
    [queried] = [r for r in rows if "queried the provider" in words(r).lower()]
    assert "alice" in words(queried) and "lost-answer" in words(queried)
    assert f'href="{reverse("admin:payments_operation_change", args=[lost.pk])}"' in queried
    # Only operators' rows: no worker's, no API's (the builders' and the engine's own).
    who = [re.search(r'data-label="operator"><a[^>]*>([^<]+)</a>', r).group(1) for r in rows]
    assert set(who) == {"alice", "sam"}
    assert rows.index(queried) > 0  # newest first


def test_desk_log__one_operator_s_actions(two_operators_acted, viewer):
    page = client_for(viewer).get(DESK_LOG, {"operator": "alice"}).content.decode()

    rows = log_rows(page)
    assert rows and all("alice" in words(r) and "sam" not in words(r) for r in rows)


def test_desk_log__linked_from_needs_attention(provider, viewer, queue):
    page = client_for(viewer).get(reverse("admin:payments_operation_needs_attention"))

    assert f'href="{DESK_LOG}"' in page.content.decode()


def test_desk_log__says_so_when_no_operator_acted(provider, viewer):
    builders.uncertain(key="nobody-looked", charged=False)

    page = client_for(viewer).get(DESK_LOG).content.decode()

    assert log_rows(page) == []
    assert "No desk action" in page


def test_desk_log__needs_the_view_permission(provider, db):
    nobody = make_user("nina")

    assert client_for(nobody).get(DESK_LOG).status_code == 403


def test_desk_log__a_page_at_a_time_older_by_a_link(two_operators_acted, viewer, monkeypatch):
    monkeypatch.setattr(desk_log, "ROWS_PER_PAGE", 2)
    client = client_for(viewer)
    everything = list(
        OperationEvent.objects.filter(actor__startswith="operator:")
        .order_by("-pk")
        .values_list("pk", flat=True)
    )

    first = client.get(DESK_LOG).content.decode()
    seen = event_ids(first)
    link = older_link(first)
    while link:
        page = client.get(link).content.decode()
        seen += event_ids(page)
        link = older_link(page)

    assert len(event_ids(first)) == 2
    assert seen == everything  # each once, newest first, across the pages


def test_desk_log__a_page_walks_a_bounded_span_and_says_where_it_stopped(
    provider, operator, viewer, monkeypatch
):
    """An operator's action buried under many worker rows: the first page stops after SPAN
    rows, says so, and its link goes on from there."""
    monkeypatch.setattr(desk_log, "SPAN", 50)
    lost, _, _ = builders.uncertain(key="buried", charged=False)
    desk.query_provider([lost.pk], user=operator)
    write_history(40, tag="after", analyze=False)  # 120 worker rows after alice's
    client = client_for(viewer)

    first = client.get(DESK_LOG).content.decode()
    assert log_rows(first) == []
    assert "looked through" in words(first).lower() and older_link(first)
    found: list[str] = []
    link = older_link(first)
    while link and not found:
        page = client.get(link).content.decode()
        found = log_rows(page)
        link = older_link(page)

    assert found and "buried" in words(found[0]) and "alice" in words(found[0])
