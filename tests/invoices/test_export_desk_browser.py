"""Issue 38 in a real browser, at 1280 and 390 px: an invoice export whose answer was lost.

The operator finds it under Needs attention (no money at stake), reads the step in the
accounting system's words, and queries that system; the same-key replay settles it.
Screenshots: artifacts/screenshots/38-export-<page>-<width>.png.
"""

from __future__ import annotations

import pytest

from payments.models import OperationState
from tests.invoices.test_export_desk import uncertain_export
from tests.support.browser import desk_tab, shot
from tests.support.users import RECONCILE, VIEW

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("width", [1280, 390])
def test_an_operator_works_a_lost_export_answer(width, live_server, accounting, queue):
    export = uncertain_export(accounting, queue)
    page_url = f"{live_server.url}/admin/payments/operation/{export.pk}/change/"

    with desk_tab(width, live_server.url, "iris", *VIEW, RECONCILE) as tab:
        tab.goto(f"{live_server.url}/admin/payments/operation/needs-attention/")
        attention = tab.locator("#content").inner_text()
        assert export.key in attention
        shot(tab, "38-export-needs-attention")

        tab.goto(page_url)
        assert (
            "No invoice seen at the accounting system yet" in tab.locator("#content").inner_text()
        )
        shot(tab, "38-export-uncertain")

        tab.get_by_role("link", name="Query the accounting system now").click()
        assert "The accounting system is asked" in tab.locator("#content").inner_text()
        shot(tab, "38-export-query")
        tab.click("input[type=submit][value*='uery'], button[type=submit]:has-text('uery')")
        report = tab.locator(".messagelist").inner_text()
        assert report.startswith("Queried the accounting system"), report
        shot(tab, "38-export-queried")

    export.refresh_from_db()
    assert export.claims.get(step="export").state == "done"
    assert export.state in (
        OperationState.RETRYING,
        OperationState.PENDING,
        OperationState.SUCCEEDED,
    )
