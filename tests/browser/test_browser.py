"""An operator settles a lost answer in a real browser: headless Chromium driven by Playwright.

The page, the server (pytest-django's live_server, transactional), PostgreSQL,
Redis, the worker and the fake provider are all real. Screenshots of each
step land in artifacts/screenshots/ (gitignored) for a person to look at.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connections

from payments.models import Operation, OperationState
from tests.support import flows
from tests.support.users import RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

# Transactional: the live server's thread must see what the test committed.
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
PASSWORD = "correct-horse-battery-9"


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
        tab = browser.new_page(viewport={"width": 1366, "height": 900})
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
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_operator_queries_the_provider_and_sees_the_payment_settle(
    page, live_server, provider, queue
):
    lost = flows.uncertain_after_read_timeout(provider, queue, key="web-checkout-1")
    paid = flows.checkout(key="web-checkout-2")
    run_worker(queue)
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

    page.locator("#changelist-filter").get_by_role("link", name="Uncertain").click()
    page.wait_for_url("**state__exact=uncertain**")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    assert paid.key not in rows.first.inner_text()
    shot(page, "03-filtered-uncertain")

    page.get_by_role("link", name=lost.key).click()
    badge = page.locator("div.field-badge .state-badge")
    assert badge.inner_text() == "Uncertain"
    shot(page, "04-operation-uncertain")

    page.get_by_role("link", name="Query provider now").click()
    assert page.get_by_text("What will happen").is_visible()
    shot(page, "05-confirm-query")

    page.get_by_role("button", name="Yes, query the provider").click()
    page.wait_for_url(f"**/admin/payments/operation/{lost.pk}/change/")
    assert "Queried the provider: done" in page.locator("ul.messagelist").inner_text()
    assert badge.inner_text() == "Retrying"
    trail = page.locator("#events-group")
    assert "operator:alice" in trail.inner_text()
    shot(page, "06-settled-retrying")

    run_worker(queue)  # the resumed operation runs its remaining steps
    page.reload()
    assert badge.inner_text() == "Succeeded"
    shot(page, "07-succeeded")
    page.get_by_role("link", name="Needs attention").first.click()
    succeeded = Operation.objects.filter(state=OperationState.SUCCEEDED).count()
    assert page.locator(".state-count-succeeded strong").inner_text() == str(succeeded)
    assert "No audit run yet" in page.locator("#desk-audit").inner_text()
    shot(page, "08-needs-attention")

    page.goto(f"{live_server.url}/admin/payments/operation/{lost.pk}/steps/charge/mark_succeeded/")
    assert page.locator("#id_reference").is_visible() and page.locator("#id_reason").is_visible()
    assert "The current state forbids this" in page.locator(".errornote").inner_text()
    shot(page, "09-mark-succeeded-refused")
    lost.refresh_from_db()
    assert lost.state == OperationState.SUCCEEDED
    assert provider.state.succeeded_count(metadata={"operation_key": lost.key}) == 1
