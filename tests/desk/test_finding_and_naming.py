"""Finding and naming on the desk (issue 37, finding 8): what a search term means, where to
look when the orders search finds nothing, and the History in an operator's words.

Inside one test transaction (no worker runs): real PostgreSQL, the real HTTP fake provider.
"""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.urls import reverse

from payments.checkout.followups import write_follow_ups_in_tx
from payments.checkout.handler import request_checkout
from payments.desk.views.actions import QUERY_WORDS, outcome_words
from payments.models import Operation
from payments.shop.models import Order
from tests.support import builders
from tests.support.builders import order_of
from tests.support.users import RECONCILE, VIEW, client_for, make_user

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/payments/operation/"
ORDERS = "/admin/shop/order/"
#: Far above any id the sequences hand out in a test run: an order id chosen by the test.
FAR_ORDER = 9_000_000


def result_keys(page: str) -> list[str]:
    """The operation keys listed in the changelist's table, in order."""
    if 'id="result_list"' not in page:
        return []
    table = page.split('id="result_list"', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<th class="field-key"><a href="[^"]+">([^<]+)</a>', table)


def checkout_of_order(pk: int, key: str) -> Operation:
    """A checkout of an order whose id the test chooses."""
    Order.objects.create(pk=pk, amount=1000, currency="eur", customer_email="x@example.com")
    op, _ = request_checkout(order_id=pk, key=key, payment_method="pm_card_visa", actor="api")
    return op


@pytest.fixture
def op_id_is_another_order_s_id(provider) -> tuple[Operation, Operation]:
    """The operator's case: order 7's operation has id 17, and order 17 has its own operation.

    Returns (the operation whose id is N, the operation of order N).
    """
    seven = checkout_of_order(FAR_ORDER, "order-7-checkout")
    seventeen = checkout_of_order(seven.pk, "order-17-checkout")  # order id == seven's op id
    assert seven.entity_id != str(seven.pk) and seventeen.entity_id == str(seven.pk)
    return seven, seventeen


# --- (a) a number is an order id; #17 the operation ---------------------------------------


def test_search__a_bare_number_finds_its_order_s_operations_not_the_operation_with_that_id(
    op_id_is_another_order_s_id, viewer
):
    seven, _ = op_id_is_another_order_s_id

    page = client_for(viewer).get(CHANGELIST, {"q": str(seven.pk)}).content.decode()

    assert result_keys(page) == ["order-17-checkout"]
    # The page says what matched, and where the operation with that id is.
    assert f"Operations of order {seven.pk}" in page
    note = re.search(r'class="help desk-search-note">(.*?)</p>', page, re.S).group(1)
    assert f"?q=%23{seven.pk}" in note and "order-7-checkout" in note


@pytest.mark.parametrize("shape", ["#{}", "# {}", "op {}", "OP{}", "operation {}", "op:{}"])
def test_search__hash_or_op_and_a_number_finds_the_operation_with_that_id(
    op_id_is_another_order_s_id, viewer, shape
):
    seven, _ = op_id_is_another_order_s_id

    page = client_for(viewer).get(CHANGELIST, {"q": shape.format(seven.pk)}).content.decode()

    assert result_keys(page) == ["order-7-checkout"]
    assert f"Operation #{seven.pk}" in page  # what matched


def test_search__the_box_says_how_to_search_an_order_and_an_operation(provider, viewer):
    page = client_for(viewer).get(CHANGELIST).content.decode()
    help_text = re.search(r'id="searchbar_helptext">(.*?)</div>', page, re.S).group(1)

    assert "order id (17)" in help_text.lower() and "operation id (#17)" in help_text.lower()


def test_search__an_operation_id_finds_a_follow_up_though_follow_ups_are_hidden(provider, viewer):
    op, _ = builders.succeeded(key="paid-order")
    write_follow_ups_in_tx(order_of(op), "pi_follow", parent=op, actor="checkout")
    follow_up = Operation.objects.filter(parent=op).order_by("pk").first()

    page = client_for(viewer).get(CHANGELIST, {"q": f"#{follow_up.pk}"}).content.decode()

    assert result_keys(page) == [follow_up.key]


def test_search__a_key_that_looks_like_an_operation_id_is_still_found(provider, viewer):
    builders.new_checkout("#5")

    page = client_for(viewer).get(CHANGELIST, {"q": "#5"}).content.decode()

    assert "#5" in result_keys(page)


# --- (b) the orders search names where to look ----------------------------------------------


@pytest.mark.parametrize(
    "term, says",
    [
        ("pi_3QxLostAnswer", "a reference of the provider"),
        ("re_1RefundRef", "a reference of the provider"),
        ("fence_chk-1_charge", "an operation key or idempotency key"),
        ("chk-1", "an operation key or idempotency key"),
    ],
)
def test_orders_search__a_reference_or_key_finds_no_order_and_points_to_the_operations(
    provider, viewer, term, says
):
    page = client_for(viewer).get(ORDERS, {"q": term}).content.decode()

    assert "0 results" in page
    assert says in page
    assert f'href="{CHANGELIST}?q={quote(term)}' in page  # the operations search for it


def test_orders_search__no_link_to_operations_for_who_may_not_view_them(provider, db):
    orders_only = make_user("olga", "shop.view_order")

    page = client_for(orders_only).get(ORDERS, {"q": "pi_3QxLostAnswer"}).content.decode()

    assert "a reference of the provider" in page and "finds orders by their id or" in page
    assert f'href="{CHANGELIST}?q=' not in page


def test_orders_search__an_id_or_e_mail_gets_no_hint(provider, viewer):
    op = builders.new_checkout("chk-1")

    by_id = client_for(viewer).get(ORDERS, {"q": op.entity_id}).content.decode()
    by_email = client_for(viewer).get(ORDERS, {"q": "nobody@example.com"}).content.decode()

    assert "desk-search-note" not in by_id and "desk-search-note" not in by_email


# --- (c) the History in an operator's words and the desk's time format ----------------------


def history_url(op: Operation) -> str:
    return reverse("admin:payments_operation_history", args=[op.pk])


def log(op: Operation, user, message: str) -> None:
    LogEntry.objects.create(
        user=user,
        content_type=ContentType.objects.get_for_model(Operation),
        object_id=str(op.pk),
        object_repr=str(op),
        action_flag=CHANGE,
        change_message=message,
    )


#: Django's default English date format ("Dec. 4, 2026, 6:10 p.m."): never on a desk page.
DJANGO_DATE = re.compile(r"\b[A-Z][a-z]{2,8}\.? \d{1,2}, \d{4}|\b[ap]\.m\.")
#: The desk's one time format (payments.desk.display.when).
DESK_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC\b")
#: A code as the engine names things (`retry_later`, `needs_review`): never in the History.
CODE = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b")


def visible_text(html: str) -> str:
    """The words of an HTML fragment, without its tags."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def section(page: str, start: str, end: str) -> str:
    return page.split(start, 1)[1].split(end, 1)[0]


@pytest.mark.parametrize("outcome", sorted(QUERY_WORDS))
def test_history__a_logged_look_up_reads_in_words_not_its_code(provider, operator, outcome):
    op, _, _ = builders.uncertain(charged=False)
    log(op, operator, f"Queried the provider: {outcome}")  # what the bulk action logs

    page = client_for(operator).get(history_url(op)).content.decode()
    table = visible_text(section(page, 'id="change-history"', "</table>"))

    assert f"Queried the provider: {outcome_words()[outcome]}" in table
    assert not CODE.search(table)


def test_history__times_in_the_desk_s_format_and_state_codes_as_labels(provider, operator):
    op, _, _ = builders.uncertain(charged=False)
    log(op, operator, "Queried the provider: read (state unchanged: needs_review)")

    page = client_for(operator).get(history_url(op)).content.decode()
    table = visible_text(section(page, 'id="change-history"', "</table>"))

    assert DESK_DATE.search(table) and not DJANGO_DATE.search(table)
    assert not CODE.search(table) and "Needs review" in table


def test_history__a_look_up_from_the_list_with_the_provider_down_reads_in_words(
    provider, operator, settings
):
    op, _, _ = builders.uncertain(charged=True)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": "http://127.0.0.1:9"}  # no answer
    client = client_for(operator)
    client.post(
        CHANGELIST, {"action": "query_selected", "_selected_action": [op.pk], "post": "yes"}
    )

    page = client.get(history_url(op)).content.decode()
    table = visible_text(section(page, 'id="change-history"', "</table>"))

    assert f"Queried the provider: {outcome_words()['retry_later']}" in table
    assert not CODE.search(table)


@pytest.mark.django_db
def test_the_operations_entity__in_its_handlers_words_linked_when_it_has_a_page(monkeypatch):
    """The list's "acts on" column names the entity by its handler's model (not the shop's
    "order" for every kind): linked to the model's admin page when it has one."""
    from django.contrib import admin as django_admin
    from django.db import models

    from payments.admin import OperationAdmin
    from payments.engine import handlers
    from payments.models import Operation

    class Rental(models.Model):  # noqa: DJ008
        code = models.CharField(max_length=12, primary_key=True)

        class Meta:
            app_label = "payments"
            managed = False

    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    handlers.handler("rent-it", entity=Rental)(lambda run: None)
    column = OperationAdmin(Operation, django_admin.site).entity_link

    rental = Operation(kind="rent-it", entity_type="rental", entity_id="R-1001")
    assert column(rental) == "Rental R-1001"  # no admin page: named, not linked
    order = Operation(kind="checkout", entity_type="order", entity_id="42")
    assert column(order) == '<a href="/admin/shop/order/42/change/">Order&nbsp;42</a>'


def test_a_desk_actions_page__names_the_entity_in_its_handlers_words(provider):
    """The confirmation page's "acts on" row is the list's column (issue 40: not a row
    headed "Order" for every kind), linked only for an operator who may view the entity."""
    op, _claim, _ = builders.uncertain(key="acts-on", charged=False)
    url = reverse("admin:payments_operation_desk", args=[op.pk, "query_provider"])
    may_view = client_for(make_user("viewer", *VIEW, RECONCILE))
    may_not = client_for(make_user("ops-only", "payments.view_operation", RECONCILE))
    order_url = reverse("admin:shop_order_change", args=[op.entity_id])

    linked = may_view.get(url).content.decode()
    named = may_not.get(url).content.decode()

    assert re.search(
        r'<th scope="row">Acts on</th><td class="desk-entity"><a href="'
        + re.escape(order_url)
        + rf'">Order&nbsp;{op.entity_id}</a>',
        linked,
    )
    assert f'<td class="desk-entity">Order {op.entity_id}</td>' in named
    assert order_url not in named and '<th scope="row">Order</th>' not in linked
