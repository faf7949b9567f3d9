"""payments.testing's crash matrix on the shop's checkout: a real worker SIGKILLed at every
fence point of every step (and after its final commit), restarted, beside the recovery
loop; each redelivery charges once, invoices once, and the checkout succeeds. The
workers run the product's default: the ledger line and the sales counter inline, in
mark_paid's transaction (tests elsewhere queue them: tests/conftest.py), so a kill
around that commit must leave each order in the ledger and on the counter once.

This is the kit a handler author runs on their own operation (docs/testing.md): the test
is written only with what payments.testing offers, plus the fake provider's record.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis
from rq.worker import Worker

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.models import Operation
from payments.shop.models import Invoice, LedgerEntry, SalesDay
from payments.testing import _refuse_other_workers, crash_matrix, crash_points, stop_process
from tests.support.workers import worker_env

# Transactional: the matrix's worker processes must see the operations the test commits.
pytestmark = pytest.mark.django_db(transaction=True)


def test_every_crash_point_of_the_checkout__charged_once_invoiced_once(provider, queue):
    def start(key: str) -> Operation:
        order = create_order(amount=2500, currency="eur", email="kit@example.com")
        op, _ = request_checkout(
            order_id=order.pk, key=key, payment_method="pm_card_visa", actor="kit"
        )
        return op

    def charged(op: Operation) -> dict[str, int]:
        intents = provider.state.intents(metadata={"operation_key": op.key})
        return {"charge": sum(i["status"] == "succeeded" for i in intents)}

    def invoiced_once(op: Operation) -> None:
        assert Invoice.objects.filter(order_id=op.params["order_id"]).count() == 1
        assert LedgerEntry.objects.filter(order_id=op.params["order_id"]).count() == 1
        # every order paid so far counted once, this one included; none as a queued follow-up
        assert sum(SalesDay.objects.values_list("orders", flat=True)) == LedgerEntry.objects.count()
        assert not op.follow_ups.exists()

    env = {k: v for k, v in worker_env(provider.url).items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PAYMENTS_INLINE_FOLLOW_UPS"] = "true"
    table = crash_matrix(start, count=charged, check=invoiced_once, env=env)

    assert [case.point for case in table.cases] == crash_points("checkout")
    table.assert_held()
    crashed = {case.point for case in table.cases if case.crashed}
    # Every point of the external charge and of the e-mail (a side effect) was reached.
    for point in ("after_claim_commit", "after_provider_accept", "before_record_commit"):
        assert f"{point}@charge" in crashed, table
    assert "after_provider_accept@confirmation_email" in crashed, table
    assert "after_record_commit@checkout" in crashed, table


def test_an_effect_called_outside_the_fence__the_matrix_names_the_point(
    tmp_path, monkeypatch, queue
):
    """A handler that sends in its body, before its fenced step: killed after the step's
    claim commit, the redelivery sends again; the matrix reports the point as broken."""
    from django.db import transaction

    from payments.fence import create_operation_in_tx
    from tests.kit.unfenced import UNFENCED, sent_file

    monkeypatch.setenv("KIT_SENT_DIR", str(tmp_path))

    def start(key: str) -> Operation:
        with transaction.atomic():
            op, _ = create_operation_in_tx(
                key=key, kind=UNFENCED, entity_type="kit", entity_id=1, params={}, actor="kit"
            )
        return op

    def sent(op: Operation) -> dict[str, int]:
        path = sent_file(op.key)
        return {"notify": len(path.read_text().splitlines()) if path.exists() else 0}

    table = crash_matrix(
        start,
        count=sent,
        points=["after_claim_commit@notify"],
        env={"KIT_SENT_DIR": str(tmp_path)},
        handler_modules=["tests.kit.unfenced"],
    )

    (case,) = table.cases
    assert case.crashed and case.state == "succeeded"
    assert case.counts == {"notify": 2}
    assert not case.held and "notify (at most once) happened 2 times" in case.problems[0]
    with pytest.raises(AssertionError, match="1 of 1 crash points broke"):
        table.assert_held()
    # The workers it SIGKILLed are unregistered: the next matrix does not take them for
    # a development worker listening on the queue.
    assert Worker.all(queue=queue) == []


def test_another_worker_listening_on_the_queue__refused_before_anything_starts(queue):
    """A development `rqworker` on the tests' Redis database would run the matrix's jobs
    without its failpoints: a real one listens, its registration erased (the FLUSHDB of
    docs/testing.md's fixture), and the matrix names it and starts no operation."""
    kwargs = queue.connection.connection_pool.connection_kwargs
    url = f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs['db']}"
    rq = Path(sys.executable).with_name("rq")
    dev = subprocess.Popen(
        [str(rq), "worker", queue.name, "--url", url, "--name", "dev-worker-1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not {"dev-worker-1", "blocked"} <= {
            "blocked" if c.get("cmd") in ("blpop", "blmove") else c.get("name")
            for c in queue.connection.client_list()
            if c.get("db") == str(kwargs["db"])
        }:
            assert time.monotonic() < deadline and dev.poll() is None, "the worker never waited"
            time.sleep(0.1)
        queue.connection.flushdb()
        started: list[str] = []

        with pytest.raises(RuntimeError, match="worker.*dev-worker-1.*Redis database of their"):
            crash_matrix(started.append)

        assert started == []
    finally:
        stop_process(dev)


def test_a_worker_that_died_registered__is_not_taken_for_a_listener(queue):
    """A worker SIGKILLed before (an aborted run) stays in RQ's list until its key expires;
    with no connection of its own it listens to nothing: no refusal."""
    gone = Redis(**queue.connection.connection_pool.connection_kwargs)
    Worker([queue], connection=gone, name="killed-earlier").register_birth()
    gone.close()

    assert [w.name for w in Worker.all(queue=queue)] == ["killed-earlier"]
    _refuse_other_workers()  # raises if it took it for a listener
