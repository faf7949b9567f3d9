"""The bench's peer: DBOS's twin of the checkout does the same work, and its crash check counts.

Real processes: `manage.py bench_peer_worker` (DBOS launched in it, its tables in the
test database), FenceWorkers, the fake provider over HTTP. No timing is asserted: the
figures are `make bench`'s; here the twin must pay every order once with its invoice,
ledger line and sales counter, the WAL must be read by relation, and the crash check
must tell a charge made twice from one made once.
"""

from __future__ import annotations

import pytest
from django.db import connection

from devtools.bench import peer
from devtools.bench.runner import Bench
from devtools.bench.wal import wal_by_relation
from payments.shop.models import Invoice, LedgerEntry, Order, OrderStatus, SalesDay
from tests.support.config import TEST_REDIS_URL
from tests.support.workers import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

N = 4


@pytest.fixture
def bench(tmp_path, monkeypatch, settings):
    monkeypatch.setenv("DATABASE_URL", database_url())
    monkeypatch.setenv("REDIS_URL", TEST_REDIS_URL)
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    settings.DEBUG = True  # what the bench assigns lands in this override, undone after
    with Bench(latency=0, log_dir=tmp_path, say=lambda line: None) as running:
        yield running


def test_dbos_twin__pays_each_order_once_with_the_fences_business_rows(bench):
    row = peer._dbos_batch(bench, N, workers=2)

    orders = list(Order.objects.all())
    assert len(orders) == N and {o.status for o in orders} == {OrderStatus.PAID}
    assert Invoice.objects.count() == LedgerEntry.objects.count() == N
    assert sum(day.orders for day in SalesDay.objects.all()) == N
    assert peer.progress() == (N, 0)
    assert row["seconds"] > 0 and row["wal"] > 0 and row["api"] > 0
    names = {share.name for share in wal_by_relation(*row["lsn"])}
    assert {"workflow_status", "payments_invoice", "payments_ledgerentry"} <= names


def test_side_by_side__both_sides_measured__the_fences_wal_by_its_own_tables(bench):
    figures = peer.peer_figures(bench, N, rounds=1, crash_orders=1)

    for side in ("fence", "dbos"):
        assert figures[side]["checkouts_per_second"] > 0
        assert figures[side]["wal_bytes_per_checkout"] > 0
    fence_relations = {r["name"] for r in figures["fence"]["wal_by_relation"]}
    assert {"payments_operation", "payments_stepclaim", "payments_operationevent"} <= (
        fence_relations
    )
    assert "workflow_status" not in fence_relations  # each round's own WAL, not the other's
    markdown = "\n".join(peer.peer_markdown(figures))
    assert "DBOS Transact" in markdown and "`payments_operation`" in markdown


def test_dbos_crash_check__without_the_key_every_order_is_charged_twice(bench):
    keyed = peer.crash_check(bench, 2, keyed=True)
    unkeyed = peer.crash_check(bench, 2, keyed=False)

    assert (keyed["workers_killed"], keyed["charges"], keyed["orders_charged_twice"]) == (2, 2, 0)
    assert (unkeyed["workers_killed"], unkeyed["charges"], unkeyed["orders_charged_twice"]) == (
        2,
        4,
        2,
    )
