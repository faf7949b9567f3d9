"""The web tier's load run (devtools.bench.webload, `make bench`) through PgBouncer.

A tiny version of the bench's web-tier section: gunicorn (2 sync workers) in
front of PgBouncer in transaction pooling with one server connection, 40
checkout requests, 8 in flight at once, each order asked for by 4 requests
with the same Idempotency-Key. Every request must be answered 202 (one that
created the operation, the others replays), no 5xx, and the database must hold
exactly one operation per key. No timing is asserted: the figures are printed.
"""

from __future__ import annotations

import pytest
from django.db import connection

from devtools.bench.webload import Answer, LoadShape, measure, summarize, violations
from payments.models import Operation
from tests.support.workers import worker_env

# Transactional: gunicorn's workers must see the orders this process creates.
pytestmark = pytest.mark.django_db(transaction=True)

#: The checkout request only writes rows and enqueues: no provider is called.
NO_PROVIDER = "http://127.0.0.1:9"


def test_load_through_pgbouncer__every_duplicate_answered_202_one_operation_per_key(
    queue, pgbouncer, tmp_path
):
    database = str(connection.settings_dict["NAME"])
    env = worker_env(
        NO_PROVIDER, DATABASE_URL=pgbouncer.url(database), DATABASE_POOLING="transaction"
    )
    shape = LoadShape(orders=10, duplicates=4, concurrency=8)

    figures = measure(
        env,
        workers=2,
        shape=shape,
        run_id="test",
        log=tmp_path / "gunicorn.log",
    )

    assert figures["violations"] == [], (tmp_path / "gunicorn.log").read_text()[-3000:]
    assert figures["requests"] == 40
    assert figures["statuses"] == {"202": 40}
    assert figures["server_errors"] == 0
    assert figures["connection_errors"] == 0
    assert figures["created_per_key"] == {"min": 1, "max": 1}  # the other 3 were replays
    assert figures["operations_per_key"] == {"min": 1, "max": 1}
    load_keys = Operation.objects.filter(key__startswith="load-test-")
    assert load_keys.count() == 10
    assert load_keys.values("entity_id").distinct().count() == 10
    print(
        f"\n{figures['requests_per_second']:.1f} requests/s, p50 {figures['p50_ms']:.0f} ms, "
        f"p99 {figures['p99_ms']:.0f} ms, {figures['keys_in_flight_together']} of 10 keys "
        "with all 4 duplicates in flight together"
    )


def test_verdict__names_a_5xx_a_second_creation_and_a_second_operation():
    """The bench's verdict is not a formality: each broken promise is named."""
    answers = [
        Answer("k1", 202, False, "k1", 0.0, 1.0),
        Answer("k1", 202, False, "k1", 0.0, 1.0),  # a second answer that created
        Answer("k2", 202, False, "k2", 0.0, 1.0),
        Answer("k2", 500, False, "", 0.0, 1.0),
    ]

    broken = violations(summarize(answers, {"k1": 2, "k2": 1}))

    assert len(broken) == 4
    assert broken[0].startswith("1 5xx")
    assert "{'202': 3, '500': 1}" in broken[1]
    assert "created an operation per key: {'min': 1, 'max': 2}" in broken[2]
    assert "operations per key in the database: {'min': 1, 'max': 2}" in broken[3]
