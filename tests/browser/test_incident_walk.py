"""Issue 37 in a real browser: the desk during a provider incident, at 1280 and 390 px.

Four uncertain charges whose provider stopped answering (a port nothing listens
on), one of them held in flight by the provider first (its same-key replay
answered 409, its list read showing the declined intent and its amount): an
operator walks home -> Needs attention -> an operation -> mark failed -> a bulk
query, as one would at 3 a.m. A refund the outage refused before it ran is a case
on Needs attention, not gone from it. Every page fits the window; the banner, the
evidence and the stated waits are on screen. Screenshots (artifacts/screenshots/
37-incident-<width>-<page>.png) are the pages docs/operators.md describes under
"During a provider incident".
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connections
from django.utils import timezone

from payments.desk.views.queries import FAILED_WINDOW
from payments.engine.recovery import reconcile
from payments.engine.writes import fence_writes
from payments.models import Operation
from payments.refunds.handler import request_refund
from tests.support import builders, flows
from tests.support.users import RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
PASSWORD = "correct-horse-battery-9"
DOWN = "http://127.0.0.1:9"


@pytest.fixture(params=[1280, 390], ids=["1280px", "390px"])
def tab(request, monkeypatch):
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium"
    from playwright import sync_api

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # see test_browser.py
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        # An operator in Paris: the desk's UTC times get their local time beside them.
        page = browser.new_page(
            viewport={"width": request.param, "height": 900}, timezone_id="Europe/Paris"
        )
        page.set_default_timeout(15_000)
        page.width = request.param
        try:
            yield page
        finally:
            browser.close()
            connections.close_all()  # see test_browser.py


def shot(page, name: str) -> None:
    """Save the whole page, then check it is no wider than the window."""
    page.screenshot(path=str(SHOTS / f"37-incident-{page.width}-{name}.png"), full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= page.width, f"{name}: the page is {width} px wide at {page.width} px"


def test_an_operator_walks_the_desk_during_a_provider_incident(
    tab, live_server, provider, queue, settings
):
    # A refund the outage refused three times before it ran: failed, the customer owed.
    paid = flows.paid_order(queue)
    provider.state.enqueue_faults("fail_before", 3)
    request_refund(order_id=paid.pk, key="walk-refund", amount=400, actor="api")
    run_worker(queue)
    # And one refused so the day before: past the cases' 24 h, still owed.
    older = flows.refund_failed_by_an_outage(provider, queue, "walk-refund-yesterday")
    with fence_writes():  # hand-made state: failed a day and an hour ago
        Operation.objects.filter(pk=older.pk).update(
            updated_at=timezone.now() - FAILED_WINDOW - timedelta(hours=1)
        )
    held = flows.declined_charge_held_in_flight(provider, queue, "walk-held", slow=3.0)
    for n in range(3):
        builders.uncertain(key=f"walk-lost-{n}", charged=n != 2)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": DOWN}
    reconcile()
    user = make_user("nina", *VIEW, RECONCILE)
    user.set_password(PASSWORD)
    user.save()
    tab.goto(f"{live_server.url}/admin/login/?next=/admin/")
    tab.fill("#id_username", "nina")
    tab.fill("#id_password", PASSWORD)
    tab.click("input[type=submit]")
    tab.wait_for_url("**/admin/")

    banner = tab.locator(".desk-incident")
    assert banner.is_visible()
    assert "Incident at the provider since" in banner.inner_text()
    shot(tab, "home")

    tab.goto(f"{live_server.url}/admin/payments/operation/needs-attention/")
    assert "operations wait for an answer" in tab.locator(".desk-incident").inner_text()
    case = tab.locator(".desk-case", has_text="walk-refund")
    assert "Nothing ran at the provider" in case.inner_text()
    counted = tab.locator(".desk-pages").inner_text()
    assert "1 failed before anything ran (of the 1 failed in the last 24 h)" in counted
    not_listed = tab.locator("#cases-not-listed")
    assert "more than 24 h ago, not listed here" in not_listed.inner_text()
    shot(tab, "needs-attention")

    tab.goto(f"{live_server.url}/admin/payments/operation/{held.pk}/change/")
    evidence = tab.locator(".desk-evidence")
    assert "in flight at the provider since" in evidence.inner_text()
    # All of it on screen: Django indents a form's lists by 160 px and its rows clip what
    # overflows them, which cut "Seen at its system" mid-word at 1280 px.
    row = "e => e.closest('.form-row').getBoundingClientRect().right"
    assert evidence.evaluate("e => e.getBoundingClientRect().right") <= evidence.evaluate(row)
    table = tab.locator(".desk-provider-view")
    assert table.evaluate("e => e.getBoundingClientRect().right") <= table.evaluate(row)
    assert "€74.50" in evidence.inner_text()
    assert tab.locator(".desk-next-step").first.is_visible()
    shot(tab, "operation-in-flight")

    lost = held.__class__.objects.get(key="walk-lost-0")
    tab.goto(f"{live_server.url}/admin/payments/operation/{lost.pk}/change/")
    assert (
        "Waiting: the provider has not answered since" in tab.locator(".desk-evidence").inner_text()
    )
    shot(tab, "operation-unanswered")

    tab.goto(f"{live_server.url}/admin/payments/operation/{lost.pk}/steps/charge/mark_failed/")
    body = tab.locator("#content").inner_text()
    assert "the fence looks again at" in body
    assert "Query the provider now” first" not in body
    shot(tab, "mark-failed-waits")

    tab.goto(f"{live_server.url}/admin/payments/operation/?state__exact=uncertain")
    tab.locator("#action-toggle").check()
    tab.select_option("select[name=action]", "query_selected")
    tab.click("button[name=index]")
    # The local times are added on DOMContentLoaded: read the result page once it has
    # loaded, not as soon as its message list is parsed.
    with tab.expect_navigation():
        tab.click("input[type=submit][value*='uery'], button[type=submit]:has-text('uery')")
    report = tab.locator(".messagelist").inner_text()
    assert "settled" in report and "not read" in report
    assert "ConnectionError" in report
    assert "UTC (" in report  # the next look's time, in Paris too (a message is not #content)
    # Each operation's line says what came of it, and none that was not read wears Django's
    # green success tick (its rows are list items inside the message list, styled like one).
    unread = tab.locator(".desk-query-report li.desk-query-not-read")
    assert unread.count() >= 1
    for i in range(unread.count()):
        line = unread.nth(i)
        assert line.inner_text().startswith("Not read")
        assert line.evaluate("e => getComputedStyle(e).backgroundImage") == "none"
    shot(tab, "bulk-query")
    assert provider.state.wait_idle(timeout=10)
