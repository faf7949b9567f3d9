"""driver.savepoints_with_next_statement: a nested atomic block's SAVEPOINT goes with its
first statement and its RELEASE is never sent; what the block means does not change.

The inline follow-ups (payments.engine.dispatch.create_follow_ups_in_tx) run in such a
block inside mark_paid's transaction. Each test runs on Django's backend and on the
opt-in project.postgresql (`backend`), and counts round trips at the connection
(devtools.bench.dbcount, checked against a libpq trace in tests/devtools/).
"""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, transaction

from devtools.bench.dbcount import counting
from payments.engine.driver import savepoints_with_next_statement
from payments.shop.models import LedgerEntry, Order

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("backend")]


@pytest.fixture
def order() -> Order:
    return Order.objects.create(amount=100, currency="eur", customer_email="a@example.com")


def _line(order: Order, reference: str) -> LedgerEntry:
    return LedgerEntry.objects.create(
        order=order, amount=1, currency="eur", provider_reference=reference
    )


def _fails() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 / %s", [0])  # division by zero: a DatabaseError


def test_two_writes__two_round_trips__the_savepoint_rides_the_first(order):
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)  # PostgreSQL's BEGIN is sent
        with counting() as counter:
            with savepoints_with_next_statement(), transaction.atomic():
                _line(order, "one")
                Order.objects.filter(pk=order.pk).update(amount=102)
        counts = counter.snapshot()
    # Before: SAVEPOINT, INSERT, UPDATE, RELEASE, four round trips.
    assert (counts.total, counts.savepoints, counts.syncs) == (2, 1, 1)
    order.refresh_from_db()
    assert order.amount == 102 and LedgerEntry.objects.filter(order=order).count() == 1


def test_a_block_that_sends_nothing__sends_no_savepoint(order):
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with counting() as counter:
            with pytest.raises(RuntimeError):
                with savepoints_with_next_statement(), transaction.atomic():
                    raise RuntimeError("before any statement")
            with savepoints_with_next_statement(), transaction.atomic():
                pass
        assert counter.snapshot().total == 0
        Order.objects.filter(pk=order.pk).update(amount=103)  # the transaction goes on
    order.refresh_from_db()
    assert order.amount == 103


@pytest.mark.parametrize("lines_before", [0, 1], ids=["first statement", "later statement"])
def test_a_statement_that_fails__undoes_the_block_alone(order, lines_before):
    """Failing first, it went in one pipeline with the savepoint: rolled back to it all
    the same. Failing later, the block's earlier writes go with it."""
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with pytest.raises(DatabaseError):
            with savepoints_with_next_statement(), transaction.atomic():
                for _ in range(lines_before):
                    _line(order, "undone")
                _fails()
        _line(order, "kept")  # the transaction is usable: rolled back to the savepoint
    order.refresh_from_db()
    assert order.amount == 101
    assert list(LedgerEntry.objects.values_list("provider_reference", flat=True)) == ["kept"]


def test_a_block_nested_in_it__rolled_back__leaves_the_outer_block_s_writes(order):
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with savepoints_with_next_statement(), transaction.atomic():
            _line(order, "outer")
            with pytest.raises(DatabaseError), transaction.atomic():
                _line(order, "inner")
                _fails()
            with pytest.raises(RuntimeError), transaction.atomic():
                raise RuntimeError("an inner block that sent nothing")
            _line(order, "outer again")
    assert sorted(LedgerEntry.objects.values_list("provider_reference", flat=True)) == [
        "outer",
        "outer again",
    ]


def test_its_release_never_sent__the_transaction_s_rollback_still_takes_the_block(order):
    """What follows the block runs inside its savepoint, which PostgreSQL keeps until the
    transaction ends: a failure after it rolls back everything, the block's writes too."""
    with pytest.raises(DatabaseError), transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with savepoints_with_next_statement(), transaction.atomic():
            _line(order, "block")
        _fails()
    order.refresh_from_db()
    assert order.amount == 100 and not LedgerEntry.objects.exists()


def test_outside_a_begun_transaction__the_savepoint_goes_as_django_sends_it(order):
    """The block's SAVEPOINT would be the transaction's first statement: sent as it is."""
    with transaction.atomic():
        with savepoints_with_next_statement(), transaction.atomic():
            _line(order, "first")
        with pytest.raises(DatabaseError):
            with savepoints_with_next_statement(), transaction.atomic():
                _fails()
    assert LedgerEntry.objects.count() == 1


def test_an_error_caught_inside_the_block__still_fails_the_block(order):
    """A statement's error caught in the block without an atomic() of its own leaves the
    transaction aborted: Django's RELEASE is what finds that (it fails, Django rolls back
    to the savepoint and raises), so in an aborted transaction it is sent."""
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with pytest.raises(DatabaseError):
            with savepoints_with_next_statement(), transaction.atomic():
                _line(order, "undone")
                try:
                    _fails()
                except DatabaseError:
                    pass  # the handler's mistake: the transaction is aborted
        _line(order, "after")  # usable again: rolled back to the savepoint
    order.refresh_from_db()
    assert order.amount == 101
    assert list(LedgerEntry.objects.values_list("provider_reference", flat=True)) == ["after"]


def test_a_first_statement_a_pipeline_refuses__gets_the_savepoint_before_it(order):
    """A server-side cursor (QuerySet.iterator() in a transaction) and text without
    parameters (several commands) cannot go in a pipeline: the savepoint goes first."""
    table = Order._meta.db_table
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with savepoints_with_next_statement(), transaction.atomic():
            assert [one.pk for one in Order.objects.all().iterator(chunk_size=10)] == [order.pk]
        with pytest.raises(DatabaseError):
            with savepoints_with_next_statement(), transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"UPDATE {table} SET amount = 104; UPDATE {table} SET amount = 105"
                    )
                _fails()
    order.refresh_from_db()
    assert order.amount == 101  # both UPDATEs rolled back to the savepoint sent before them


def test_in_a_pipeline_the_caller_opened__the_savepoint_rides_it(order):
    with transaction.atomic():
        Order.objects.filter(pk=order.pk).update(amount=101)
        with savepoints_with_next_statement(), transaction.atomic():
            with connection.connection.pipeline():
                _line(order, "kept")
        with pytest.raises(DatabaseError):
            with savepoints_with_next_statement(), transaction.atomic():
                with connection.connection.pipeline():
                    Order.objects.filter(pk=order.pk).update(amount=102)
                _fails()
    order.refresh_from_db()
    assert order.amount == 101  # the second block's write rolled back to its savepoint
    assert list(LedgerEntry.objects.values_list("provider_reference", flat=True)) == ["kept"]
