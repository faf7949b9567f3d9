"""Issue 31 in a real browser, at 1280 and 390 px: a payment's page, its refund, the desk's words.

Headless Chromium (Playwright) against pytest-django's live server, with
the real worker, PostgreSQL, Redis and fake provider. The order charged
twice is made through the fake's real flows (a second payment intent naming
the order, outside the fence), found by the fence audit, shown with both
charges in red and refunded from its page through the refund handler.
Screenshots land in artifacts/screenshots/ (gitignored), named by width.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.utils import timezone

from payments.checkout.handler import request_checkout
from payments.engine.queues import queue_index
from payments.models import Operation, OperationState
from payments.shop.models import OrderStatus
from tests.support import builders, flows
from tests.support.users import NEW_ATTEMPT, RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
PASSWORD = "correct-horse-battery-9"
RED = "rgb(176, 42, 55)"  # the desk's warning colour, #b02a37


@pytest.fixture(params=[1280, 390], ids=["1280px", "390px"])
def tab(request, monkeypatch):
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium"
    from playwright import sync_api

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # see test_browser.py
    SHOTS.mkdir(parents=True, exist_ok=True)
    width = request.param
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        # An operator in Paris: the desk's UTC times get their local time beside them.
        context = browser.new_context(
            viewport={"width": width, "height": 900}, timezone_id="Europe/Paris"
        )
        page = context.new_page()
        page.set_default_timeout(15_000)
        page.width = width
        try:
            yield page
        finally:
            browser.close()
            connections.close_all()


def shot(page, name: str) -> None:
    """Save a full-page screenshot after checking nothing makes the page scroll sideways."""
    assert page.evaluate("document.documentElement.scrollWidth") <= page.width, name
    page.screenshot(path=str(SHOTS / f"31-{page.width}-{name}.png"), full_page=True)


def sign_in(page, live_server, username: str, *perms: str, then: str) -> None:
    user = make_user(username, *perms)
    user.set_password(PASSWORD)
    user.save()
    page.goto(f"{live_server.url}/admin/login/?next={then}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{then}")


def test_order_charged_twice__both_red_refunded_from_its_page(tab, live_server, provider, queue):
    order, fenced, duplicate = flows.charged_twice(queue, key="web-twice")
    url = f"/admin/shop/order/{order.pk}/change/"
    sign_in(tab, live_server, "sam", *VIEW, RECONCILE, NEW_ATTEMPT, "shop.refund_order", then=url)

    red = tab.locator("tr.desk-duplicate")
    assert red.count() == 2
    assert {fenced, duplicate} <= set(tab.locator("#desk-movements").inner_text().split())
    assert red.first.locator("td").first.evaluate("e => getComputedStyle(e).color") == RED
    assert "Charged more than once" in tab.locator(".desk-duplicate-warning").inner_text()
    assert "€39.98" in tab.locator("#desk-charged").inner_text()
    timeline = tab.locator("#desk-timeline").inner_text()
    charge = Operation.objects.get(key="web-twice").claims.get(step="charge")
    assert charge.idempotency_key in timeline
    assert "UTC (" in timeline  # the local time beside (Europe/Paris)
    # The charge's outcome row: the worker's request, its HTTP status and request id.
    done = (
        tab.locator("#desk-timeline tr.desk-timeline-outcome")
        .filter(has_text="web-twice / charge")
        .filter(has_text="→ done")
    )
    assert done.count() == 1
    assert done.locator("td.desk-answer .desk-http").inner_text() == "200"
    assert re.fullmatch(r"req_\w+", done.locator("code.desk-request-id").inner_text())
    assert charge.claimed_by in done.locator("td.desk-who").inner_text()
    shot(tab, "01-order-charged-twice")

    tab.locator("a.desk-refund-duplicate").click()
    assert tab.locator("#id_amount").input_value() == "19.99"  # the duplicate, whole
    assert duplicate in tab.locator(".desk-refund-plan").inner_text()
    tab.fill("#id_reason", "charged twice: the fence audit's finding")
    shot(tab, "02-refund-duplicate-confirm")
    tab.get_by_role("button", name="Yes, refund").click()
    tab.wait_for_url(f"**{url}")
    assert "Refund desk-refund:order:" in tab.locator("ul.messagelist").inner_text()
    shot(tab, "03-refund-asked")

    run_worker(queue)  # the refund runs through the fence
    refund = Operation.objects.get(kind="refund", entity_id=str(order.pk))
    assert refund.state == OperationState.SUCCEEDED
    assert refund.claims.get(step="refund").idempotency_key  # a fenced provider call
    given_back = provider.state.refunds(payment_intent=duplicate)
    assert [(r["amount"], r["status"]) for r in given_back] == [(order.amount, "succeeded")]
    assert provider.state.refunds(payment_intent=fenced) == []  # the order's own charge stays
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.PAID, 0)  # paid once
    tab.reload()
    assert "€19.99" in tab.locator("#desk-refunded").inner_text()
    assert "€19.99" in tab.locator("#desk-net").inner_text()
    assert "refund" in tab.locator("#desk-movements").inner_text()
    shot(tab, "04-duplicate-refunded")

    tab.goto(f"{live_server.url}/admin/payments/operation/?q={duplicate}")
    assert f"No step has {duplicate}" in tab.locator("ul.messagelist").inner_text()
    assert "web-twice" in tab.locator("#result_list").inner_text()
    shot(tab, "05-search-a-reference-no-step-has")

    # The operation's page lists the same request on its audit trail.
    checkout = Operation.objects.get(key="web-twice")
    tab.goto(f"{live_server.url}/admin/payments/operation/{checkout.pk}/change/")
    row = tab.locator(".inline-group tr.has_original").filter(
        has=tab.locator("td.field-requests_shown .desk-http")
    )
    assert row.count() == 1
    assert row.locator(".desk-http").inner_text() == "200"
    assert re.fullmatch(r"req_\w+", row.locator("code.desk-request-id").inner_text())
    shot(tab, "06-operation-audit-trail-requests")
    row.screenshot(path=str(SHOTS / f"31-{tab.width}-07-audit-row-with-its-request.png"))


def test_desk_pages__cases_chart_actions_and_the_rq_permission(tab, live_server, provider, queue):
    lost = flows.uncertain_after_read_timeout(provider, queue, key="web-lost")
    flows.checkout(key="web-paid")
    run_worker(queue)
    with pytest.raises(CommandError):
        call_command("fence_audit", stdout=io.StringIO())
    sign_in(tab, live_server, "alice", *VIEW, RECONCILE, then="/admin/payments/operation/")

    listed = tab.locator("#result_list")
    assert listed.locator(".state-badge").first.is_visible()
    amount = listed.locator("td.field-amount").first
    box = amount.bounding_box()
    assert box["x"] + box["width"] <= tab.width  # amount and state in sight, no sideways scroll
    shot(tab, "06-operations")

    # The date range filter: a day long past lists nothing; today lists both again.
    today = timezone.localdate().isoformat()
    tab.fill(".desk-date-range input[name=created_at__to]", "2020-01-01")
    tab.locator(".desk-date-range input[type=submit]").click()
    tab.wait_for_url("**created_at__to=2020-01-01**")
    assert "0 operations" in tab.locator("#changelist").inner_text()
    tab.fill(".desk-date-range input[name=created_at__from]", today)
    tab.fill(".desk-date-range input[name=created_at__to]", today)
    tab.locator(".desk-date-range input[type=submit]").click()
    tab.wait_for_url(f"**created_at__to={today}**")
    assert tab.locator("#result_list tbody tr").count() == 2
    shot(tab, "06b-operations-dated-today")

    tab.goto(f"{live_server.url}/admin/payments/operation/needs-attention/")
    cases = tab.locator("#desk-cases")
    assert lost.key in cases.inner_text() and "€25.00" in cases.inner_text()
    assert tab.locator("svg.desk-chart").is_visible()
    assert "succeeded: 1" in tab.locator("#desk-chart").inner_text()
    shot(tab, "07-needs-attention")

    tab.goto(f"{live_server.url}/admin/payments/operation/{lost.pk}/change/")
    buttons = tab.locator(".desk-buttons > *")
    # Attempts count requests sent: one call, whatever look-ups followed.
    assert tab.locator("div.field-attempts_shown .readonly").inner_text().startswith("1")
    labels = buttons.all_inner_texts()
    assert labels[0] == "Query the provider now" and labels[-1] == "Mark charge failed"
    mark_failed = buttons.last
    if lost.claims.get(step="charge").provider_view is None:
        assert mark_failed.get_attribute("aria-disabled") == "true"
    assert mark_failed.evaluate("e => getComputedStyle(e).backgroundColor") == RED
    assert (
        "needs the permission payments.start_new_attempt"
        in tab.locator(".desk-actions").inner_text()
    )
    for cell in ("#events-group td.field-reason", "#claims-group td.field-outcome"):
        box = tab.locator(cell).last.bounding_box()
        assert box["x"] + box["width"] <= tab.width, cell  # the whole trail in sight
    shot(tab, "08-operation-actions")

    tab.goto(f"{live_server.url}/admin/rq/queues/0/")
    assert "Empty Queue (needs payments.manage_queues)" in tab.locator("#content").inner_text()
    shot(tab, "09-rq-queue")


def test_needs_attention__a_double_charge_in_the_audit__no_sideways_scroll(
    tab, live_server, provider, queue
):
    order, _, duplicate = flows.charged_twice(queue, key="web-audit")
    sign_in(tab, live_server, "vera", *VIEW, then="/admin/payments/operation/needs-attention/")

    entities = tab.locator("#audit-double-charged-entities")
    assert duplicate in entities.inner_text()
    order_cell = entities.locator("a.desk-entity").first
    assert order_cell.inner_text() == f"Order {order.pk}"
    assert order_cell.evaluate("e => e.getClientRects().length") == 1  # not wrapped mid-word
    box = entities.bounding_box()
    assert box["x"] + box["width"] <= tab.width
    assert "UTC" in (tab.locator("svg.desk-chart").text_content() or "")
    shot(tab, "10-needs-attention-double-charge")  # asserts no sideways scroll, then saves


def test_rq_failed_jobs__each_job_links_its_operation(
    tab, live_server, provider, queue, monkeypatch
):
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    failed = f"/admin/rq/queues/{queue_index()}/failed/"
    sign_in(tab, live_server, "vera", *VIEW, then=failed)

    cell = tab.locator("#result_list td.desk-job-operation")
    assert cell.inner_text() == f"{op.key} (needs review)"
    # A reader of the queues: every change shown off, naming the permission, not a 403 later.
    assert tab.locator("#changelist-form .actions button").is_disabled()
    shot(tab, "11-rq-failed-jobs")

    tab.goto(f"{live_server.url}/admin/rq/queues/{queue_index()}/{op.job_id}/")
    note = tab.locator("p.desk-job-operation")
    assert op.key in note.inner_text()
    box = note.bounding_box()
    assert box["x"] + box["width"] <= tab.width
    assert tab.locator(".submit-row input[type=submit]").is_disabled()
    assert tab.locator(".submit-row a").count() == 0  # no Delete link to follow
    assert "Delete (needs payments.manage_queues)" in tab.locator(".submit-row").inner_text()
    # Not shot(): at 390 px django-rq's own job page is wider than the window (the job id
    # in its heading, its results table), with or without the note.
    tab.screenshot(path=str(SHOTS / f"31-{tab.width}-12-rq-failed-job.png"), full_page=True)
    note.locator("a").click()
    tab.wait_for_url(f"**/admin/payments/operation/{op.pk}/change/")


def test_rq_requeue_of_a_job_that_changes_nothing__says_so_and_links_the_operation(
    tab, live_server, provider, queue, monkeypatch
):
    """An operator in an incident presses Requeue on a failed job whose operation waits
    for a person: the job would run and change nothing. The page says so beside
    django-rq's "successfully requeued", and its link leads to where to act."""
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    job_page = f"/admin/rq/queues/{queue_index()}/{op.job_id}/"
    sign_in(tab, live_server, "quinn", *VIEW, "payments.manage_queues", then=job_page)

    tab.locator("input[type=submit][value=Requeue]").click()
    warning = tab.locator("ul.messagelist li.warning")
    warning.wait_for()
    assert op.key in warning.inner_text()
    assert "no worker will run again" in warning.inner_text()
    assert "successfully requeued" in tab.locator("ul.messagelist").inner_text()
    box = warning.bounding_box()
    assert box["x"] + box["width"] <= tab.width
    # Not shot(): at 390 px django-rq's own job page is wider than the window (see above).
    tab.screenshot(
        path=str(SHOTS / f"31-{tab.width}-13-rq-requeued-for-nothing.png"), full_page=True
    )
    warning.locator("a").click()
    tab.wait_for_url(f"**/admin/payments/operation/{op.pk}/change/")


def test_needs_attention__a_failure_retried_and_paid__its_tile_says_where_the_money_went(
    tab, live_server, provider, queue
):
    builders.declined(key="declined-once")
    retried, _ = builders.declined(key="declined-then-paid")
    attempt, _ = request_checkout(
        order_id=retried.params["order_id"], key="second-card", payment_method="pm_card_visa",
        actor="api",
    )  # fmt: skip
    builders.move(attempt, OperationState.SUCCEEDED)
    sign_in(tab, live_server, "vera", *VIEW, then="/admin/payments/operation/needs-attention/")

    tile = tab.locator("a.state-count-failed")
    assert "1 retried: its money under its attempt" in tile.inner_text()
    assert "€19.99" in tile.inner_text()
    shot(tab, "13-needs-attention-failed-retried")
