"""Operations created together: their INSERTs in one round trip, each as it would go alone.

`fence.create_operations_in_tx` (and `dispatch.create_and_dispatch_all_in_tx`,
which a paid order's follow-ups use) sends the statements in one psycopg
pipeline inside the caller's transaction. Counted at the connection
(devtools.bench.dbcount). Each test also checks the rows, the audit rows and
what was enqueued.
"""

from __future__ import annotations

import pytest
from django.db import DataError, transaction

from devtools.bench.dbcount import counting
from payments.checkout.names import COUNT_SALE, RECORD_SALE
from payments.engine import fence
from payments.engine.dispatch import create_and_dispatch_all_in_tx
from payments.exceptions import OperationConflict
from payments.models import KeyScope, Operation, OperationEvent, OperationState

pytestmark = pytest.mark.django_db(transaction=True)


def new(key: str, kind: str = RECORD_SALE, **params: object) -> fence.NewOperation:
    return fence.NewOperation(
        key=key,
        kind=kind,
        scope=KeyScope.DERIVED,
        entity_type="order",
        entity_id=7,
        params={"order_id": 7, **params},
        actor="t",
    )


def open_the_transaction() -> None:
    """Send the transaction's BEGIN now, as a worker's earlier statements have (psycopg
    sends it with the first statement, in a round trip of its own)."""
    Operation.objects.exists()


def created_audit(key: str) -> list[tuple[str, str, str]]:
    return list(
        OperationEvent.objects.filter(operation__key=key).values_list(
            "from_state", "to_state", "reason"
        )
    )


def test_two_operations__one_round_trip__each_audited_and_enqueued_after_the_commit(queue):
    with transaction.atomic():
        open_the_transaction()
        with counting() as counter:
            results = create_and_dispatch_all_in_tx([new("a"), new("b", COUNT_SALE)])
        counted = counter.snapshot()
        assert queue.count == 0  # not before the commit

    assert counted.total - counted.prepares == 1, counted
    assert [(op.key, created) for op, created in results] == [("a", True), ("b", True)]
    for op, _ in results:
        row = Operation.objects.get(pk=op.pk)
        assert (row.state, row.job_id) == (OperationState.PENDING, op.job_id)
        assert row.job_id and row.dispatched_at is not None
        assert created_audit(op.key) == [("", OperationState.PENDING, "created")]
    assert sorted(queue.job_ids) == sorted(op.job_id for op, _ in results)


def test_a_key_already_taken_with_the_same_parameters__returned_not_created_nor_enqueued(queue):
    with transaction.atomic():
        ((first, _),) = create_and_dispatch_all_in_tx([new("a")])
    queue.empty()

    with transaction.atomic():
        results = create_and_dispatch_all_in_tx([new("a"), new("b")])

    assert [(op.pk == first.pk, created) for op, created in results] == [
        (True, False),
        (False, True),
    ]
    assert queue.job_ids == [results[1][0].job_id]
    assert created_audit("a") == [("", OperationState.PENDING, "created")]


def test_a_key_taken_with_other_parameters__conflict__nothing_of_the_batch_stays(queue):
    with transaction.atomic():
        create_and_dispatch_all_in_tx([new("b", amount=1)])
    queue.empty()

    with pytest.raises(OperationConflict), transaction.atomic():
        create_and_dispatch_all_in_tx([new("a"), new("b", amount=2)])

    assert not Operation.objects.filter(key="a").exists()
    assert Operation.objects.get(key="b").params["amount"] == 1
    assert queue.count == 0


def test_a_failing_statement_stops_the_pipeline__the_transaction_rolls_back(queue):
    """A key longer than its column fails the first INSERT: the second never runs,
    PostgreSQL's error is raised as Django's, and nothing is written or enqueued."""
    with pytest.raises(DataError), transaction.atomic():
        open_the_transaction()
        with counting() as counter:
            try:
                create_and_dispatch_all_in_tx([new("x" * 300), new("b")])
            finally:
                counted = counter.snapshot()

    assert counted.total - counted.prepares == 1, counted
    assert not Operation.objects.exists()
    assert not OperationEvent.objects.exists()
    assert queue.count == 0


def test_outside_a_transaction__refused(queue):
    with pytest.raises(fence.InvalidTransition):
        fence.create_operations_in_tx([new("a")])


def test_a_conflict_in_a_batch__the_callers_transaction_cannot_commit_any_of_it(queue):
    """The statements after the conflicting one ran in the same pipeline (one by one they
    would not have): the caller's transaction is marked for rollback, even if the caller
    catches the conflict, so no row of the batch stays without its job."""
    with transaction.atomic():
        create_and_dispatch_all_in_tx([new("b", amount=1)])
    queue.empty()

    with transaction.atomic():
        with pytest.raises(OperationConflict):
            create_and_dispatch_all_in_tx([new("a"), new("b", amount=2), new("c")])

    assert sorted(Operation.objects.values_list("key", flat=True)) == ["b"]
    assert queue.count == 0
