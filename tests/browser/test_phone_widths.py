"""Issue 37, finding 6, in a real browser: the refund page and "mark succeeded" fit a phone.

At 390 px the refunds already asked (a desk refund's key is one long token)
and the steps of an operation must neither widen the page nor be cut off;
at 1280 px they stay tables. Headless Chromium (Playwright) against
pytest-django's live server, with the real worker and fake provider.
Screenshots land in artifacts/screenshots/ (gitignored), named by width.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from django.db import connections

from payments.desk.refund import refund_entity
from payments.models import OperationState
from tests.support import flows
from tests.support.users import RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

# Transactional: the live server's thread must see what the test committed.
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
PASSWORD = "correct-horse-battery-9"

#: The boxes of the cells of `table` that the window or their own box cut off.
CLIPPED_CELLS = """table => [...table.querySelectorAll('th, td')]
    .filter(cell => cell.getClientRects().length > 0)
    .filter(cell => {
        const box = cell.getBoundingClientRect();
        return box.left < 0 || box.right > window.innerWidth + 1
            || cell.scrollWidth > cell.clientWidth + 1;
    })
    .map(cell => cell.innerText.slice(0, 40))"""


@pytest.fixture(params=[1280, 390], ids=["1280px", "390px"])
def tab(request, monkeypatch):
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium"
    from playwright import sync_api

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # see test_browser.py
    SHOTS.mkdir(parents=True, exist_ok=True)
    width = request.param
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.set_default_timeout(15_000)
        page.width = width
        try:
            yield page
        finally:
            browser.close()
            connections.close_all()  # see test_browser.py


def sign_in(page, live_server, username: str, *perms: str, then: str) -> None:
    user = make_user(username, *perms)
    user.set_password(PASSWORD)
    user.save()
    page.goto(f"{live_server.url}/admin/login/?next={then}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{then}")


def assert_fits(page, name: str) -> None:
    """Save a full-page screenshot, then check no page width or table cell is cut off."""
    page.screenshot(path=str(SHOTS / f"37-{page.width}-{name}.png"), full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= page.width, f"{name}: the page is {width} px wide at {page.width} px"
    for table in page.locator("#content-main table").all():
        assert table.evaluate(CLIPPED_CELLS) == [], f"{name}: cells cut off"


def test_refund_page__refunds_asked_fit_the_window(tab, live_server, provider, queue):
    order = flows.paid_order(queue, amount=2500)
    operator = make_user("rosa", *VIEW, "shop.refund_order")
    done, _ = refund_entity(
        "order", order.pk, user=operator, amount=600, reason="a late parcel",
        action_id=uuid.uuid4().hex, seen=0,
    )  # fmt: skip
    run_worker(queue)
    done.refresh_from_db()
    assert done.state == OperationState.SUCCEEDED
    in_flight, _ = refund_entity(
        "order", order.pk, user=operator, amount=400, reason="a broken lid",
        action_id=uuid.uuid4().hex, seen=done.pk,
    )  # fmt: skip
    url = f"/admin/shop/order/{order.pk}/refund/"
    sign_in(tab, live_server, "sam", *VIEW, "shop.refund_order", then=url)

    tab.fill("#id_reason", "the customer sent it back")
    assert_fits(tab, "refund-refunds-asked")
    asked = tab.locator("#desk-refunds-asked")
    assert asked.locator("tr.desk-refund-asked").count() == 2
    for op in (done, in_flight):
        key = asked.get_by_role("link", name=op.key)
        assert key.is_visible()
        box = key.bounding_box()
        assert 0 <= box["x"] and box["x"] + box["width"] <= tab.width, op.key
    assert asked.locator(".desk-in-flight strong.desk-warning").is_visible()


def test_mark_succeeded_page__steps_and_form_fit_the_window(tab, live_server, provider, queue):
    lost = flows.uncertain_after_read_timeout(provider, queue, key="web-phone-mark-succeeded")
    url = f"/admin/payments/operation/{lost.pk}/steps/charge/mark_succeeded/"
    sign_in(tab, live_server, "alice", *VIEW, RECONCILE, then=url)

    tab.fill("#id_reason", "the provider's dashboard shows it succeeded")
    assert_fits(tab, "mark-succeeded")
    assert tab.locator("#id_reference").is_visible() and tab.locator("#id_reason").is_visible()
    claim = lost.claims.get(step="charge")
    assert claim.idempotency_key in tab.locator("#content-main").inner_text()
    box = tab.locator("#id_reference").bounding_box()
    assert box["x"] + box["width"] <= tab.width
