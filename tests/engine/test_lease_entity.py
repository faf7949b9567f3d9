"""A handler's entity (`@handler(entity=Model)`) is read in the lease's round trip.

The worker's lease statement and the entity's read go in one pipeline, one implicit
transaction (the read sees the lease); the handler gets the row as `run.entity`. A read
that fails never stops a lease: the lease is taken alone and the handler reads its entity.
"""

from __future__ import annotations

import pytest
from django.db import connection, models, transaction

from devtools.bench.dbcount import counting
from payments.checkout.handler import request_checkout
from payments.checkout.names import CHECKOUT
from payments.checkout.orders import create_order
from payments.engine import fence, runtime
from payments.engine.handlers import Run, entity_models, get_handler, handler
from payments.exceptions import ConfigurationError
from payments.models import ApiClient, Operation, OperationState, StepClaim
from payments.shop.models import Order

pytestmark = pytest.mark.django_db(transaction=True)


def pending_checkout(key: str) -> Operation:
    order = create_order(amount=1200, currency="eur", email="e@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    return op


def test_the_checkout_declares_its_order__read_with_the_lease_in_one_round_trip():
    op = pending_checkout("ent-1")
    assert get_handler(op.kind).entity is Order and Order in entity_models()

    with counting() as counter:
        leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30, entities=(Order,))
    counted = counter.snapshot()

    assert leased.acquired
    assert counted.total - counted.prepares == 1 and counted.syncs == 1
    order = leased.entities[Order]
    assert isinstance(order, Order) and order.pk == op.params["order_id"]
    assert order.customer_email == "e@example.com" and order.amount == 1200
    op.refresh_from_db()
    assert (op.state, op.lease_owner) == (OperationState.RUNNING, "w/1")


def test_run_entity__the_row_read_with_the_lease__no_further_query(django_assert_num_queries):
    op = pending_checkout("ent-2")
    leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30, entities=(Order,))
    run = Run(
        leased.operation, "w/1", get_handler(op.kind), prefetched_entity=leased.entities[Order]
    )
    with django_assert_num_queries(0):
        assert run.entity is leased.entities[Order]


def test_run_entity__not_read_with_the_lease__read_on_first_use():
    op = pending_checkout("ent-3")
    run = Run(op, "w/1", get_handler(op.kind))
    assert run.entity.pk == op.params["order_id"]


def checkout_of(key: str, entity_type: str, entity_id: str) -> Operation:
    """A checkout operation written with another entity than its order (a caller's bug)."""
    with transaction.atomic():
        op, _ = fence.create_operation_in_tx(
            key=key,
            kind=CHECKOUT,
            entity_type=entity_type,
            entity_id=entity_id,
            params={"order_id": 1},
            actor="t",
        )
    return op


def test_an_operation_whose_entity_is_of_another_type__nothing_read__refused():
    client = ApiClient.objects.create(name="ent-client")
    op = checkout_of("ent-4", "apiclient", str(client.pk))
    leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30, entities=(Order,))
    assert leased.acquired and leased.entities == {Order: None}
    run = Run(leased.operation, "w/1", get_handler(op.kind))
    with pytest.raises(ConfigurationError, match="not a 'order'"):
        _ = run.entity


def test_a_non_numeric_entity_id__nothing_read__the_lease_taken():
    op = checkout_of("ent-5", "order", "not-a-number")
    leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30, entities=(Order,))
    assert leased.acquired and leased.entities == {Order: None}


def test_a_lease_not_taken__no_entity():
    op = pending_checkout("ent-6")
    fence.acquire_lease(op.pk, owner="w/1", seconds=30)
    other = fence.acquire_lease(op.pk, owner="w/2", seconds=30, entities=(Order,))
    assert not other.acquired and other.entities == {}


def test_a_handler_without_entity__run_entity_refused():
    op = pending_checkout("ent-7")
    spec = get_handler(op.kind)
    run = Run(op, "w/1", type(spec)(kind=spec.kind, func=spec.func))
    with pytest.raises(ConfigurationError, match="declares no entity"):
        _ = run.entity


class Booking(models.Model):  # noqa: DJ008
    """An entity keyed by a UUID (a project's own model)."""

    id = models.UUIDField(primary_key=True)
    guest = models.CharField(max_length=40)

    class Meta:
        app_label = "payments"
        managed = False
        db_table = "test_entity_booking"


class Room(models.Model):  # noqa: DJ008
    """An entity keyed by text."""

    code = models.CharField(max_length=12, primary_key=True)
    floor = models.IntegerField()

    class Meta:
        app_label = "payments"
        managed = False
        db_table = "test_entity_room"


@pytest.fixture
def keyed_tables():
    """Booking's and Room's tables, for this test only."""
    with connection.schema_editor() as editor:
        editor.create_model(Booking)
        editor.create_model(Room)
    yield
    with connection.schema_editor() as editor:
        editor.delete_model(Booking)
        editor.delete_model(Room)


@pytest.mark.parametrize(
    "model, row, other",
    [
        (Booking, {"id": "7d1c8e0e-3f4a-4b8e-9a55-2b0d6f1c9e01", "guest": "Ada"}, "not-a-uuid"),
        (Room, {"code": "B-204", "floor": 2}, "C-999"),
    ],
    ids=["uuid", "text"],
)
def test_an_entity_keyed_by_a_uuid_or_text__read_with_the_lease(keyed_tables, model, row, other):
    """read_entity casts entity_id to the key's own type; a text that is no key of that
    type (or no row) reads nothing and the lease is still taken."""
    entity = model.objects.create(**row)
    name = model._meta.model_name
    found = checkout_of(f"ent-{name}", name, str(entity.pk))
    missing = checkout_of(f"ent-{name}-other", name, other)

    leased = fence.acquire_lease(found.pk, owner="w/1", seconds=30, entities=(model,))
    assert leased.acquired and str(leased.entities[model].pk) == str(entity.pk)
    assert fence.entity_key_kind(model) == ("uuid" if model is Booking else "text")
    leased = fence.acquire_lease(missing.pk, owner="w/1", seconds=30, entities=(model,))
    assert leased.acquired and leased.entities == {model: None}


def test_an_entity_keyed_by_a_uuid_or_text__accepted_at_registration(monkeypatch):
    from payments.engine import handlers

    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    handler("booking-deposit", entity=Booking)(lambda run: None)
    handler("room-deposit", entity=Room)(lambda run: None)
    assert {Booking, Room} <= set(entity_models())


def test_an_entity_whose_key_cannot_be_an_entitys__refused_at_registration():
    class Dated(models.Model):  # noqa: DJ008
        day = models.DateField(primary_key=True)

        class Meta:
            app_label = "payments"
            managed = False

    class Long(models.Model):  # noqa: DJ008
        code = models.CharField(max_length=100, primary_key=True)

        class Meta:
            app_label = "payments"
            managed = False

    with pytest.raises(ConfigurationError, match="handler 'dated-thing'.*integer, UUID or text"):
        handler("dated-thing", entity=Dated)
    with pytest.raises(ConfigurationError, match="max_length=64 or less"):
        handler("long-thing", entity=Long)


class Missing(models.Model):  # noqa: DJ008
    """An entity model whose table is not there (a deploy ahead of its migration)."""

    class Meta:
        app_label = "payments"
        managed = False
        db_table = "payments_not_migrated_yet"


class Reserved(models.Model):  # noqa: DJ008
    """An entity model whose table name is a reserved word."""

    class Meta:
        app_label = "payments"
        managed = False
        db_table = "order"


def test_a_read_that_fails__the_lease_taken_alone__logged(caplog):
    op = pending_checkout("ent-8")
    leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30, entities=(Missing, Order))
    assert leased.acquired and leased.entities == {}
    assert "taking the lease alone" in caplog.text
    op.refresh_from_db()
    assert (op.state, op.lease_owner) == (OperationState.RUNNING, "w/1")
    run = Run(leased.operation, "w/1", get_handler(op.kind))
    assert run.entity.pk == op.params["order_id"]  # read by the run itself


def test_table_and_key_names_quoted():
    with connection.cursor() as cursor:
        cursor.execute('CREATE TABLE "order" (id bigint PRIMARY KEY)')
    try:
        with connection.cursor() as cursor:
            cursor.execute('INSERT INTO "order" (id) VALUES (%s)', [7])
        op = checkout_of("ent-9", "reserved", "7")
        leased = fence.acquire_lease(op.pk, owner="w/1", seconds=30, entities=(Reserved,))
        assert leased.entities[Reserved].pk == 7
    finally:
        with connection.cursor() as cursor:
            cursor.execute('DROP TABLE "order"')


def test_an_operation_whose_entity_is_not_the_handlers__needs_review_not_run(provider):
    client = ApiClient.objects.create(name="ent-client-2")
    op = checkout_of("ent-10", "apiclient", str(client.pk))
    assert runtime.execute(op.pk, worker_id="w/1") == "needs_review"
    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW and "not a 'order'" in op.last_error
    assert not StepClaim.objects.filter(operation=op).exists()  # nothing charged


def test_run_entity__no_such_row_or_not_a_key__does_not_exist():
    op = checkout_of("ent-11", "order", "999999")
    with pytest.raises(Order.DoesNotExist):
        _ = Run(op, "w/1", get_handler(op.kind)).entity
    with pytest.raises(Order.DoesNotExist):
        _ = Run(op, "w/1", get_handler(op.kind), prefetched_entity=None).entity
    odd = checkout_of("ent-12", "order", "not-a-number")
    with pytest.raises(Order.DoesNotExist):
        _ = Run(odd, "w/1", get_handler(odd.kind)).entity
