"""Refund from the desk: a second refund is never asked without the first being seen; the
amount typed is read one way only; money is shown in the order's currency.

Each test drives the real confirmation view with Django's test client; the
refunds run in a real worker against the real fake provider.

Transactional: a claim must commit before its provider call, and the refusal
of an unseen refund is decided under the order's lock by committed rows.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from payments.checkout.orders import create_order
from payments.models import Operation, OperationState
from payments.shop.models import Invoice, Order
from tests.support import flows
from tests.support.concurrency import race
from tests.support.users import VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

REFUND = "shop.refund_order"
COMMA = "Type the amount with a point for decimals and no thousands separator, e.g. 12.50"


@pytest.fixture
def rosa(db):
    return make_user("rosa", *VIEW, REFUND)


def refund_url(order: Order, charge: str = "") -> str:
    url = reverse("admin:shop_order_refund", args=[order.pk])
    return f"{url}?charge={charge}" if charge else url


def hidden(page: str, name: str, default: str | None = None) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', page)
    if found is None and default is not None:
        return default
    assert found is not None, f"the confirmation page has no {name}"
    return found.group(1)


def form_of(page: str, amount: str, reason: str = "customer asked") -> dict[str, str]:
    """What the browser posts from this page, `amount` typed."""
    return {
        "amount": amount,
        "reason": reason,
        "action_id": hidden(page, "action_id"),
        "seen": hidden(page, "seen", default=""),  # asserted apart: see the listing's test
    }


def refunds_of(order: Order) -> list[Operation]:
    return list(Operation.objects.filter(kind="refund", entity_id=str(order.pk)).order_by("pk"))


def provider_refunds(provider, order: Order) -> list[dict]:
    return provider.state.refunds(metadata={"order_id": str(order.pk)})


# --- a second refund needs the first one seen -------------------------------------------------


def test_back_then_resubmit__stale_page_refused_until_the_first_refund_is_acknowledged(
    provider, queue, rosa
):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    first_page = client.get(refund_url(order)).content.decode()
    assert client.post(refund_url(order), form_of(first_page, "2.00")).status_code == 302
    run_worker(queue)
    (first,) = refunds_of(order)
    # Back: the page is fetched again (a fresh token) but the browser restores the old form.
    fresh = client.get(refund_url(order)).content.decode()
    stale = {**form_of(first_page, "2.00"), "action_id": hidden(fresh, "action_id")}

    refused = client.post(refund_url(order), stale)

    assert refused.status_code == 409
    page = refused.content.decode()
    message = page.split('class="errornote desk-refusal"', 1)[1].split("</p>", 1)[0]
    assert first.key in message and "€2.00" in message and "operator:rosa" in message
    assert "Succeeded" in message and " UTC" in message
    box = re.search(rf'<input type="checkbox" name="again_{first.pk}"[^>]*>', page)
    assert box is not None and f'value="{first.pk}"' in box.group(0)
    assert "checked" not in box.group(0) and "required" in box.group(0)
    assert f"Refund again: I have seen refund {first.key} of €2.00" in page
    run_worker(queue)
    assert len(refunds_of(order)) == len(provider_refunds(provider, order)) == 1

    acknowledged = client.post(refund_url(order), {**stale, f"again_{first.pk}": str(first.pk)})

    assert acknowledged.status_code == 302
    run_worker(queue)
    assert len(refunds_of(order)) == len(provider_refunds(provider, order)) == 2


def test_acknowledgement_naming_another_operation__refused(provider, queue, rosa):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    page = client.get(refund_url(order)).content.decode()
    client.post(refund_url(order), form_of(page, "2.00"))
    (first,) = refunds_of(order)
    fresh = {**form_of(page, "2.00"), "action_id": "f" * 32}

    wrong = client.post(refund_url(order), {**fresh, f"again_{first.pk}": "on"})

    assert wrong.status_code in (200, 409)
    assert len(refunds_of(order)) == 1


def test_two_tabs__the_second_post_is_refused_one_refund(provider, queue, rosa):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    tab_a = client.get(refund_url(order)).content.decode()
    tab_b = client.get(refund_url(order)).content.decode()

    first = client.post(refund_url(order), form_of(tab_a, "2.00"))
    second = client.post(refund_url(order), form_of(tab_b, "2.00"))

    assert (first.status_code, second.status_code) == (302, 409)
    (asked,) = refunds_of(order)
    assert asked.key in second.content.decode()
    run_worker(queue)
    assert len(provider_refunds(provider, order)) == 1


def test_two_tabs__the_first_refunded_it_all__the_second_offers_no_refund_again(
    provider, queue, rosa
):
    """The refusal of an unseen refund must not ask for a tick that cannot refund: with
    nothing left, the page says so and has no "Refund again" box or instruction."""
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    tab_a = client.get(refund_url(order)).content.decode()
    tab_b = client.get(refund_url(order)).content.decode()
    assert client.post(refund_url(order), form_of(tab_a, "25.00")).status_code == 302

    second = client.post(refund_url(order), form_of(tab_b, "2.00"))

    assert second.status_code == 409
    page = second.content.decode()
    (asked,) = refunds_of(order)
    message = page.split('class="errornote desk-refusal"', 1)[1].split("</p>", 1)[0]
    assert asked.key in message and "€25.00" in message
    assert "No refund of this order can be asked now" in page
    assert 'name="again_' not in page and "Refund again" not in page
    assert "tick" not in message.lower()
    run_worker(queue)
    assert len(provider_refunds(provider, order)) == 1


def test_two_tabs_posted_at_the_same_instant__one_refund(provider, queue, rosa):
    """Two POSTs on their own connections behind a barrier: the order's lock lets one ask."""
    order = flows.paid_order(queue, amount=2500)
    tabs = [client_for(rosa).get(refund_url(order)).content.decode() for _ in range(2)]

    codes = race(
        [lambda page=page: client_for(rosa).post(refund_url(order), form_of(page, "2.00")).status_code
         for page in tabs]
    )  # fmt: skip

    assert sorted(codes) == [302, 409]
    run_worker(queue)
    assert len(refunds_of(order)) == len(provider_refunds(provider, order)) == 1


def test_same_page_posted_twice__one_refund(provider, queue, rosa):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    page = client.get(refund_url(order)).content.decode()

    first = client.post(refund_url(order), form_of(page, "2.00"))
    again = client.post(refund_url(order), form_of(page, "2.00"))

    assert first.status_code == again.status_code == 302
    run_worker(queue)
    assert len(refunds_of(order)) == len(provider_refunds(provider, order)) == 1


def test_confirmation__lists_refunds_asked_and_counts_them_in_what_is_left(provider, queue, rosa):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    page = client.get(refund_url(order)).content.decode()
    assert 'autocomplete="off"' in page
    assert 'name="seen" value="0"' in page
    client.post(refund_url(order), form_of(page, "2.00"))
    (asked,) = refunds_of(order)

    in_flight = client.get(refund_url(order)).content.decode()

    table = in_flight.split('id="desk-refunds-asked"', 1)[1].split("</table>", 1)[0]
    assert asked.key in table and "€2.00" in table and "operator:rosa" in table
    assert "in flight" in table and " UTC" in table
    assert "€23.00" in in_flight.split('id="desk-left"', 1)[1][:200]
    assert hidden(in_flight, "seen") == str(asked.pk)
    run_worker(queue)
    done = client.get(refund_url(order)).content.decode()
    table = done.split('id="desk-refunds-asked"', 1)[1].split("</table>", 1)[0]
    assert "Succeeded" in table and "in flight" not in table


# --- the amount is read one way only ----------------------------------------------------------


@pytest.mark.parametrize("typed, currency", [("12,50", "eur"), ("1,000", "jpy")])
def test_amount_with_a_comma__refused_with_the_reason(provider, queue, rosa, typed, currency):
    order = create_order(amount=500000, currency=currency, email="buyer@example.com")
    client = client_for(rosa)
    page = client.get(refund_url(order)).content.decode()

    response = client.post(refund_url(order), form_of(page, typed))

    assert response.status_code == 200
    assert COMMA in response.content.decode()
    assert refunds_of(order) == []


@pytest.mark.parametrize(
    "typed", ["Infinity", "-Infinity", "sNaN", "NaN", "1e400", "1e-400", " ", "٣"]
)
def test_amount_not_a_plain_number__a_form_error_no_refund(provider, queue, rosa, typed):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    page = client.get(refund_url(order)).content.decode()

    response = client.post(refund_url(order), form_of(page, typed))

    assert response.status_code == 200
    assert response.context["form"].errors["amount"]
    assert "0" * 40 not in response.content.decode()  # nothing absurd echoed
    assert refunds_of(order) == []


# --- money in the order's currency; only what can be refunded offered -------------------------


def test_over_the_limit__refusal_in_the_order_s_money(provider, queue, rosa):
    order = flows.paid_order(queue, amount=2500)
    client = client_for(rosa)
    page = client.get(refund_url(order)).content.decode()

    response = client.post(refund_url(order), form_of(page, "30.00"))

    assert response.status_code == 409
    text = response.content.decode()
    assert "€25.00 left to refund, not €30.00" in text and "minor units" not in text


def test_jpy_order__help_example_without_decimals(provider, queue, rosa):
    order = create_order(amount=5000, currency="jpy", email="buyer@example.com")

    page = client_for(rosa).get(refund_url(order)).content.decode()

    assert "(49.99)" not in page and "(5000)" in page


def test_own_charge_through_the_charge_parameter__an_ordinary_refund(provider, queue, rosa):
    order = flows.paid_order(queue, amount=2500)
    own = Invoice.objects.get(order=order).provider_reference
    client = client_for(rosa)

    page = client.get(refund_url(order, own)).content.decode()

    assert "duplicate" not in page.split('class="desk-refund-plan"', 1)[1].split("</p>", 1)[0]
    assert own not in page.split("<form", 1)[1]  # the form refunds the order, not "a charge"
    data = {**form_of(page, "2.00"), "charge": own}  # even posted with it
    assert client.post(refund_url(order), data).status_code == 302
    (asked,) = refunds_of(order)
    assert not asked.params.get("duplicate")
    run_worker(queue)
    asked.refresh_from_db()
    assert asked.state == OperationState.SUCCEEDED


def test_order_still_processing__refund_disabled_with_the_reason(provider, queue, rosa):
    order, _ = flows.order_and_checkout(key="processing-1")  # no worker: nothing captured yet
    client = client_for(rosa)

    order_page = client.get(reverse("admin:shop_order_change", args=[order.pk]))

    text = order_page.content.decode()
    assert 'class="button desk-refund"' not in text
    assert "nothing was captured yet" in text
    confirm = client.get(refund_url(order)).content.decode()
    assert "nothing was captured yet" in confirm
    assert re.search(r'value="Yes, refund"[^>]*disabled', confirm)
