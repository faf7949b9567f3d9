"""The queue's Redis under Sentinel: its master is SIGKILLed with checkouts in flight.

A master, a replica and three sentinels (quorum 2) run as new processes; the
web tier (gunicorn), two `rqworker` processes and the recovery loop find the
master through the sentinels (REDIS_SENTINELS), never by its address. Just
before the kill the replica is cut off, so the jobs of the checkouts posted
then exist only on the master that dies: lost in the failover, as writes a
master had not replicated yet. The sentinels promote the replica; the API's
next enqueues land on it, the workers and the sweeper follow, the sweeper
delivers the lost jobs again, and every order is paid by one charge.
"""

from __future__ import annotations

import time

import pytest
from django.conf import settings

from payments.models import Operation
from tests.support.flows import assert_paid_once
from tests.support.topology import (
    Api,
    Fleet,
    all_settled,
    free_port,
    start_gunicorn,
    stop_process,
    wait_until,
)
from tests.support.workers import worker_env

# Transactional: the processes must see (and write) committed rows.
pytestmark = pytest.mark.django_db(transaction=True)

METRICS_TOKEN = "topology-metrics-token"
#: Operations per checkout: the checkout and its two follow-ups (ledger line, sales counter).
OPS_PER_CHECKOUT = 3


def test_master_killed__workers_api_and_sweeper_follow_the_new_master(provider, redis_ha, tmp_path):
    env = worker_env(provider.url, METRICS_TOKEN=METRICS_TOKEN, **redis_ha.env())
    port = free_port()
    web = start_gunicorn(env, port, tmp_path / "web.log")
    fleet = Fleet(env, "ha", tmp_path, workers=2)
    api = Api(port, settings.API_TOKEN)
    orders: dict[str, int] = {}

    def checkouts(prefix: str, count: int) -> list[str]:
        keys = []
        for index in range(count):
            order_id, key = api.checkout(f"{prefix}-{index}")
            orders[key] = order_id
            keys.append(key)
        return keys

    try:
        # Before: paid through the first master.
        checkouts("before", 3)
        fleet.wait(lambda: all_settled(3 * OPS_PER_CHECKOUT), 40, "the first checkouts")

        # At the failover: 2 charges at a time take 0.5 s each, so most of these jobs
        # wait in the queue, on the master alone, when it is killed.
        provider.state.configure(latency=0.5)
        redis_ha.break_replication()
        lost = {key: Operation.objects.get(key=key).job_id for key in checkouts("failover", 6)}
        killed = time.monotonic()
        old_port = redis_ha.kill_master()
        # Until the sentinels switch, a client finds no master (MasterNotFoundError).
        failover = wait_until(
            lambda: redis_ha.master_port() not in (None, old_port), 30, "the sentinels to promote"
        )
        new_master = redis_ha.client(redis_ha.master_port() or 0)
        provider.state.configure(latency=0.0)

        # After: the API enqueues on the new master at once (no sweep needed).
        for key in checkouts("after", 3):
            job_id = Operation.objects.get(key=key).job_id
            assert new_master.exists(f"rq:job:{job_id}"), (
                f"{key}'s job is not on the new master\n"
                + (tmp_path / "web.log").read_text(errors="replace")[-5000:]
            )
        # Health and metrics read the queue's Redis through the sentinels too.
        assert api.get("/healthz").status_code == 200
        metrics = api.get("/metrics", Authorization=f"Bearer {METRICS_TOKEN}")
        assert metrics.status_code == 200, metrics.text[:500]

        fleet.wait(
            lambda: all_settled(len(orders) * OPS_PER_CHECKOUT),
            60,
            "every operation to settle after the failover",
        )
        drained = time.monotonic() - killed
    finally:
        fleet.stop()
        stop_process(web)
    diagnostics = fleet.output()

    assert_paid_once(provider, orders)
    # Jobs lost with the old master were delivered again, by the sweeper.
    redelivered = [key for key, job in lost.items() if Operation.objects.get(key=key).job_id != job]
    assert redelivered, diagnostics
    assert fleet.swept() >= len(redelivered), diagnostics
    print(
        f"\nfailover: promoted {failover:.1f}s after the SIGKILL; every operation settled "
        f"{drained:.1f}s after it; {len(redelivered)} of {len(lost)} checkout jobs lost and "
        f"swept again (the sweeper dispatched {fleet.swept()} operations again in all); worker restarts: {fleet.restarts}"
    )
