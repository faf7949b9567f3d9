"""The shop's models move from `payments` to their own app (`shop`) without losing a row.

payments 0027 and shop 0001 change the migration state only: a database from
before them keeps every order, invoice, credit note, ledger line and sales
day, every index and constraint, and every permission granted on those models
(their content types move with them, so "payments.refund_order" held by a
group before reads "shop.refund_order" after). Backwards, the same.
"""

from __future__ import annotations

from importlib import import_module

import pytest
from django.contrib.auth.models import Group, Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from payments.models import Operation
from payments.shop.models import CreditNote, Invoice, LedgerEntry, Order, SalesDay
from tests.support.users import make_user

#: The release before the move: payments at 0026, no shop migration applied.
BEFORE = [("payments", "0026_drop_claim_reference"), ("shop", None)]
BEFORE_STATE = [("payments", "0026_drop_claim_reference")]
TABLES = [
    "payments_order",
    "payments_invoice",
    "payments_creditnote",
    "payments_ledgerentry",
    "payments_salesday",
]


def schema() -> dict[str, list[tuple[str, ...]]]:
    """The shop tables' columns, indexes and constraints, as PostgreSQL holds them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name, data_type, is_nullable, column_default"
            " FROM information_schema.columns WHERE table_name = ANY(%s) ORDER BY 1, 2",
            [TABLES],
        )
        columns = cursor.fetchall()
        cursor.execute(
            "SELECT tablename, indexname, indexdef FROM pg_indexes"
            " WHERE tablename = ANY(%s) ORDER BY 1, 2",
            [TABLES],
        )
        indexes = cursor.fetchall()
        cursor.execute(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid::regclass::text = ANY(%s) ORDER BY 1, 2",
            [TABLES],
        )
        constraints = cursor.fetchall()
    return {"columns": columns, "indexes": indexes, "constraints": constraints}


def rows() -> dict[str, list[tuple[object, ...]]]:
    """Every row of the shop's tables, read with SQL (no model involved)."""
    found = {}
    with connection.cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"SELECT * FROM {table} ORDER BY id")  # noqa: S608 (names above)
            found[table] = cursor.fetchall()
    return found


def migrate(targets: list[tuple[str, str | None]]) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def migrate_to_head() -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())


def populate_before() -> dict[str, int]:
    """A shop as the release before the move left it, written through that release's models."""
    old = MigrationExecutor(connection).loader.project_state(BEFORE_STATE).apps
    client = old.get_model("payments", "ApiClient").objects.create(name="shop-eu")
    order_model = old.get_model("payments", "Order")
    paid = order_model.objects.create(
        client=client,
        idempotency_key="k-1",
        amount=2500,
        currency="eur",
        status="partially_refunded",
        customer_email="Ann@Example.com",
        refunded_amount=500,
    )
    pending = order_model.objects.create(amount=700, currency="jpy", customer_email="b@example.com")
    old.get_model("payments", "Invoice").objects.create(
        order=paid, number="INV-1", amount=2500, currency="eur", provider_reference="pi_1"
    )
    old.get_model("payments", "CreditNote").objects.create(
        order=paid, number="CN-1", amount=500, currency="eur", provider_reference="re_1"
    )
    old.get_model("payments", "LedgerEntry").objects.create(
        order=paid, amount=2500, currency="eur", provider_reference="pi_1"
    )
    old.get_model("payments", "SalesDay").objects.create(
        day="2026-12-01", currency="eur", orders=1, total=2500
    )
    old.get_model("payments", "Operation").objects.create(
        key="checkout-1",
        client=client,
        kind="checkout",
        entity_type="order",
        entity_id=str(paid.pk),
        params={"order_id": paid.pk},
        fingerprint="x",
        state="succeeded",
    )
    # The grants an operator team had: refunds for a group, order pages for one person.
    order_type, _ = ContentType.objects.get_or_create(app_label="payments", model="order")
    refund, _ = Permission.objects.get_or_create(
        content_type=order_type, codename="refund_order", defaults={"name": "Can refund"}
    )
    view, _ = Permission.objects.get_or_create(
        content_type=order_type, codename="view_order", defaults={"name": "Can view order"}
    )
    return {"paid": paid.pk, "pending": pending.pk, "refund": refund.pk, "view": view.pk}


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__the_shop_moves_to_its_app_with_every_row_index_and_grant():
    migrate(BEFORE)
    # post_migrate of this test database made the shop's content types under `shop`; undone
    # above, they are the release before's again (the migration moves them back).
    before_schema = schema()
    ids = populate_before()
    before_rows = rows()
    refunders = Group.objects.create(name="refunders")
    refunders.permissions.add(ids["refund"])
    rosa = make_user("rosa", "payments.view_operation")
    rosa.user_permissions.add(ids["view"])

    migrate_to_head()

    assert rows() == before_rows
    assert schema() == before_schema
    paid = Order.objects.get(pk=ids["paid"])
    assert (paid.client.name, paid.refunded_amount, paid.customer_email) == (
        "shop-eu",
        500,
        "Ann@Example.com",
    )
    assert Invoice.objects.get(order=paid).number == "INV-1"
    assert CreditNote.objects.get(order=paid).provider_reference == "re_1"
    assert LedgerEntry.objects.filter(order=paid).count() == 1
    assert SalesDay.objects.get(currency="eur").total == 2500
    assert Operation.objects.get(key="checkout-1").entity_id == str(paid.pk)
    # The same permission rows, now the shop's: every grant kept, nothing duplicated.
    shop_order = ContentType.objects.get_for_model(Order)
    assert (shop_order.app_label, shop_order.model) == ("shop", "order")
    assert not ContentType.objects.filter(app_label="payments", model="order").exists()
    assert set(Permission.objects.filter(content_type=shop_order).values_list("pk", flat=True)) >= {
        ids["refund"],
        ids["view"],
    }
    assert list(refunders.permissions.values_list("codename", flat=True)) == ["refund_order"]
    rosa = type(rosa).objects.get(pk=rosa.pk)  # a fresh object: no cached permissions
    assert rosa.has_perm("shop.view_order") and not rosa.has_perm("payments.view_order")
    client = Client()
    client.force_login(rosa)
    page = client.get(f"/admin/shop/order/{paid.pk}/change/")
    assert page.status_code == 200
    assert "Ann@Example.com" in page.content.decode()


@pytest.mark.django_db(transaction=True)
def test_downgrade__the_shop_goes_back_to_payments_with_its_rows_and_grants():
    migrate_to_head()
    order = Order.objects.create(amount=900, currency="eur", customer_email="c@example.com")
    refund = Permission.objects.get(codename="refund_order")
    before_rows = rows()

    migrate(BEFORE)

    assert rows() == before_rows
    assert ContentType.objects.get(pk=refund.content_type_id).app_label == "payments"
    old = MigrationExecutor(connection).loader.project_state(BEFORE_STATE).apps
    assert old.get_model("payments", "Order").objects.get(pk=order.pk).amount == 900
    migrate_to_head()
    assert ContentType.objects.get(pk=refund.content_type_id).app_label == "shop"


def shop_tables() -> set[str]:
    return set(TABLES) & set(connection.introspection.table_names())


@pytest.fixture
def shop_not_installed(monkeypatch):
    """payments 0027 run as in a project without the shop in INSTALLED_APPS."""
    moved = import_module("payments.migrations.0027_shop_models_moved")

    class Installed:
        @staticmethod
        def is_installed(name: str) -> bool:
            return name != "payments.shop"

    monkeypatch.setattr(moved, "installed", Installed)


@pytest.mark.django_db(transaction=True)
def test_a_project_without_the_shop__has_none_of_its_tables(shop_not_installed):
    """A new database: the earlier migrations made the shop's tables, 0027 drops them
    (empty, the shop not installed); adding the shop later (shop 0001) makes them again."""
    migrate(BEFORE)
    assert shop_tables() == set(TABLES)
    made_by_the_earlier_migrations = schema()

    migrate([("payments", "0027_shop_models_moved")])
    assert shop_tables() == set()
    migrate_to_head()  # the shop installed after all: its tables are made, empty

    assert shop_tables() == set(TABLES)
    assert schema() == made_by_the_earlier_migrations
    order = Order.objects.create(amount=100, currency="eur", customer_email="a@example.com")
    Invoice.objects.create(order=order, number="INV-9", amount=100, currency="eur")
    assert Order.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_project_that_left_the_shop_out__keeps_its_tables_with_rows(shop_not_installed):
    migrate(BEFORE)
    populate_before()
    before_rows = rows()

    migrate([("payments", "0027_shop_models_moved")])
    assert shop_tables() == set(TABLES)
    assert rows() == before_rows
    migrate_to_head()
    assert rows() == before_rows


@pytest.mark.django_db(transaction=True)
def test_downgrade__tables_dropped_for_a_project_without_the_shop_are_made_again(
    shop_not_installed,
):
    migrate(BEFORE)
    made_by_the_earlier_migrations = schema()
    migrate([("payments", "0027_shop_models_moved")])
    assert shop_tables() == set()

    migrate(BEFORE)

    assert shop_tables() == set(TABLES)
    assert schema() == made_by_the_earlier_migrations
    old = MigrationExecutor(connection).loader.project_state(BEFORE_STATE).apps
    assert old.get_model("payments", "Order").objects.count() == 0
    migrate_to_head()


@pytest.mark.django_db
def test_an_orders_old_admin_address__moves_to_its_new_one():
    """A bookmark or a ticket's link from before the move (/admin/payments/order/42/change/)."""
    client = Client()
    old = client.get("/admin/payments/order/42/change/?_changelist_filters=status%3Dpaid")
    listing = client.get("/admin/payments/invoice/")
    assert old.status_code == 302
    assert old["Location"] == "/admin/shop/order/42/change/?_changelist_filters=status%3Dpaid"
    assert (listing.status_code, listing["Location"]) == (302, "/admin/shop/invoice/")
    assert client.get("/admin/payments/operation/").status_code == 302  # the login: not moved


@pytest.mark.django_db(transaction=True)
def test_upgrade__a_shop_content_type_made_before_migrate__takes_over_every_grant():
    """A process of the new release read the content type of shop.Order before `migrate`
    ran (ContentType.get_for_model makes it), and post_migrate of an earlier try made its
    permissions: the grants held on payments' permissions move to those, none lost."""
    migrate(BEFORE)
    ids = populate_before()
    refunders = Group.objects.create(name="refunders")
    refunders.permissions.add(ids["refund"])
    rosa = make_user("rosa", "payments.view_operation")
    rosa.user_permissions.add(ids["view"])
    early = ContentType.objects.create(app_label="shop", model="order")
    twin = Permission.objects.create(content_type=early, codename="view_order", name="Can view")

    migrate_to_head()

    # Of the two apps the order's model was in (another test's app may have an "order" too).
    orders = ContentType.objects.filter(model="order", app_label__in=("payments", "shop"))
    assert list(orders.values_list("app_label", flat=True)) == ["shop"]
    rosa = type(rosa).objects.get(pk=rosa.pk)
    assert rosa.has_perm("shop.view_order")
    assert list(rosa.user_permissions.filter(codename="view_order")) == [twin]
    assert list(refunders.permissions.values_list("content_type__app_label", "codename")) == [
        ("shop", "refund_order")
    ]
