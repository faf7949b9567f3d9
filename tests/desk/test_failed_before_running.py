"""What an outage failed before anything ran stays a case to work, with a true reason.

An operator's try during a provider outage (every request refused before it
executed, three times): the refunds gave up and failed, correctly (nothing
happened at the provider). But Needs attention then read "Nothing to work", the
customers stayed unrefunded, and Resume said "step refund was refused; the same
key would be refused again" although the provider refused nothing. Real
PostgreSQL, a real worker in this process, the real HTTP fake provider.
"""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from payments.desk import services as desk
from payments.desk.rules import available_actions
from payments.desk.views import nothing_ran, queries
from payments.engine.writes import fence_writes
from payments.models import Operation
from payments.refunds.handler import request_refund
from tests.support import flows
from tests.support.users import VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

NEEDS_ATTENTION = reverse("admin:payments_operation_needs_attention")


def words(response) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", response.content.decode()))


def not_listed_link(response) -> str:
    """The link of the cases' note on what they do not list."""
    note = response.content.decode().split('id="cases-not-listed"', 1)[1].split("</p>", 1)[0]
    link = re.search(r'href="([^"]+)"', note)
    assert link, note
    return html.unescape(link.group(1))


def test_a_refund_failed_before_anything_ran__a_case_on_needs_attention(provider, queue):
    op = flows.refund_failed_by_an_outage(provider, queue, "outage-refund")

    page = words(client_for(make_user("vera", *VIEW)).get(NEEDS_ATTENTION))

    assert "Nothing to work" not in page
    assert op.key in page
    assert "Nothing ran at the provider: every request was refused before it executed" in page


def test_a_refund_failed_before_anything_ran__resume_does_not_say_the_provider_refused(
    provider, queue
):
    op = flows.refund_failed_by_an_outage(provider, queue, "outage-resume")

    why = available_actions(op).refused["resume"]

    assert "was refused; the same key would be refused again" not in why
    assert "refused before it ran" in why and "start a new attempt" in why


def test_once_a_new_attempt_is_asked__the_case_leaves_needs_attention(provider, queue):
    op = flows.refund_failed_by_an_outage(provider, queue, "outage-retried")
    senior = make_user(
        "sam", "payments.view_operation", "payments.reconcile_operation",
        "payments.start_new_attempt",
    )  # fmt: skip
    new = desk.start_new_attempt(op, user=senior, reason="provider back; customer waits")
    run_worker(queue)

    page = words(client_for(make_user("vera", *VIEW)).get(NEEDS_ATTENTION))

    assert new.key != op.key
    assert f"{op.key} " not in page


def test_once_the_refund_is_asked_again_under_a_new_key__the_case_leaves(provider, queue):
    """A review's catch: the case stayed for 24 h after the API (or the desk's refund form)
    asked the same refund again under a new key, inviting a second refund of it."""
    op = flows.refund_failed_by_an_outage(provider, queue, "outage-asked-again")
    again, _ = request_refund(
        order_id=op.params["order_id"], key="asked-again", amount=400, actor="api"
    )
    run_worker(queue)

    page = words(client_for(make_user("vera", *VIEW)).get(NEEDS_ATTENTION))

    assert again.key != op.key
    assert f"{op.key} " not in page


def test_more_failed_before_running_than_listed__the_page_says_how_many_and_links_them(
    provider, queue, monkeypatch
):
    """Past FAILED_BEFORE_RUNNING_MOST, the older ones of the day were left out of the cases
    without a word: the operator read the list as all there was to do."""
    monkeypatch.setattr(nothing_ran, "FAILED_BEFORE_RUNNING_MOST", 1)
    first = flows.refund_failed_by_an_outage(provider, queue, "outage-first")
    then = flows.refund_failed_by_an_outage(provider, queue, "outage-then")
    client = client_for(make_user("vera", *VIEW))

    response = client.get(NEEDS_ATTENTION)
    page = words(response)

    assert f"{then.key} " in page and f"{first.key} " not in page  # the newest is listed
    assert "1 more failed before anything ran in the last 24 h, not listed here" in page
    listed = words(client.get(not_listed_link(response)))
    assert f"{first.key} " in listed and f"{then.key} " in listed


def test_a_case_older_than_the_window__the_page_says_so_and_links_it(provider, queue):
    """A refund the outage refused more than 24 h ago, no new attempt asked: it left Needs
    attention, which then read "Nothing to work" while the customer was still owed."""
    op = flows.refund_failed_by_an_outage(provider, queue, "outage-yesterday")
    with fence_writes():  # hand-made state: the failure a day and an hour ago
        Operation.objects.filter(pk=op.pk).update(
            updated_at=timezone.now() - queries.FAILED_WINDOW - timedelta(hours=1)
        )
    client = client_for(make_user("vera", *VIEW))

    response = client.get(NEEDS_ATTENTION)
    page = words(response)

    assert f"{op.key} " not in page  # the cases read the last 24 h only
    assert "Nothing to work" not in page
    assert "Failed before anything ran more than 24 h ago, not listed here" in page
    listed = words(client.get(not_listed_link(response)))
    assert f"{op.key} " in listed
