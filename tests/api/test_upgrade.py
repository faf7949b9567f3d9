"""Upgrading to per-client keys, then per-tenant keys, keeps every earlier Idempotency-Key
replayable."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module
from io import StringIO

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from payments.engine.fence import derive_idempotency_key, fingerprint
from payments.engine.writes import fence_writes
from payments.exceptions import OperationConflict
from payments.fence import create_operation_in_tx
from payments.models import OPERATION_KEY_CONSTRAINT, ApiClient, ClientApiKey, Operation
from payments.shop.models import Order

TOKEN = "upgrade-token-that-is-long-enough-0123456789"
BEFORE = [("payments", "0007_provider_events")]
AFTER = [("payments", "0008_bootstrap_client_keys")]


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__an_operation_from_before_api_clients_replays_for_the_bootstrap_token(
    settings, queue
):
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    order = old.get_model("payments", "Order").objects.create(
        amount=1000, currency="eur", customer_email="u@example.com", status="processing"
    )
    old.get_model("payments", "Operation").objects.create(
        key="before-upgrade",
        scope="client",
        kind="checkout",
        entity_type="order",
        entity_id=str(order.pk),
        params={
            "order_id": order.pk,
            "amount": 1000,
            "currency": "eur",
            "payment_method": "pm_card_visa",
        },
        fingerprint="computed-below",
    )
    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    executor.loader.build_graph()
    MigrationExecutor(connection).migrate(executor.loader.graph.leaf_nodes())

    op = Operation.objects.get(key="before-upgrade")
    assert ApiClient.of_tenant(op.tenant).name == "bootstrap"
    with fence_writes():  # hand-made state: the fingerprint the old release would have stored
        Operation.objects.filter(pk=op.pk).update(
            fingerprint=fingerprint("checkout", "order", str(order.pk), op.params)
        )
    settings.API_TOKEN = TOKEN
    answer = Client(headers={"Authorization": f"Bearer {TOKEN}"}).post(
        f"/api/orders/{order.pk}/checkout",
        data=json.dumps({"payment_method": "pm_card_visa"}),
        content_type="application/json",
        headers={"Idempotency-Key": "before-upgrade"},
    )
    assert answer.status_code == 202, answer.content
    assert answer["Idempotent-Replayed"] == "true"
    assert Operation.objects.filter(key="before-upgrade").count() == 1


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__orders_from_before_0012_belong_to_the_bootstrap_client(settings):
    executor = MigrationExecutor(connection)
    executor.migrate([("payments", "0011_claim_last_request")])
    old = executor.loader.project_state([("payments", "0011_claim_last_request")]).apps
    old_order = old.get_model("payments", "Order")
    ids = [
        old_order.objects.create(amount=100 + i, currency="eur", customer_email="u@example.com").pk
        for i in range(3)
    ]
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    owners = set(Order.objects.filter(pk__in=ids).values_list("client__name", flat=True))
    assert owners == {"bootstrap"}
    settings.API_TOKEN = TOKEN
    bootstrap = Client(headers={"Authorization": f"Bearer {TOKEN}"})
    assert bootstrap.get(f"/api/orders/{ids[0]}").status_code == 200


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__an_order_keeps_the_client_of_its_first_operation(settings, monkeypatch):
    """A client from before 0012 (clients exist since 0006) keeps reaching its orders."""
    monkeypatch.setattr(import_module("payments.migrations.0013_order_owner_backfill"), "BATCH", 2)
    executor = MigrationExecutor(connection)
    executor.migrate([("payments", "0011_claim_last_request")])
    old = executor.loader.project_state([("payments", "0011_claim_last_request")]).apps
    old_order, old_operation = (
        old.get_model("payments", "Order"),
        old.get_model("payments", "Operation"),
    )
    shop = old.get_model("payments", "ApiClient").objects.create(name="shop-eu")
    orders = [
        old_order.objects.create(amount=100 + i, currency="eur", customer_email="u@example.com")
        for i in range(5)
    ]
    for key, order, client in [
        ("token-checkout", orders[1], None),  # API_TOKEN's path: the bootstrap client's
        ("shop-checkout", orders[3], shop),
        ("shop-refund", orders[4], shop),
    ]:
        old_operation.objects.create(
            key=key,
            scope="client",
            client=client,
            kind=key.partition("-")[2],
            entity_type="order",
            entity_id=str(order.pk),
            params={},
            fingerprint="x",
            state="succeeded",
        )
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    owners = dict(
        Order.objects.filter(pk__in=[o.pk for o in orders]).values_list("pk", "client__name")
    )
    assert [owners[o.pk] for o in orders] == ["bootstrap", "bootstrap", "bootstrap"] + [
        "shop-eu"
    ] * 2
    _, key = ClientApiKey.objects.create_key(name="k", client=ApiClient.objects.get(name="shop-eu"))
    shop_api = Client(headers={"Authorization": f"Bearer {key}"})
    assert shop_api.get(f"/api/orders/{orders[3].pk}").status_code == 200
    assert shop_api.get(f"/api/orders/{orders[0].pk}").status_code == 404


@pytest.mark.django_db  # sqlmigrate reads the applied migrations
def test_upgrade__0012_changes_payments_order_under_a_lock_timeout():
    """Its ALTER TABLEs fail fast behind a long transaction instead of queueing every order."""
    out = StringIO()
    call_command("sqlmigrate", "payments", "0012_order_client", stdout=out)
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("--")]
    alters = [i for i, line in enumerate(lines) if line.startswith("ALTER TABLE")]
    sets = [i for i, line in enumerate(lines) if line.startswith("SET lock_timeout")]
    resets = [i for i, line in enumerate(lines) if line.startswith("RESET lock_timeout")]
    assert alters and sets and resets, lines
    assert sets[0] < alters[0] and alters[-1] < resets[0]


# --- 0028: an operation's key namespace becomes a tenant --------------------------------------

BEFORE_TENANT = [("payments", "0027_shop_models_moved")]

#: The previous release's INSERT (payments/engine/sql/queries.sql before 0028): it names
#: client_id, not tenant, and its ON CONFLICT names the key constraint.
PREVIOUS_RELEASE_INSERT = """
INSERT INTO payments_operation (key, scope, client_id, kind, entity_type, entity_id, params,
    fingerprint, state, attempts, last_error, lease_owner, job_id, created_at, updated_at)
VALUES (%s, 'client', %s, 'checkout', 'order', '1', '{}', 'fp', 'pending', 0, '', '', '',
    now(), now())
ON CONFLICT ON CONSTRAINT payments_operation_client_scope_key_uniq DO NOTHING
RETURNING id, tenant
"""


def previous_release_derivation(key: str, step: str, client_id: int) -> str:
    """The provider idempotency key 0027's release derived for a client's step."""
    digest = hashlib.sha256(f"client:{client_id}\x1d{key}\x1f{step}".encode()).hexdigest()
    return f"fence_{digest[:48]}"


def migrate_to(target: list[tuple[str, str]] | None = None) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target or executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__0028_every_clients_operation_gets_its_tenant_and_keeps_its_keys(monkeypatch):
    """Rows written by 0027's release get "client:<id>" in batches (2 here); each step's
    provider idempotency key derives exactly as before, the API still finds each client's
    own operations by key, and the migration rolls back and forward again."""
    monkeypatch.setattr(import_module("payments.migrations.0028_operation_tenant"), "BATCH", 2)
    migrate_to(BEFORE_TENANT)
    old = MigrationExecutor(connection).loader.project_state(BEFORE_TENANT).apps
    old_client, old_operation = (
        old.get_model("payments", "ApiClient"),
        old.get_model("payments", "Operation"),
    )
    shops = [old_client.objects.create(name=f"shop-{i}") for i in range(2)]
    rows = [("k-1", shops[0]), ("k-2", shops[0]), ("k-1", shops[1]), ("k-1", None), ("k-3", None)]
    for i, (key, client) in enumerate(rows):
        old_operation.objects.create(
            key=key, scope="client", client=client, kind="checkout", entity_type="order",
            entity_id=str(i), params={}, fingerprint="x", state="succeeded",
        )  # fmt: skip

    migrate_to()

    tenants = sorted(Operation.objects.values_list("key", "tenant"))
    assert tenants == sorted((key, f"client:{client.pk}" if client else "") for key, client in rows)
    op = Operation.objects.get(key="k-1", tenant=f"client:{shops[1].pk}")
    assert derive_idempotency_key(op.key, "charge", op.scope, op.tenant) == (
        previous_release_derivation("k-1", "charge", shops[1].pk)
    )
    _, key = ClientApiKey.objects.create_key(name="k", client=ApiClient.objects.get(pk=shops[1].pk))
    api = Client(headers={"Authorization": f"Bearer {key}"})
    assert api.get("/api/operations/k-1").json()["entity"]["id"] == op.entity_id == "2"
    assert api.get("/api/operations/k-2").status_code == 404  # shop-0's

    migrate_to(BEFORE_TENANT)  # rolled back: each row still has its client
    old = MigrationExecutor(connection).loader.project_state(BEFORE_TENANT).apps
    back = old.get_model("payments", "Operation").objects.values_list("key", "client_id")
    assert sorted(back, key=str) == sorted(((k, c.pk if c else None) for k, c in rows), key=str)
    migrate_to()
    assert sorted(Operation.objects.values_list("key", "tenant")) == tenants


@pytest.mark.django_db
def test_upgrade__0028_the_previous_release_writing_beside_this_one__one_namespace_per_client():
    """While both releases serve: the previous one's INSERT (client_id, no tenant) gets the
    client's tenant; its key then meets this release's (a conflict, not a second
    operation) and the other way round; this release's rows keep a client_id, which the
    previous release finds its client's operations by."""
    shop = ApiClient.objects.create(name="shop-old")
    with connection.cursor() as cursor:
        cursor.execute(PREVIOUS_RELEASE_INSERT, ["old-key", shop.pk])
        ((_, tenant),) = cursor.fetchall()
        cursor.execute(PREVIOUS_RELEASE_INSERT, ["old-key", shop.pk])
        assert cursor.fetchall() == []  # the same client's key: one operation
    assert tenant == shop.tenant == f"client:{shop.pk}"
    with pytest.raises(OperationConflict), transaction.atomic():
        create_operation_in_tx(
            key="old-key", kind="checkout", entity_type="order", entity_id="2",
            params={}, actor="t", tenant=shop.tenant,
        )  # fmt: skip
    with transaction.atomic():
        new, _ = create_operation_in_tx(
            key="new-key", kind="checkout", entity_type="order", entity_id="3",
            params={}, actor="t", tenant=shop.tenant,
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("SELECT client_id FROM payments_operation WHERE id = %s", [new.pk])
        assert cursor.fetchone() == (shop.pk,)
        cursor.execute(PREVIOUS_RELEASE_INSERT, ["new-key", shop.pk])
        assert cursor.fetchall() == []


TENANT_MIGRATION = "payments.migrations.0028_operation_tenant"


def key_constraint() -> str:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = %s",
            [OPERATION_KEY_CONSTRAINT],
        )
        return cursor.fetchone()[0]


def deposit_row(key: str, tenant: str) -> None:
    """An operation row written in SQL (no job enqueued), under `tenant`."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO payments_operation (key, scope, tenant, kind, entity_type, "
            "entity_id, params, fingerprint, state, attempts, last_error, lease_owner, "
            "job_id, created_at, updated_at) VALUES (%s, 'client', %s, 'x', 'b', "
            "'7', '{}', 'fp', 'succeeded', 0, '', '', '', now(), now())",
            [key, tenant],
        )


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__0028_stopped_halfway__migrate_again_finishes_it():
    """A run stopped after its first steps committed (the column added, the trigger made,
    one row filled, the index's concurrent build interrupted and left INVALID) is
    finished by running migrate again: before, the second run failed at once on
    'column "tenant" already exists'."""
    step = import_module(TENANT_MIGRATION)
    migrate_to(BEFORE_TENANT)
    old = MigrationExecutor(connection).loader.project_state(BEFORE_TENANT).apps
    shop = old.get_model("payments", "ApiClient").objects.create(name="shop-half")
    for key in ("h-1", "h-2", "h-3"):
        old.get_model("payments", "Operation").objects.create(
            key=key, scope="client", client=shop, kind="checkout", entity_type="order",
            entity_id="1", params={}, fingerprint="x", state="succeeded",
        )  # fmt: skip
    with connection.cursor() as cursor:
        for sql in (step.ADD_TENANT, step.DROP_CLIENT_FOREIGN_KEY, step.CREATE_BRIDGE):
            cursor.execute(sql)
        cursor.execute(f"UPDATE {step.TABLE} SET tenant = 'client:' || client_id WHERE key = 'h-1'")
        cursor.execute(f"CREATE UNIQUE INDEX {step.INDEX} ON {step.TABLE} (tenant, scope, key)")
        cursor.execute(  # as a CREATE INDEX CONCURRENTLY killed halfway leaves it
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass", [step.INDEX]
        )

    migrate_to()

    assert set(Operation.objects.values_list("tenant", flat=True)) == {f"client:{shop.pk}"}
    assert key_constraint() == "UNIQUE (tenant, scope, key)"


@contextmanager
def long_reader(table: str, seconds: float = 1.0) -> Iterator[None]:
    """Another connection holding `table` in ACCESS SHARE mode for `seconds` (a long
    report, say), then ending its transaction: what waits for it behind a lock timeout
    (DROP INDEX CONCURRENTLY waits for every transaction that may use the index) goes on."""
    settings = connection.settings_dict
    holder = psycopg.connect(
        host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432,
        user=settings["USER"] or "postgres", dbname=settings["NAME"],
    )  # fmt: skip
    holder.execute(f"LOCK TABLE {table} IN ACCESS SHARE MODE")
    ends = threading.Timer(seconds, holder.close)
    ends.start()
    try:
        yield
    finally:
        ends.cancel()
        holder.close()


def old_index_exists(step) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [step.OLD_INDEX])
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)  # the lock is held by another connection
def test_upgrade__0028_the_swap_back_not_locked_in_time__nothing_changed_no_index_left(
    monkeypatch,
):
    """The swap back waits LOCK_TIMEOUT for its lock, then rolls back whole, names what to
    do, and drops the old index it built: left behind, that unique index over
    (client_id, scope, key) would refuse two hotels' equal keys (both client_id NULL)
    on this release, which ON CONFLICT ON CONSTRAINT does not cover."""
    step = import_module(TENANT_MIGRATION)
    monkeypatch.setattr(step, "LOCK_TIMEOUT", "100ms")
    with connection.schema_editor(atomic=False) as editor:
        step.build_old_index(None, editor)
        assert old_index_exists(step)
        with (
            long_reader(step.TABLE),
            pytest.raises(RuntimeError, match="not locked within 100ms.*Run migrate again"),
        ):
            step.unswap(None, editor)

    assert key_constraint() == "UNIQUE (tenant, scope, key)"
    assert not old_index_exists(step)
    for tenant in ("hotel:1", "hotel:2"):  # the connection usable, two tenants' keys apart
        deposit_row("booking-7", tenant)


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__0028_the_way_back_stopped_at_its_last_step__migrate_back_again_finishes(
    monkeypatch,
):
    """Back to 0027 stopped after the swap back (the column's drop not locked in time):
    running it again skips what is done and finishes; before, it failed for good on the
    foreign key it had already restored."""
    step = import_module(TENANT_MIGRATION)
    shop = ApiClient.objects.create(name="shop-back")
    deposit_row("back-1", shop.tenant)
    with connection.schema_editor(atomic=False) as editor:
        step.build_old_index(None, editor)
        step.unswap(None, editor)
        monkeypatch.setattr(step, "LOCK_TIMEOUT", "100ms")
        with long_reader(step.TABLE), pytest.raises(RuntimeError, match="Run migrate again"):
            step.back_to_client_ids(None, editor)
    monkeypatch.setattr(step, "LOCK_TIMEOUT", "5s")

    migrate_to(BEFORE_TENANT)

    old = MigrationExecutor(connection).loader.project_state(BEFORE_TENANT).apps
    rows = old.get_model("payments", "Operation").objects.values_list("key", "client_id")
    assert list(rows) == [("back-1", shop.pk)]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass "
            "AND contype = 'f' AND pg_get_constraintdef(oid) LIKE 'FOREIGN KEY (client_id)%%'",
            [step.TABLE],
        )
        assert len(cursor.fetchall()) == 1
    migrate_to()
    assert list(Operation.objects.values_list("key", "tenant")) == [("back-1", shop.tenant)]


@pytest.mark.django_db(transaction=True)  # migrations run outside the test's transaction
def test_upgrade__0028_back_to_0027_with_a_projects_own_tenant__refused_nothing_changed():
    """0027 keys operations by API client alone: two hotels' "booking-7" would be one
    key there (the old constraint could not even be built). The way back is refused
    first, naming why, and the schema stays this release's."""
    for tenant in ("hotel:1", "hotel:2"):
        deposit_row("booking-7", tenant)

    with pytest.raises(RuntimeError, match=r"nothing changed: 2 operation\(s\).*'hotel:1'"):
        migrate_to(BEFORE_TENANT)

    assert key_constraint() == "UNIQUE (tenant, scope, key)"
    assert sorted(Operation.objects.values_list("tenant", flat=True)) == ["hotel:1", "hotel:2"]
    applied = MigrationExecutor(connection).loader.applied_migrations
    assert ("payments", "0028_operation_tenant") in applied
    # The migrations after 0028 were unapplied before its refusal (backwards, in order):
    # the tests after this one, in this process, need the schema at the leaf again.
    migrate_to()
