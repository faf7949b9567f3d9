"""An `rqworker` started while its database is away (a PgBouncer or PostgreSQL restart).

Workers are started again all the time (a supervisor replaces one that died),
so one may start during the second a restart takes. Before it takes jobs the
worker reads the names recorded on unfinished operations (payments.E010);
with the database away it used to exit at once with a traceback (found by
`manage.py demo --topology ha`). A supervisor that restarts it quickly gives
up after a few such exits (systemd's start limit: 5 in 10 s), and the worker
stays down for good. It must wait for the database instead, then work.
"""

from __future__ import annotations

import time

import pytest
from django.db import connection

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from tests.support.flows import assert_paid_once
from tests.support.topology import checkout_settled
from tests.support.workers import start_worker, stop_worker, wait_until, worker_env

# Transactional: the worker process must see the committed operation.
pytestmark = pytest.mark.django_db(transaction=True)


def test_worker_started_while_the_database_is_away__waits_for_it_then_works(
    provider, queue, pgbouncer
):
    order = create_order(amount=1200, currency="eur", email="away@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="db-away", payment_method="pm_card_visa", actor="test"
    )
    env = worker_env(
        provider.url,
        DATABASE_URL=pgbouncer.url(str(connection.settings_dict["NAME"])),
        DATABASE_POOLING="transaction",
    )
    pgbouncer.stop()  # the database is away: nothing listens where DATABASE_URL points
    worker = start_worker(env, "db-away")
    try:
        time.sleep(3)
        assert worker.poll() is None, "the worker exited:\n" + stop_worker(worker)
        pgbouncer.start()  # back, on the same port
        wait_until(
            lambda: checkout_settled(op),
            40,
            "the worker to pay the order (and run its follow-ups) once the database is back",
        )
    finally:
        stderr = stop_worker(worker)
    assert_paid_once(provider, {op.key: order.pk})
    assert "waiting for the database" in stderr, stderr
