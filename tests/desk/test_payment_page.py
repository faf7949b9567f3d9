"""An order's page shows its payment: money, charges and refunds, a duplicate in red, a timeline;
and an operator refunds from it through the refund handler's desk hook.

Transactional: the checkouts and refunds run in a real worker against the
real fake provider (a claim must commit before its call).
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from payments.models import Operation, OperationEvent, OperationState
from payments.shop.models import Order, OrderStatus
from tests.support import flows
from tests.support.users import RECONCILE, VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

REFUND = "shop.refund_order"


def order_url(order: Order) -> str:
    return reverse("admin:shop_order_change", args=[order.pk])


def refund_url(order: Order, charge: str = "") -> str:
    url = reverse("admin:shop_order_refund", args=[order.pk])
    return f"{url}?charge={charge}" if charge else url


def action_id(page: str) -> str:
    found = re.search(r'name="action_id" value="([0-9a-f]{32})"', page)
    assert found is not None, "the confirmation page has no action id"
    return found.group(1)


def seen(page: str) -> str:
    """The newest refund the confirmation page showed (0: none)."""
    found = re.search(r'name="seen" value="([0-9]+)"', page)
    assert found is not None, "the confirmation page has no seen marker"
    return found.group(1)


def test_order_page__charged_twice__both_charges_red_and_a_timeline(provider, queue):
    order, fenced, duplicate = flows.charged_twice(queue)
    viewer = make_user("vera", *VIEW)

    page = client_for(viewer).get(order_url(order)).content.decode()

    table = page.split('id="desk-movements"', 1)[1].split("</table>", 1)[0]
    red = [row for row in table.split("<tr")[1:] if "desk-duplicate" in row.split(">", 1)[0]]
    assert len(red) == 2
    assert any(fenced in row for row in red) and any(duplicate in row for row in red)
    assert "Charged more than once" in page
    assert "€39.98" in page.split('id="desk-charged"', 1)[1][:200]
    timeline = page.split('id="desk-timeline"', 1)[1].split("</table>", 1)[0]
    charge = Operation.objects.get(entity_id=str(order.pk), kind="checkout").claims.get(
        step="charge"
    )
    assert charge.idempotency_key in timeline
    # A viewer without the refund permission sees the button disabled, the permission named.
    assert "desk-refund-duplicate" not in page and REFUND in page


def test_refund_duplicate_from_the_order_page__amount_prefilled_once_through_the_fence(
    provider, queue
):
    order, fenced, duplicate = flows.charged_twice(queue)
    client = client_for(make_user("rosa", *VIEW, REFUND))
    assert "desk-refund-duplicate" in client.get(order_url(order)).content.decode()

    form = client.get(refund_url(order, duplicate)).content.decode()
    assert 'value="19.99"' in form  # the duplicate's whole amount
    data = {"amount": "19.99", "reason": "charged twice (fence audit)", "charge": duplicate,
            "action_id": action_id(form), "seen": seen(form)}  # fmt: skip
    first = client.post(refund_url(order), data)
    again = client.post(refund_url(order), data)  # a second press of the same page

    assert first.status_code == again.status_code == 302
    refund = Operation.objects.get(kind="refund", entity_id=str(order.pk))  # one, not two
    assert refund.params["payment_intent"] == duplicate and refund.params["duplicate"] is True
    assert OperationEvent.objects.filter(
        operation=refund, actor="operator:rosa", reason__contains="charged twice"
    ).exists()
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.PAID, 0)  # paid once
    page = client.get(order_url(order)).content.decode()
    assert "€19.99" in page.split('id="desk-refunded"', 1)[1][:200]
    assert "€19.99" in page.split('id="desk-net"', 1)[1][:200]


def test_refund_from_the_desk__over_the_limit_refused_nothing_written(provider, queue):
    order, _ = flows.order_and_checkout(key="limit-1")
    run_worker(queue)
    client = client_for(make_user("rosa", *VIEW, REFUND))
    form = client.get(refund_url(order)).content.decode()

    response = client.post(
        refund_url(order),
        {"amount": "20.00", "reason": "r", "action_id": action_id(form), "seen": seen(form)},
    )

    assert response.status_code == 409
    assert "Nothing was refunded" in response.content.decode()
    assert not Operation.objects.filter(kind="refund").exists()


def test_refund_from_the_desk__needs_refund_order_and_names_it(provider, queue):
    order, _ = flows.order_and_checkout(key="perm-1")
    response = client_for(make_user("otto", *VIEW, RECONCILE)).get(refund_url(order))
    assert response.status_code == 403
    assert REFUND in response.content.decode()


def test_order_page__paid_by_a_worker__timeline_shows_the_charge_http_200_and_request_id(
    provider, queue
):
    order = flows.paid_order(queue)
    done = OperationEvent.objects.get(
        operation__entity_id=str(order.pk), step="charge", to_state="done"
    )

    page = client_for(make_user("vera", *VIEW)).get(order_url(order)).content.decode()

    timeline = page.split('id="desk-timeline"', 1)[1].split("</table>", 1)[0]
    rows = [r for r in timeline.split("<tr")[1:] if "/ charge" in r and "→ done" in r]
    assert len(rows) == 1, "one outcome row for the charge"
    answer = re.search(r'class="desk-http"[^>]*>\s*(\d{3})\b.*?(req_\w+)', rows[0], re.S)
    assert answer is not None, "the charge's row shows its HTTP status and request id"
    assert answer.group(1) == "200"
    assert done.actor in rows[0]  # who sent it: the worker


def test_order_page__operator_queried_a_lost_answer__the_replay_shown_as_the_operator_s(
    provider, queue
):
    from payments.desk.services import query_provider

    op = flows.uncertain_after_read_timeout(provider, queue, key="lost-then-asked")
    olga = make_user("olga", *VIEW, RECONCILE)

    query_provider([op.pk], user=olga)

    order = Order.objects.get(pk=int(op.entity_id))
    page = client_for(olga).get(order_url(order)).content.decode()
    timeline = page.split('id="desk-timeline"', 1)[1].split("</table>", 1)[0]
    lost = [r for r in timeline.split("<tr")[1:] if "/ charge" in r and "claimed → uncertain" in r]
    done = [r for r in timeline.split("<tr")[1:] if "/ charge" in r and "→ done" in r]
    assert len(lost) == 1 and "no answer: ReadTimeout" in lost[0]
    assert len(done) == 1 and "operator:olga" in done[0] and "(replayed)" in done[0]
    assert re.search(r'class="desk-http"[^>]*>200<.*?req_\w+', done[0], re.S)
