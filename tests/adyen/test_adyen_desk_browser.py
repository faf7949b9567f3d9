"""Issue 38 in a real browser, at 1280 and 390 px: an Adyen charge whose answer was lost.

Adyen offers no look-up: the operator sees the step in Adyen's words, the replay
deadline, the look-up button named for Adyen; past the deadline, the hold and why.
Screenshots: artifacts/screenshots/38-adyen-<page>-<width>.png.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from payments.engine.recovery import reconcile
from tests.adyen.test_adyen_lost_answers import lost_charge
from tests.support.adyen import settings_entry
from tests.support.browser import desk_tab, shot
from tests.support.builders import backdate
from tests.support.users import RECONCILE, VIEW

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("width", [1280, 390])
def test_an_operator_works_a_lost_adyen_answer(width, live_server, adyen, queue, settings):
    op, claim = lost_charge(adyen, queue)
    reachable = settings.PAYMENTS
    settings.PAYMENTS = {
        **reachable,
        "SYSTEMS": {"adyen": settings_entry("http://127.0.0.1:9/v72")},
    }
    reconcile()  # Adyen unreachable: the replay is not sent, the step stays uncertain
    settings.PAYMENTS = reachable
    page_url = f"{live_server.url}/admin/payments/operation/{op.pk}/change/"

    with desk_tab(width, live_server.url, "ada", *VIEW, RECONCILE) as tab:
        tab.goto(page_url)
        evidence = tab.locator(".desk-evidence").inner_text()
        assert "Adyen" in evidence and "the provider" not in evidence
        buttons = tab.locator(".desk-buttons .desk-button").all_inner_texts()
        assert "Query Adyen now" in [b.strip() for b in buttons]
        shot(tab, "38-adyen-uncertain")

        backdate(claim, timedelta(days=7))  # past the deadline: held for a person
        reconcile(operation_ids=[op.pk])  # named: looked at now, whatever its next look
        tab.goto(page_url)
        body = tab.locator("#content").inner_text()
        assert "Adyen offers no look-up and its replay window ended at" in body
        assert "Adyen offers no look-up: Adyen offers no look-up" not in body
        assert "query the provider" not in body.lower()
        shot(tab, "38-adyen-held")

        tab.goto(f"{live_server.url}/admin/payments/operation/needs-attention/")
        assert op.key in tab.locator("#content").inner_text()
        shot(tab, "38-adyen-needs-attention")
        tab.goto(page_url)

        tab.get_by_role("link", name="Query Adyen now").click()
        tab.click("input[type=submit][value*='uery'], button[type=submit]:has-text('uery')")
        assert "Queried Adyen" in tab.locator(".messagelist").inner_text()
        tab.goto(f"{page_url}".replace("/change/", "/steps/charge/mark_failed/"))
        confirm = tab.locator("#content").inner_text()
        assert "Adyen offers no look-up" in confirm and "Adyen's own report" in confirm
        assert "Nothing is cancelled at Adyen" in confirm
        assert "the provider" not in confirm
        shot(tab, "38-adyen-mark-failed")
        # Adyen did take this payment (its answer was lost): the operator who reads the
        # report takes the page's advice and does not mark it failed.
