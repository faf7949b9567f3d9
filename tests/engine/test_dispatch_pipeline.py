"""Dispatch on commit: the operations one transaction dispatches go to Redis in one pipeline.

Transactional tests: the enqueue happens after a real commit. Redis round
trips are counted at redis-py's connection (every write it sends is followed
by reading its answers: one round trip per `send_packed_command`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from django_rq.queues import get_result_ttl
from redis.connection import AbstractConnection
from rq.job import Job

from inbox.conf import inbox_settings
from payments.checkout.followups import FOLLOW_UPS, write_follow_ups_in_tx
from payments.checkout.names import RECORD_SALE
from payments.conf import payments_settings
from payments.engine import dispatch as dispatch_module
from payments.engine import fence
from payments.engine.dispatch import DELIVER_MESSAGE, dispatch_on_commit, message_id_for
from payments.engine.queues import payments_queue
from payments.models import KeyScope, Operation
from payments.shop.models import Order
from tests.support.flows import checkout

pytestmark = pytest.mark.django_db(transaction=True)


class RoundTrips:
    def __init__(self) -> None:
        self.count = 0


@pytest.fixture
def redis_round_trips(queue, monkeypatch) -> Iterator[RoundTrips]:
    """Count round trips to Redis from here on (the queue's client already connected)."""
    payments_queue().get_redis_server_version()  # connect and cache INFO, as a warm worker has
    trips = RoundTrips()
    original = AbstractConnection.send_packed_command

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        trips.count += 1
        original(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    yield trips


def paid(key: str) -> tuple[Order, Operation]:
    """An order with its checkout operation (enqueued on its commit), not run."""
    parent = checkout(key)
    return Order.objects.get(pk=parent.params["order_id"]), parent


def other_operation(parent: Operation, kind: str = RECORD_SALE, n: int = 0) -> Operation:
    op, _ = fence.create_operation_in_tx(
        key=f"{parent.pk}:extra-{n}",
        scope=KeyScope.DERIVED,
        parent=parent,
        kind=kind,
        entity_type="order",
        entity_id=parent.params["order_id"],
        params={"order_id": parent.params["order_id"], "amount": 1, "currency": "eur"},
        actor="test",
    )
    return op


def test_paid_order__two_follow_ups_in_one_redis_round_trip(queue, redis_round_trips):
    order, parent = paid("pipe-1")
    checkout_job_ids = list(queue.job_ids)
    before = redis_round_trips.count
    with transaction.atomic():
        write_follow_ups_in_tx(order, "pi_pipe", parent=parent, actor="test")
        in_transaction = redis_round_trips.count - before
    assert in_transaction == 0  # nothing leaves before the commit
    assert redis_round_trips.count - before == 1

    follow_ups = [Operation.objects.get(parent=parent, kind=kind) for kind in FOLLOW_UPS]
    assert queue.job_ids == checkout_job_ids + [op.job_id for op in follow_ups]  # in order
    conf = payments_settings()
    for op in follow_ups:
        job = Job.fetch(op.job_id, connection=queue.connection)
        assert op.job_id == message_id_for(op.key, op.scope)
        assert job.func_name == DELIVER_MESSAGE and job.args == (op.pk,)
        assert job.meta["message_id"] == op.job_id
        assert job.meta["consumer"] == queue.name
        assert job.timeout == conf.job_timeout
        assert job.retries_left == conf.max_attempts - 1
        assert job.retry_intervals == list(conf.retry_backoff)
        assert job.description == f"{op.kind} operation {op.pk}"
        assert job.result_ttl == get_result_ttl(queue.name)
        assert job.failure_ttl == int(inbox_settings().redelivery_horizon.total_seconds())


def test_pipelined_job__same_as_the_one_enqueue_writes(queue):
    """The pipeline changes round trips only: the stored job is the one `enqueue` stores."""
    _, parent = paid("pipe-same")
    func, _ = dispatch_module._delivery(parent)
    dispatch_module._enqueue(parent, func, "a" * 32, None)
    dispatch_module._enqueue_together([dispatch_module._Delivery(parent, func, "b" * 32)])
    single, piped = (Job.fetch(i, connection=queue.connection) for i in ("a" * 32, "b" * 32))
    varying = {"created_at", "enqueued_at", "last_heartbeat"}

    def stored(job: Job) -> dict[str, Any]:
        data = {k: v for k, v in job.to_dict().items() if k not in varying}
        data["meta"] = {k: v for k, v in job.meta.items() if k != "message_id"}
        return data

    assert stored(single) == stored(piped)
    assert (single.meta["message_id"], piped.meta["message_id"]) == ("a" * 32, "b" * 32)


def test_dispatch_in_a_rolled_back_savepoint__dropped_with_it_the_others_delivered(
    queue, redis_round_trips
):
    _, parent = paid("pipe-sp")
    with transaction.atomic():
        kept = other_operation(parent, n=1)
        dropped = other_operation(parent, n=2)
        kept_after = other_operation(parent, n=3)
        dispatch_on_commit(kept)
        with pytest.raises(RuntimeError), transaction.atomic():
            dispatch_on_commit(dropped)
            raise RuntimeError("rolled back")
        dispatch_on_commit(kept_after)
    for op in (kept, dropped, kept_after):
        op.refresh_from_db()
    assert dropped.job_id == ""  # its dispatch was rolled back with the savepoint
    assert set(queue.job_ids[-2:]) == {kept.job_id, kept_after.job_id}
    assert dropped.job_id not in queue.job_ids and len(queue.job_ids) == 3


def test_first_dispatch_rolled_back__the_next_one_does_not_join_its_dropped_batch(queue):
    _, parent = paid("pipe-sp2")
    with transaction.atomic():
        dropped, kept = other_operation(parent, n=1), other_operation(parent, n=2)
        with pytest.raises(RuntimeError), transaction.atomic():
            dispatch_on_commit(dropped)
            raise RuntimeError("rolled back")
        dispatch_on_commit(kept)
    kept.refresh_from_db()
    assert queue.job_ids[-1] == kept.job_id and len(queue.job_ids) == 2


def test_other_callbacks_between__order_kept_separate_pipelines(queue, redis_round_trips):
    _, parent = paid("pipe-order")
    seen: list[int] = []
    before = redis_round_trips.count
    with transaction.atomic():
        first, second = other_operation(parent, n=1), other_operation(parent, n=2)
        dispatch_on_commit(first)
        transaction.on_commit(lambda: seen.append(redis_round_trips.count - before))
        dispatch_on_commit(second)
    assert seen == [1]  # the first enqueue ran before the callback, the second after it
    assert redis_round_trips.count - before == 2
    first.refresh_from_db()
    second.refresh_from_db()
    assert queue.job_ids[-2:] == [first.job_id, second.job_id]


def test_outside_a_transaction__enqueued_at_once(queue):
    _, parent = paid("pipe-now")
    with transaction.atomic():
        op = other_operation(parent)
    dispatch_on_commit(op)
    op.refresh_from_db()
    assert queue.job_ids[-1] == op.job_id


@pytest.fixture
def redis_down(settings, caplog):
    """The fence's queue points at a port nobody listens on; dispatch's warnings captured."""
    settings.RQ_QUEUES = {
        **settings.RQ_QUEUES,
        "payments": {**settings.RQ_QUEUES["payments"], "URL": "redis://127.0.0.1:1/0"},
    }
    caplog.set_level(logging.WARNING, logger="payments.engine.dispatch")
    return caplog


def test_redis_down__logged_the_rows_keep_their_job_ids_for_the_sweeper(queue, redis_down):
    _, parent = paid("pipe-down")
    with transaction.atomic():
        a, b = other_operation(parent, n=1), other_operation(parent, n=2)
        dispatch_on_commit(a)
        dispatch_on_commit(b)
    a.refresh_from_db()
    b.refresh_from_db()
    assert a.job_id and b.job_id
    assert f"operations {a.pk} failed" in redis_down.text
    assert f"operations {b.pk} failed" in redis_down.text


def test_redis_down__follow_ups_made_together_logged_together(queue, redis_down):
    order, parent = paid("pipe-down-2")
    with transaction.atomic():
        write_follow_ups_in_tx(order, "pi_down", parent=parent, actor="test")
    follow_ups = [Operation.objects.get(parent=parent, kind=kind) for kind in FOLLOW_UPS]
    assert all(op.job_id for op in follow_ups)
    assert f"operations {', '.join(str(op.pk) for op in follow_ups)} failed" in redis_down.text


def test_the_batch_is_its_own_callback__no_private_list_of_django_read():
    """Issue 40: the enqueue-after-commit batch is registered through `transaction.on_commit`
    once per call that makes deliveries together, never found again in Django's private
    `connection.run_on_commit` (its tuple's shape changed in 4.2 and may again)."""
    source = Path(dispatch_module.__file__).read_text()
    assert "run_on_commit" not in source
    assert "savepoint_ids" not in source


def test_a_redispatched_message_of_a_tenant__its_id_names_the_tenant_in_one_read(
    queue, django_assert_num_queries
):
    """The sweeper's and a retry's dispatch(id) read the row once (key, kind, scope and
    tenant): the message id names the tenant without a second query for it."""
    _, parent = paid("pipe-tenant")
    with transaction.atomic():
        op, _ = fence.create_operation_in_tx(
            key="pipe-tenant-message", kind=RECORD_SALE, entity_type="order",
            entity_id=parent.params["order_id"], params={}, actor="test", tenant="hotel:1",
        )  # fmt: skip

    with django_assert_num_queries(2):  # the row, then the job id recorded
        job_id = dispatch_module.dispatch(op.pk)

    assert job_id == message_id_for(op.key, op.scope, "hotel:1") != message_id_for(op.key)
