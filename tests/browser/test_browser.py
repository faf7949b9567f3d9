"""An operator settles a lost answer in a real browser: headless Chromium driven by Playwright.

The page, the server (pytest-django's live_server, transactional), PostgreSQL,
Redis, the worker and the fake provider are all real. The window is 1280 px
wide (a laptop): no page of the walk may scroll sideways or clip a column.
Screenshots of each step land in artifacts/screenshots/ (gitignored) for a
person to look at.
"""

from __future__ import annotations

import io
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.urls import reverse
from django.utils import timezone

from payments.engine import fence
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationState, StepClaim
from payments.refunds.handler import request_refund
from payments.shop.models import Order, OrderStatus
from tests.support import flows
from tests.support.users import RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

# Transactional: the live server's thread must see what the test committed.
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
PASSWORD = "correct-horse-battery-9"
WIDTH = 1280
DASHBOARD = "https://dashboard.example/payments/{reference}"


@pytest.fixture
def page(monkeypatch):
    # A missing browser fails the test (a skip would count as a pass): `make
    # test` and .ci/run install Debian's chromium.
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium"
    from playwright import sync_api

    # Playwright's sync API keeps an event loop in this thread; Django refuses ORM
    # calls where a loop runs unless told that this (test-only) thread is safe.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        tab = browser.new_page(viewport={"width": WIDTH, "height": 900})
        tab.set_default_timeout(15_000)
        try:
            yield tab
        finally:
            browser.close()
            # Under Playwright's sync API the ORM runs in another greenlet context and
            # opens a connection of its own there: close it, or it outlives the test
            # database (which then cannot be dropped).
            connections.close_all()


def shot(page, name: str) -> None:
    """Save a full-page screenshot, after checking that nothing is cut off at the window's width."""
    assert_fits(page, name)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def assert_fits(page, name: str) -> None:
    """No sideways scrolling: the page and every table (the changelist scrolls its own) fit."""
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH, name
    overflowing = page.evaluate(
        """() => [...document.querySelectorAll('.results, table')]
              .filter(e => e.scrollWidth > e.clientWidth + 1)
              .map(e => e.id || e.className)"""
    )
    assert overflowing == [], f"{name}: clipped {overflowing}"


def overlap(a: dict, b: dict) -> bool:
    """Tell whether two bounding boxes (x, y, width, height) cover a common area."""
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


def stale_running(key: str) -> Operation:
    """A checkout whose worker took the lease and died: running, lease run out."""
    op = flows.checkout(key)
    fence.acquire_lease(op.pk, owner="worker-9/99", seconds=30)
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(
            lease_expires_at=timezone.now() - timedelta(minutes=10)
        )
    return op


def test_operator_queries_the_provider_and_sees_the_payment_settle(
    page, live_server, provider, queue, settings
):
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_DASHBOARD_URL": DASHBOARD}
    lost = flows.uncertain_after_read_timeout(provider, queue, key="web-checkout-1")
    paid = flows.checkout(key="web-checkout-2")
    run_worker(queue)
    seen = flows.uncertain_after_read_timeout(provider, queue, key="web-checkout-3")
    with pytest.raises(CommandError):  # exit 1: it finds the successes we left uncertain
        call_command("fence_audit", stdout=io.StringIO())  # and shows them on their claims
    assert seen.claims.get(step="charge").provider_view["source"] == "fence_audit"
    user = make_user("alice", *VIEW, RECONCILE)
    user.set_password(PASSWORD)
    user.save()

    page.goto(f"{live_server.url}/admin/login/?next=/admin/payments/operation/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    shot(page, "01-login")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/payments/operation/")
    assert page.locator("#result_list").is_visible()
    shot(page, "02-operations")

    listed = page.locator("#result_list").inner_text()
    assert "record_sale" not in listed and "count_sale" not in listed  # follow-ups hidden
    assert "€25.00" in listed

    page.locator("#changelist-filter").get_by_role("link", name="Uncertain").click()
    page.wait_for_url("**state__exact=uncertain**")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 2
    assert paid.key not in page.locator("#result_list").inner_text()
    shot(page, "03-filtered-uncertain")

    page.get_by_role("link", name=lost.key, exact=True).click()
    badge = page.locator("div.field-badge .state-badge")
    assert badge.inner_text() == "Uncertain"
    shot(page, "04-operation-uncertain")

    page.get_by_role("link", name="Query the provider now").click()
    assert page.get_by_text("What will happen").is_visible()
    shot(page, "05-confirm-query")

    page.get_by_role("button", name="Yes, query the provider").click()
    page.wait_for_url(f"**/admin/payments/operation/{lost.pk}/change/")
    assert "the provider shows the step succeeded" in page.locator("ul.messagelist").inner_text()
    assert badge.inner_text() == "Retrying"
    trail = page.locator("#events-group")
    assert "operator:alice" in trail.inner_text()
    shot(page, "06-settled-retrying")

    run_worker(queue)  # the resumed operation runs its remaining steps
    page.reload()
    assert badge.inner_text() == "Succeeded"
    shot(page, "07-succeeded")
    with pytest.raises(CommandError):  # exit 1: the provider holds a success we left uncertain
        call_command("fence_audit", stdout=io.StringIO())
    page.get_by_role("link", name="Needs attention").first.click()
    # The headline figures are the customers' payments: follow-ups are not counted.
    succeeded = Operation.objects.filter(
        state=OperationState.SUCCEEDED, parent__isnull=True, kind="checkout"
    ).count()
    assert succeeded == 2
    assert page.locator(".state-count-succeeded").count() == 0  # nothing to do there
    assert "succeeded: 2" in page.locator("#desk-chart").inner_text()  # the chart counts them
    assert page.locator(".state-count-uncertain strong").inner_text() == "1"
    assert page.locator(".state-count-uncertain .desk-total").inner_text() == "€25.00 checkout"
    assert seen.key in page.locator("#oldest-uncertain").inner_text()
    audit = page.locator("#desk-audit")
    assert "problems found (exit 1)" in audit.inner_text()
    seen_reference = seen.claims.get(step="charge").provider_view["reference"]
    unfenced = page.locator("#audit-unfenced")
    assert seen_reference in unfenced.inner_text()
    assert unfenced.get_by_role("link", name=seen.key).is_visible()  # linked to its operation
    assert "{'" not in audit.inner_text()  # a table, not a Python dict
    # The systems it did not judge, each named with why (the accounting system: no money).
    assert "Not audited: the accounting system\tIt moves no money" in audit.inner_text()
    shot(page, "08-needs-attention")

    page.goto(f"{live_server.url}/admin/payments/operation/{lost.pk}/steps/charge/mark_succeeded/")
    assert page.locator("#id_reference").is_visible() and page.locator("#id_reason").is_visible()
    assert "The current state forbids this" in page.locator(".errornote").inner_text()
    shot(page, "09-mark-succeeded-refused")
    lost.refresh_from_db()
    assert lost.state == OperationState.SUCCEEDED
    assert provider.state.succeeded_count(metadata={"operation_key": lost.key}) == 1

    # An uncertain charge the audit found succeeded: the provider's view beside ours.
    page.goto(f"{live_server.url}/admin/payments/operation/{seen.pk}/change/")
    assert page.locator("div.field-badge .state-badge").inner_text() == "Uncertain"
    view = page.locator("table.desk-provider-view")
    reference = seen.claims.get(step="charge").provider_view["reference"]
    assert "succeeded" in view.inner_text() and "€25.00" in view.inner_text()
    assert "fence_audit" in view.inner_text() and reference in view.inner_text()
    link = view.get_by_role("link", name=reference)
    assert link.get_attribute("href") == DASHBOARD.format(reference=reference)
    shot(page, "10-uncertain-provider-view")

    # "Mark failed" is off while the provider shows the success: shown, not a link, and
    # naming what to do instead; its page, reached by URL, refuses and changes nothing.
    off = page.locator("span.desk-mark_failed")
    assert off.get_attribute("aria-disabled") == "true"
    assert f"succeeded ({reference})" in (off.get_attribute("title") or "")
    assert page.get_by_role("link", name="Mark charge failed").count() == 0
    page.goto(live_server.url + reverse(
        "admin:payments_operation_desk_step", args=[seen.pk, "charge", "mark_failed"]
    ))  # fmt: skip
    assert page.get_by_role("button", name="Yes, check and mark failed").is_disabled()
    assert f"succeeded ({reference})" in page.content()
    shot(page, "11-mark-failed-refused")

    # The operator settles it: marked succeeded with the provider's reference, unless
    # the refusal already recorded the provider's success.
    page.goto(f"{live_server.url}/admin/payments/operation/{seen.pk}/change/")
    settle = page.get_by_role("link", name="Mark charge succeeded")
    if settle.count():
        settle.click()
        page.fill("#id_reference", reference)
        assert page.locator("#id_reference").evaluate("e => e.scrollWidth <= e.clientWidth")
        page.fill("#id_reason", "the audit and the provider's dashboard show it succeeded")
        shot(page, "12-mark-succeeded-form")
        page.get_by_role("button", name="Yes, check and mark succeeded").click()
        page.wait_for_url(f"**/admin/payments/operation/{seen.pk}/change/")
    claim = StepClaim.objects.get(operation=seen, step="charge")
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert "operator:alice" in page.locator("#events-group").inner_text()
    shot(page, "13-settled-audit-trail")
    assert provider.state.succeeded_count(metadata={"operation_key": seen.key}) == 1

    # Stuck work is flagged in the list; the home page shows the desk with its counts.
    stale_running("web-checkout-4")
    page.goto(f"{live_server.url}/admin/payments/operation/?lease=stale")
    assert page.locator("#result_list .desk-stale-badge").count() == 1
    shot(page, "14-operations-stale")
    page.goto(f"{live_server.url}/admin/")
    desk = page.locator("#payments-desk-module")
    assert desk.is_visible()
    assert not overlap(desk.bounding_box(), page.locator("#recent-actions-module").bounding_box())
    assert "1 Running" in desk.inner_text() and "1 Stale" in desk.inner_text()
    shot(page, "15-index-desk")

    # Orders and invoices show the same money as the operations.
    page.goto(f"{live_server.url}/admin/shop/order/")
    assert page.locator("#result_list").inner_text().count("€25.00") == 4
    shot(page, "17-orders")
    page.goto(f"{live_server.url}/admin/shop/invoice/")
    assert "€25.00" in page.locator("#result_list").inner_text()
    shot(page, "18-invoices")

    # A page alice may not open says which permission it needs.
    response = page.goto(f"{live_server.url}/admin/payments/operation/{seen.pk}/desk/new_attempt/")
    assert response.status == 403
    assert "payments.start_new_attempt" in page.locator(".desk-missing-permission").inner_text()
    shot(page, "16-forbidden")


# --- a refund whose answer was lost ------------------------------------------------------

#: Words of a checkout that a refund's pages must never use.
CHECKOUT_WORDS = ("charge", "payment failed", "invoice", "processing")


def uncertain_refund(provider, queue, order: Order, key: str, amount: int) -> Operation:
    """The provider refunded, then the connection dropped before its answer: uncertain."""
    provider.state.enqueue_faults("drop_after_accept", 1)
    op, _ = request_refund(order_id=order.pk, key=key, amount=amount, actor="api")
    run_worker(queue)
    assert provider.state.wait_idle(timeout=5)  # the refund is stored at the provider
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN, op.state
    return op


def refund_page(page, name: str) -> str:
    """Screenshot a page about a refund; return its text, checked for a checkout's words."""
    shot(page, name)
    text = page.locator("#content").inner_text()
    said = [word for word in CHECKOUT_WORDS if word in text.lower()]
    assert said == [], f"{name} speaks of {said} for a refund"
    return text


def test_operator_settles_uncertain_refunds(page, live_server, provider, queue, settings):
    # The provider keeps idempotency keys for an hour only, so no lost answer is settled by
    # a same-key replay (tests/refunds covers that): every settlement is a lookup, and the
    # operator sees what the provider showed beside ours.
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "PROVIDER_DASHBOARD_URL": DASHBOARD,
        "PROVIDER_KEY_RETENTION": 3600,
    }
    paid = flows.checkout(key="web-paid-1")  # €25.00
    run_worker(queue)
    order = Order.objects.get(pk=paid.params["order_id"])
    assert order.status == OrderStatus.PAID
    queried = uncertain_refund(provider, queue, order, "web-refund-1", 600)
    marked = uncertain_refund(provider, queue, order, "web-refund-2", 1900)
    line = f"€6.00 refund of order {order.pk}"
    user = make_user("alice", *VIEW, RECONCILE)
    user.set_password(PASSWORD)
    user.save()

    page.goto(f"{live_server.url}/admin/login/?next=/admin/payments/operation/needs-attention/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/needs-attention/")
    # A refund's money is never added to a charge's: one total per kind.
    assert page.locator(".state-count-uncertain strong").inner_text() == "2"
    assert page.locator(".state-count-uncertain .desk-total").all_inner_texts() == ["€25.00 refund"]
    assert page.locator(".state-count-succeeded").count() == 0  # done: the chart counts it
    oldest = page.locator("#oldest-uncertain").inner_text()
    assert queried.key in oldest and f"({line})" in oldest
    shot(page, "2x-refund-01-needs-attention")

    # The refund's page: its money line, nothing looked up yet, the refund's own buttons.
    page.locator("#oldest-uncertain").get_by_role("link", name=queried.key).click()
    page.wait_for_url(f"**/admin/payments/operation/{queried.pk}/change/")
    badge = page.locator("div.field-badge .state-badge")
    assert badge.inner_text() == "Uncertain"
    assert page.locator("div.field-money .readonly").inner_text() == line
    assert "Not looked up yet" in page.locator("div.field-provider_side").inner_text()
    buttons = page.locator(".desk-buttons").inner_text()
    assert "Mark refund succeeded" in buttons and "Mark refund failed" in buttons
    refund_page(page, "2x-refund-02-operation-uncertain")

    page.get_by_role("link", name="Query the provider now").click()
    assert page.locator(".desk-amount").inner_text() == line
    refund_page(page, "2x-refund-03-confirm-query")
    page.get_by_role("button", name="Yes, query the provider").click()
    page.wait_for_url(f"**/admin/payments/operation/{queried.pk}/change/")
    assert "the provider shows the step succeeded" in page.locator("ul.messagelist").inner_text()
    assert badge.inner_text() == "Retrying"
    (first,) = provider.state.refunds(metadata={"operation_key": queried.key})
    view = page.locator("table.desk-provider-view").inner_text()
    assert "succeeded" in view and "€6.00" in view and first["id"] in view
    assert "≠ ours" not in view
    link = page.locator("table.desk-provider-view").get_by_role("link", name=first["id"])
    assert link.get_attribute("href") == DASHBOARD.format(reference=first["id"])
    assert "operator:alice" in page.locator("#events-group").inner_text()
    refund_page(page, "2x-refund-04-settled-retrying")

    run_worker(queue)  # the credit note
    page.reload()
    assert badge.inner_text() == "Succeeded"
    assert "credit_note" in page.locator("#claims-group").inner_text()
    refund_page(page, "2x-refund-05-succeeded")
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 600)

    # The other refund: "Mark refund failed" is explained in a refund's words; the provider
    # shows the refund succeeded, so it is recorded done instead (nothing marked failed).
    (second,) = provider.state.refunds(metadata={"operation_key": marked.key})
    page.goto(f"{live_server.url}/admin/payments/operation/{marked.pk}/change/")
    # Off, in red, until the provider was asked in this state; a look-up that found
    # nothing yet (recorded as the reconciler records one) lets it be pressed.
    off = page.locator(".desk-buttons span.desk-mark_failed")
    assert off.get_attribute("aria-disabled") == "true" and "desk-danger" in off.get_attribute(
        "class"
    )
    fence.note_provider_view(marked.claims.get(step="refund"), None, source="reconciler")
    page.reload()
    page.get_by_role("link", name="Mark refund failed").click()
    explained = refund_page(page, "2x-refund-06-confirm-mark-failed")
    assert f"order {order.pk} stays as it is" in explained
    assert "The customer may already have been refunded" in explained
    page.fill("#id_reason", "the customer says no money came back")
    page.get_by_role("button", name="Yes, check and mark failed").click()
    # Done otherwise than asked: back on the operation, with a warning that says what.
    refusal = page.locator(".messagelist .warning").inner_text()
    assert "Not marked failed" in refusal
    assert f"the provider shows step refund succeeded ({second['id']})" in refusal
    refund_page(page, "2x-refund-07-mark-failed-recorded-done")

    run_worker(queue)
    page.goto(f"{live_server.url}/admin/payments/operation/{marked.pk}/change/")
    assert badge.inner_text() == "Succeeded"
    trail = page.locator("#events-group").inner_text()
    assert second["id"] in trail and "operator:alice" in trail
    refund_page(page, "2x-refund-10-recorded-done")
    claim = StepClaim.objects.get(operation=marked, step="refund")
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, second["id"])

    # All of it given back, once each: the order is refunded.
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.REFUNDED, 2500)
    assert [
        r["amount"] for r in provider.state.refunds(payment_intent=first["payment_intent"])
    ] == [
        600,
        1900,
    ]
    page.goto(f"{live_server.url}/admin/shop/order/{order.pk}/change/")
    assert page.locator("div.field-status .readonly").inner_text() == "Refunded"
    shot(page, "2x-refund-11-order-refunded")
    page.goto(f"{live_server.url}/admin/payments/operation/?kind__exact=refund")
    assert page.locator("#result_list tbody tr").count() == 2
    shot(page, "2x-refund-12-operations")
    call_command("fence_audit", stdout=io.StringIO())  # exit 0: every refund once, fenced
    page.goto(f"{live_server.url}/admin/payments/operation/needs-attention/")
    assert "succeeded: 3" in page.locator("#desk-chart").inner_text()  # a checkout, 2 refunds
    refunds_audit = page.locator("#audit-refunds").inner_text()
    assert "Provider refunds\t2" in refunds_audit and "{'" not in refunds_audit
    assert "clean" in page.locator("#audit-refunds-title").inner_text()
    shot(page, "2x-refund-13-needs-attention-after")


def test_mark_failed_confirmation__warns_and_says_what_it_will_do(
    page, live_server, provider, queue
):
    """The confirmation of "mark charge failed" says, in plain words, that the customer may
    have been charged and which reads and provider actions decide; pressed on a charge whose
    answer came too late, it finds the charge and records it done instead."""
    late = flows.uncertain_after_read_timeout(provider, queue, key="web-mark-failed")
    provider.state.configure(search_lag=3600)  # the search would show nothing: it decides nothing
    user = make_user("alice", *VIEW, RECONCILE)
    user.set_password(PASSWORD)
    user.save()
    page.goto(f"{live_server.url}/admin/login/?next=/admin/payments/operation/{late.pk}/change/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**/admin/payments/operation/{late.pk}/change/")

    page.goto(f"{live_server.url}/admin/payments/operation/{late.pk}/steps/charge/mark_failed/")
    warning = page.locator(".desk-may-be-charged")
    assert "The customer may already have been charged" in warning.inner_text()
    plan = page.locator("ul.desk-plan").inner_text()
    assert "replayed with the same idempotency key" in plan
    assert "more than 15 min ago" in plan and "last request:" in plan
    # Nobody has asked the provider since the operation became uncertain: the button is off.
    confirm = page.get_by_role("button", name="Check and mark failed")
    assert confirm.is_disabled()
    assert "“Query the provider now” first" in page.locator(".desk-state-forbids").inner_text()
    shot(page, "20-mark-failed-confirm")

    # A look-up that found nothing (the provider's search lags an hour) lets it be pressed.
    fence.note_provider_view(late.claims.get(step="charge"), None, source="reconciler")
    page.reload()
    page.fill("#id_reason", "the customer says nothing was taken")
    page.get_by_role("button", name="Check and mark failed").click()
    # Done otherwise than asked: back on the operation, with a warning that says what.
    refusal = page.locator(".messagelist .warning")
    assert (
        "succeeded" in refusal.inner_text() and "nothing was marked failed" in refusal.inner_text()
    )
    shot(page, "21-mark-failed-found-the-charge")
    claim = late.claims.get(step="charge")
    assert claim.state == ClaimState.DONE
    assert provider.state.succeeded_count() == 1
