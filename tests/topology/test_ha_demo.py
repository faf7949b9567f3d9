"""`manage.py demo --topology ha`, small: the chaos run past one host, with its three faults.

The run starts its own PostgreSQL cluster, PgBouncer in transaction pooling
before it, a Redis master, a replica and three sentinels, 3 recovery
processes, 4 workers (SIGKILLed every 0.5-2 s) and the fake provider with its
faults; while charges are in flight the Redis master is SIGKILLed (Sentinel
promotes the replica), PgBouncer is restarted and PostgreSQL is restarted. The
command is run as an operator runs it; its report (report.json, read from the
run's own database) must show the invariants and each fault on the timeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from django.conf import settings

from devtools.chaos.ha import FAULTS
from tests.support.topology import binary
from tests.support.workers import ROOT

ORDERS = 30


def test_demo_topology_ha__three_faults_in_flight__no_double_charge_every_operation_settled(
    tmp_path,
):
    for name in ("pgbouncer", "redis-server", "redis-sentinel"):
        binary(name)
    env = {
        **os.environ,
        "DEBUG": "1",
        "SECRET_KEY": settings.SECRET_KEY,
        "API_TOKEN": settings.API_TOKEN,
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "demo",
            "--topology",
            "ha",
            "--orders",
            str(ORDERS),
            "--fault-gap",
            "4",
            "--timeout",
            "150",
            "--output",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout[-6000:] + done.stderr[-6000:]
    assert done.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())

    assert report["violations"] == [], output
    assert report["orders"] == ORDERS
    assert report["double_charges"] == 0
    assert report["provider_successes_without_claim"] == 0
    assert report["settled_in_time"] is True
    assert set(report["operations_by_state"]) <= {"succeeded", "failed", "needs_review"}
    # The run sends a share of its orders through a shop on Adyen: both providers' own
    # records together account for every paid order, with no double charge at either.
    adyen = report["adyen"]
    assert adyen["adyen_double_charges"] == adyen["adyen_payments_outside_the_fence"] == 0
    assert report["provider_successes"] == report["charge_claims_done"]
    assert report["provider_successes"] + adyen["adyen_payments_taken"] == report["orders_paid"]
    assert report["paid_orders_with_one_invoice"] == report["orders_paid"]
    assert report["paid_orders_with_one_ledger_line"] == report["orders_paid"]
    assert report["double_refunds"] == 0 and report["over_refunds"] == 0

    timeline = report["timeline"]
    assert [fault["name"] for fault in timeline["faults"]] == list(FAULTS), output
    for fault in timeline["faults"]:
        # Each fault happened with the run's operations in flight, and its backlog drained.
        assert fault["in_flight"] > 0, fault
        assert fault["drained_after_s"] is not None, fault
    assert "promoted" in timeline["faults"][0]["detail"]
    assert sum(timeline["settled_per_second"]) > 0
