"""A duplicate charge stays refundable until what was given back of it reaches its amount.

Transactional: the checkout and the refunds run in a real worker against the real fake
provider (a claim must commit before its call); the duplicate is a real second charge.
"""

from __future__ import annotations

import io
import json
import re

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from payments.models import Operation, OperationState
from payments.shop.models import Order
from tests.support import flows
from tests.support.users import VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

REFUND = "shop.refund_order"


def refund_duplicate(client, order: Order, duplicate: str, amount: str) -> Operation:
    """Ask for a refund of `amount` of the duplicate from its button's page."""
    url = reverse("admin:shop_order_refund", args=[order.pk])
    form = client.get(f"{url}?charge={duplicate}").content.decode()
    found = re.search(r'name="action_id" value="([0-9a-f]{32})"', form)
    assert found is not None
    seen = re.search(r'name="seen" value="([0-9]+)"', form)
    assert seen is not None
    data = {"amount": amount, "reason": "charged twice", "charge": duplicate,
            "action_id": found.group(1), "seen": seen.group(1)}  # fmt: skip
    assert client.post(url, data).status_code == 302
    return Operation.objects.filter(kind="refund").latest("pk")


def movements_of(client, order: Order) -> tuple[str, list[str]]:
    page = client.get(reverse("admin:shop_order_change", args=[order.pk])).content.decode()
    table = page.split('id="desk-movements"', 1)[1].split("</table>", 1)[0]
    return page, table.split("<tr")[1:]


def test_duplicate__refunded_in_part__still_refundable_and_shows_what_is_left(provider, queue):
    order, _, duplicate = flows.charged_twice(queue)
    client = client_for(make_user("rosa", *VIEW, REFUND))
    refund = refund_duplicate(client, order, duplicate, "5.00")
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED

    page, rows = movements_of(client, order)

    [row] = [r for r in rows if duplicate in r and "duplicate charge" in r]
    assert "€5.00 refunded, €14.99 left" in row
    assert "desk-refund-duplicate" in row
    assert "Every" not in page.split("Charged more than once", 1)[1].split("</p>", 1)[0]


def test_duplicate__refund_failed__shown_failed_and_the_duplicate_still_refundable(provider, queue):
    order, _, duplicate = flows.charged_twice(queue)
    client = client_for(make_user("rosa", *VIEW, REFUND))
    provider.state.enqueue_faults("fail_before", 3)  # every attempt refused before it ran
    refund = refund_duplicate(client, order, duplicate, "19.99")
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.FAILED

    _, rows = movements_of(client, order)

    [failed] = [r for r in rows if refund.key in r]
    assert "refund" in failed and "failed" in failed and "€19.99" in failed
    [row] = [r for r in rows if duplicate in r and "duplicate charge" in r]
    assert "desk-refund-duplicate" in row


def test_duplicate_refunded_in_full__the_next_audit_clears_it_and_names_it_refunded(
    provider, queue
):
    """An operator walking an incident refunded a duplicate from the order's page; the next
    `fence_audit` still reported the double charge and the unfenced success and exited 1,
    and Needs attention kept "refund the extra charge" open for good. A duplicate given back
    in full is no longer a finding: the audit exits 0 and lists it as refunded in full."""
    order, _, duplicate = flows.charged_twice(queue)
    before = io.StringIO()
    with pytest.raises(CommandError):
        call_command("fence_audit", "--format", "json", stdout=before)
    assert json.loads(before.getvalue())["double_charged_entities"]
    client = client_for(make_user("rosa", *VIEW, REFUND))
    refund = refund_duplicate(client, order, duplicate, "5.00")
    run_worker(queue)
    partly = io.StringIO()
    with pytest.raises(CommandError):  # €14.99 of it still with us: still a double charge
        call_command("fence_audit", "--format", "json", stdout=partly)
    assert json.loads(partly.getvalue())["double_charged_entities"]

    refund = refund_duplicate(client, order, duplicate, "14.99")
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    after = io.StringIO()
    call_command("fence_audit", "--format", "json", stdout=after)  # exit 0: no CommandError

    report = json.loads(after.getvalue())
    assert report["clean"] is True and report["exit_code"] == 0
    assert report["double_charged_entities"] == [] and report["unfenced"] == []
    assert report["refunded_in_full"] == [duplicate]
    table = io.StringIO()
    call_command("fence_audit", stdout=table)
    assert f"Refunded in full (not findings): 1\n  {duplicate}" in table.getvalue()
    # The order's page still tells the second charge for what it was, given back.
    _, rows = movements_of(client, order)
    [row] = [r for r in rows if duplicate in r and "duplicate charge" in r]
    assert "desk-refund-duplicate" not in row  # nothing left of it to give back
