"""FenceWorker skips Django's per-job health check on a connection used cleanly a moment ago.

Counted at the connection (devtools.bench.dbcount) over real jobs on a real
FenceWorker; HEALTH_CHECK_AFTER_IDLE is set wide (or to 0) so that no test
depends on how fast this machine runs them.
"""

from __future__ import annotations

import pytest
from django.db import connection

from devtools.bench.dbcount import counting
from payments.engine import worker as worker_module
from payments.shop.models import Order
from tests.support.workers import run_fence_worker

pytestmark = pytest.mark.django_db(transaction=True)


def read_orders() -> int:
    return Order.objects.count()


def fail_with_a_database_error() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table")


@pytest.fixture
def kept_connection(monkeypatch):
    """Connections kept between jobs and health-checked, as in production."""
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", None)
    monkeypatch.setitem(connection.settings_dict, "CONN_HEALTH_CHECKS", True)
    connection.close()
    connection.ensure_connection()


def health_checks_of_three_jobs(queue, monkeypatch, window: float) -> int:
    """Run three jobs back to back with the given idle window; count the health checks."""
    monkeypatch.setattr(worker_module, "HEALTH_CHECK_AFTER_IDLE", window)
    for _ in range(3):
        queue.enqueue(read_orders)
    with counting() as counter:
        run_fence_worker(queue)
    return counter.snapshot().health_checks


def test_back_to_back_jobs__only_the_first_is_health_checked(queue, kept_connection, monkeypatch):
    assert health_checks_of_three_jobs(queue, monkeypatch, window=60.0) == 1


def test_after_an_idle_pause__every_job_is_health_checked(queue, kept_connection, monkeypatch):
    assert health_checks_of_three_jobs(queue, monkeypatch, window=0.0) == 3


def test_after_a_database_error__the_connection_is_checked_before_the_next_job(
    queue, kept_connection, monkeypatch
):
    monkeypatch.setattr(worker_module, "HEALTH_CHECK_AFTER_IDLE", 60.0)
    queue.enqueue(read_orders)
    queue.enqueue(fail_with_a_database_error)
    queue.enqueue(read_orders)

    with counting() as counter:
        run_fence_worker(queue)

    # The first job's check and the one Django makes after the error, before the third
    # job (which then uses the connection just checked): without the error, 1.
    assert counter.snapshot().health_checks == 2
