"""The checkout's ledger line and sales counter, declared `@message(..., inline=True)`: run
inside mark_paid's transaction, once, with no operation, audit or inbox row of their own;
queued as operations when they fail there or when their writer is not a local step.

tests/conftest.py queues every follow-up for the rest of the suite; these turn the
product's default back on. The crash matrix (tests/kit/test_matrix_crash.py) kills a real
worker around mark_paid's commit with them inline.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from inbox.models import InboxEntry
from payments.checkout import followups
from payments.checkout.names import COUNT_SALE, RECORD_SALE
from payments.exceptions import ConfigurationError
from payments.fence import message
from payments.models import Operation, OperationEvent, OperationState
from payments.shop.entities import write_follow_ups_in_tx
from payments.shop.models import LedgerEntry, SalesDay
from tests.engine.test_indexes import _index_entries_since, _wal_position
from tests.support import flows
from tests.support.workers import run_fence_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def inline(settings):
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": True}


def test_paid_order__ledger_and_counter_commit_with_mark_paid__no_rows_of_their_own(
    provider, queue
):
    order, op = flows.order_and_checkout(key="inl-1")

    run_fence_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert LedgerEntry.objects.filter(order=order).count() == 1
    day = SalesDay.objects.get(currency="eur")
    assert (day.orders, day.total) == (1, order.amount)
    assert not Operation.objects.filter(parent=op).exists()
    assert not InboxEntry.objects.exists()
    assert queue.count == 0


def test_an_inline_follow_up_that_raises__rolls_back_to_its_savepoint__both_are_queued(
    provider, queue, monkeypatch, caplog
):
    """The counter fails once inside mark_paid: the ledger line written before it in the
    savepoint goes too; mark_paid commits; both follow-ups are delivered behind the inbox."""
    real = followups.add_to_sales_day
    calls = []

    def fails_first(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("sales counter down")
        return real(*args, **kwargs)

    monkeypatch.setattr(followups, "add_to_sales_day", fails_first)
    order, op = flows.order_and_checkout(key="inl-2")

    run_fence_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert {fu.kind: fu.state for fu in Operation.objects.filter(parent=op)} == {
        RECORD_SALE: OperationState.SUCCEEDED,
        COUNT_SALE: OperationState.SUCCEEDED,
    }
    assert LedgerEntry.objects.filter(order=order).count() == 1
    assert SalesDay.objects.get(currency="eur").orders == 1
    assert InboxEntry.objects.count() == 2
    assert "queued instead" in caplog.text


def test_a_writer_outside_a_local_step__gets_queued_follow_ups(provider, queue):
    """Only a local step's claim makes its writes once: any other writer's follow-ups keep
    their derived keys, so writing them twice writes them once."""
    order, op = flows.order_and_checkout(key="inl-3")
    for _ in range(2):
        with transaction.atomic():
            write_follow_ups_in_tx(order, "pi_x", parent=op, actor="test")

    assert sorted(Operation.objects.filter(parent=op).values_list("kind", flat=True)) == sorted(
        [RECORD_SALE, COUNT_SALE]
    )
    assert not LedgerEntry.objects.exists()


def test_the_setting_off__queues_them(provider, queue, settings):
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": False}
    order, op = flows.order_and_checkout(key="inl-4")

    run_fence_worker(queue)

    assert Operation.objects.filter(parent=op, state=OperationState.SUCCEEDED).count() == 2
    assert LedgerEntry.objects.filter(order=order).count() == 1


def test_inline_without_an_event__is_refused_at_declaration():
    with pytest.raises(ConfigurationError, match="follows="):
        message("inline_orphan", consumer="nobody", inline=True)


def test_a_checkout_with_inline_follow_ups__writes_48_index_entries_not_84(provider, queue):
    """Worker side, counted in the WAL (tests/engine/test_indexes.py counts the queued
    path's 84): no follow-up operations, audit rows or inbox rows."""
    flows.order_and_checkout(key="inl-5")
    start = _wal_position()
    run_fence_worker(queue)
    entries = _index_entries_since(start)

    assert sum(entries.values()) <= 48, (sum(entries.values()), entries)
    assert entries["payments_operationevent_pkey"] == 8, entries
    assert entries["inbox_entry_consumer_message_uniq"] == 0, entries
    assert OperationEvent.objects.count() == 9  # created, and the 8 above


def test_the_job_s_timeout_inside_an_inline_follow_up__is_raised_not_queued(
    provider, queue, monkeypatch
):
    """An interruption is not a follow-up's failure: no "queued instead", it goes up to the
    worker (which treats the attempt as interrupted)."""
    from rq.timeouts import JobTimeoutException

    from payments.engine.follow_ups import local_step_running

    def times_out(*args, **kwargs):
        raise JobTimeoutException("job timed out")

    monkeypatch.setattr(followups, "add_to_sales_day", times_out)
    order, op = flows.order_and_checkout(key="inl-5")
    with pytest.raises(JobTimeoutException), transaction.atomic(), local_step_running():
        write_follow_ups_in_tx(order, "pi_x", parent=op, actor="test")
    assert not Operation.objects.filter(parent=op).exists()
    assert not LedgerEntry.objects.exists()
