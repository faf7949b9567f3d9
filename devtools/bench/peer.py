"""The peer a team would pick instead of the fence: the same checkout as a DBOS workflow.

DBOS Transact (the `dbos` package) checkpoints a workflow's steps in PostgreSQL and
recovers an interrupted workflow from its last checkpoint. Its twin of the fenced
checkout, on the same database, the same fake provider and the same order rows:

    load_order      a DBOS transaction (read, checkpointed with its output)
    charge          a DBOS step: POST /v1/payment_intents with an idempotency key
                    derived from the workflow id ("<workflow id>:charge")
    invoice         a DBOS transaction (the invoice row + its checkpoint, one commit)
    e-mail          a DBOS step (Django's send_mail, the dummy backend as the bench's)
    mark paid       a DBOS transaction
    ledger line     a DBOS transaction (the fence delivers it behind the inbox)
    sales counter   a DBOS transaction (likewise)

Configuration, as the bench runs it: a queue polled every 0.01 s (DBOS's default
1 s caps a queue near 2 checkouts a second), one workflow at a time per worker
process (`worker_concurrency=1`, as an RQ worker runs one job), transactions at
DBOS's default isolation (SERIALIZABLE), its system tables in schema `dbos` of the
bench database, its transactions' checkpoints in schema `dbos_ds`.

DBOS steps run at least once: a worker killed after the provider's answer and before
the step's checkpoint runs the step again on recovery. The idempotency key is what
keeps that second request from charging again; without it the customer is charged
twice. The fence guarantees the same by its claim, and more (a lost answer settled
by a read, the operators' desk): the peer's speed does not include that.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests
from django.conf import settings
from django.db import connection

#: The queue, its polling and the workflow's registered name.
QUEUE = "bench_checkouts"
POLLING_SECONDS = 0.01
WORKFLOW = "peer_checkout"
SYSTEM_SCHEMA = "dbos"
DATASOURCE_SCHEMA = "dbos_ds"
#: An environment variable a worker reads: "0" sends the charge without an idempotency key.
WITH_KEY = "BENCH_PEER_IDEMPOTENCY_KEY"
#: A directory: a worker SIGKILLs itself after the provider's answer to a workflow's charge,
#: the first time only (a file per workflow there says it did), before DBOS checkpoints it.
CRASH_AFTER_CHARGE = "BENCH_PEER_CRASH_AFTER_CHARGE"


def database_url() -> str:
    """The bench database as a SQLAlchemy URL (DBOS's engines speak psycopg 3)."""
    db = settings.DATABASES["default"]
    auth = (db["USER"] or "postgres") + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    host = db["HOST"] or "127.0.0.1"
    return f"postgresql://{auth}@{host}:{db['PORT'] or 5432}/{db['NAME']}"


def run_worker(executor: str) -> None:
    """Launch DBOS in this process and run the queue's workflows until killed."""
    from dbos import DBOS, DBOSConfig

    from payments.provider.client import ProviderClient

    url = database_url()
    config: DBOSConfig = {
        "name": "fence-bench-peer",
        "system_database_url": url,
        "dbos_system_schema": SYSTEM_SCHEMA,
        "executor_id": executor,
        "application_version": "bench",
        "log_level": "WARNING",
    }
    DBOS(config=config)
    from dbos import SQLAlchemyDatasource

    ds = SQLAlchemyDatasource.create(url, schema=DATASOURCE_SCHEMA)
    keyed = os.environ.get(WITH_KEY, "1") != "0"

    def sql(statement: str, **params: Any) -> Any:
        import sqlalchemy as sa

        return ds.sql_session().execute(sa.text(statement), params)

    @ds.transaction()
    def load_order(order_id: int) -> dict[str, Any]:
        row = sql(
            "SELECT amount, currency, customer_email FROM payments_order WHERE id = :id",
            id=order_id,
        ).one()
        return {"amount": row[0], "currency": row[1], "email": row[2]}

    @DBOS.step()
    def charge(order_id: int, order: dict[str, Any], payment_method: str) -> str:
        workflow = DBOS.workflow_id
        intent = ProviderClient.from_settings().create_payment_intent(
            amount=order["amount"],
            currency=order["currency"],
            payment_method=payment_method,
            metadata={"operation_key": str(workflow), "step": "charge", "order_id": str(order_id)},
            idempotency_key=f"{workflow}:charge" if keyed else os.urandom(16).hex(),
        )
        crash_dir = os.environ.get(CRASH_AFTER_CHARGE)
        if crash_dir:
            marker = Path(crash_dir) / str(workflow)
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)  # the answer is lost with the process
        return intent.id

    @ds.transaction()
    def issue_invoice(order_id: int, order: dict[str, Any], reference: str) -> str:
        number = f"INV-{order_id:08d}"
        sql(
            "INSERT INTO payments_invoice (order_id, number, amount, currency, provider_reference,"
            " created_at) VALUES (:order, :number, :amount, :currency, :reference, now())",
            order=order_id,
            number=number,
            amount=order["amount"],
            currency=order["currency"],
            reference=reference,
        )
        return number

    @DBOS.step()
    def send_confirmation(order_id: int, order: dict[str, Any], reference: str) -> bool:
        from django.core.mail import send_mail

        send_mail(
            subject=f"Order {order_id} is paid",
            message=f"We received your payment (reference {reference}).",
            from_email=None,
            recipient_list=[order["email"]],
        )
        return True

    @ds.transaction()
    def mark_paid(order_id: int) -> None:
        sql(
            "UPDATE payments_order SET status = 'paid', updated_at = now() WHERE id = :id",
            id=order_id,
        )

    @ds.transaction()
    def record_sale(order_id: int, order: dict[str, Any], reference: str) -> None:
        sql(
            "INSERT INTO payments_ledgerentry (order_id, amount, currency, provider_reference,"
            " created_at) VALUES (:order, :amount, :currency, :reference, now())",
            order=order_id,
            amount=order["amount"],
            currency=order["currency"],
            reference=reference,
        )

    @ds.transaction()
    def count_sale(order: dict[str, Any]) -> None:
        sql(
            "INSERT INTO payments_salesday (day, currency, orders, total)"
            " VALUES (current_date, :currency, 1, :amount)"
            " ON CONFLICT (day, currency) DO UPDATE SET orders = payments_salesday.orders + 1,"
            " total = payments_salesday.total + EXCLUDED.total",
            currency=order["currency"],
            amount=order["amount"],
        )

    @DBOS.workflow(name=WORKFLOW)
    def peer_checkout(order_id: int, payment_method: str) -> str:
        order = load_order(order_id)
        reference = charge(order_id, order, payment_method)
        issue_invoice(order_id, order, reference)
        send_confirmation(order_id, order, reference)
        mark_paid(order_id)
        record_sale(order_id, order, reference)
        count_sale(order)
        return reference

    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=1, polling_interval_sec=POLLING_SECONDS)
    while True:
        time.sleep(3600)


def reset() -> None:
    """Empty DBOS's tables (its schemas stay: no DDL in a batch's WAL)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT format('%%I.%%I', schemaname, tablename) FROM pg_tables "
            "WHERE schemaname IN (%s, %s)",
            [SYSTEM_SCHEMA, DATASOURCE_SCHEMA],
        )
        tables = [row[0] for row in cursor.fetchall()]
        emptied = [t for t in tables if not t.endswith("migrations")]  # keep their versions
        if emptied:
            cursor.execute(f"TRUNCATE {', '.join(emptied)} CASCADE")


def enqueue(order_ids: list[int], payment_method: str = "pm_card_visa") -> None:
    """Enqueue one workflow per order, its id the order's (a stable workflow id)."""
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=database_url(), dbos_system_schema=SYSTEM_SCHEMA)
    try:
        for order_id in order_ids:
            client.enqueue(
                {
                    "queue_name": QUEUE,
                    "workflow_name": WORKFLOW,
                    "workflow_id": f"peer-checkout-{order_id}",
                    "app_version": "bench",
                },
                order_id,
                payment_method,
            )
    finally:
        client.destroy()


def progress() -> tuple[int, int]:
    """(workflows succeeded, workflows in error)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FILTER (WHERE status = 'SUCCESS'),"
            f" count(*) FILTER (WHERE status IN ('ERROR', 'MAX_RECOVERY_ATTEMPTS_EXCEEDED'))"
            f" FROM {SYSTEM_SCHEMA}.workflow_status"
        )
        done, failed = cursor.fetchone()
        return int(done), int(failed)


def elapsed_seconds() -> float:
    """From the first workflow's start to the last one's end, as DBOS recorded them."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT min(started_at_epoch_ms), max(updated_at)"
            f" FROM {SYSTEM_SCHEMA}.workflow_status WHERE status = 'SUCCESS'"
        )
        first, last = cursor.fetchone()
        return (int(last) - int(first)) / 1000


def migrate() -> None:
    """Create or bring DBOS's system and datasource tables to this version, in this process
    (DBOS.migrate and SQLAlchemyDatasource.migrate, what `dbos migrate` runs), before any
    worker launches; nothing to do once they are. A worker's launch would migrate them
    too, but a setup worker stopped as soon as `workflow_status` appeared could leave
    DBOS's later migrations undone on a busy machine (the enqueue then failed on a
    missing column)."""
    from dbos import DBOS, SQLAlchemyDatasource

    DBOS.migrate(database_url(), schema=SYSTEM_SCHEMA)
    SQLAlchemyDatasource.migrate(database_url(), schema=DATASOURCE_SCHEMA)


def side_by_side(bench: Any, n: int, workers: int, rounds: int) -> dict[str, Any]:
    """Throughput, CPU and WAL per checkout: the fence (FenceWorker) and the DBOS twin, in
    turns, `rounds` batches of `n` checkouts each; each side keeps its fastest round and
    the CPU and WAL of that round. WAL is the worker side's (from the requests' end to the
    last checkout's), as the bench's other WAL figures; `api_wal_bytes` is the request
    side's (the fence's operation rows, DBOS's enqueued workflows); `wal_by_relation`:
    where the worker side's WAL went (devtools.bench.wal; keep its segments with
    `reserved_wal`)."""
    from devtools.bench.wal import wal_by_relation

    best: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for side in ("fence", "dbos") if r % 2 == 0 else ("dbos", "fence"):
            row = (
                _fence_batch(bench, n, workers)
                if side == "fence"
                else _dbos_batch(bench, n, workers)
            )
            row["per_second"] = n / row["seconds"]
            # Read now: the next batch's TRUNCATE gives the tables new files (relfilenodes).
            row["wal_by_relation"] = [
                {"name": s.name, "bytes_per_checkout": s.bytes / n, "records": s.records / n}
                for s in wal_by_relation(*row["lsn"])
            ]
            if side not in best or row["per_second"] > best[side]["per_second"]:
                best[side] = row
    return {
        side: {
            "wal_by_relation": row["wal_by_relation"],
            "checkouts_per_second": row["per_second"],
            "cpu_ms_per_checkout": row["cpu_ms"],
            "cpu_ms_total": sum(row["cpu_ms"].values()),
            # This database's relations and the commit records (pg_waldump): what another
            # database wrote meanwhile is left out, as the cluster-wide figure cannot.
            "wal_bytes_per_checkout": sum(r["bytes_per_checkout"] for r in row["wal_by_relation"]),
            "cluster_wal_bytes_per_checkout": row["wal"] / n,
            "api_wal_bytes_per_checkout": row["api"] / n,
        }
        for side, row in best.items()
    }


def _fence_batch(bench: Any, n: int, workers: int) -> dict[str, Any]:
    """One batch of the fence: n checkout requests (the API's service), then FenceWorkers."""
    from devtools.bench.runner import (
        WORKER_CLASSES,
        _orders,
        jobs_per_checkout,
        wal_bytes_since,
        wal_position,
    )
    from payments.checkout.handler import request_checkout

    api: dict[str, Any] = {}

    def prepare() -> int:
        orders = _orders(n)
        start = wal_position()
        for order in orders:
            request_checkout(
                order_id=order.pk, key=f"bench-{order.pk}", payment_method="pm_card_visa",
                actor="bench",
            )  # fmt: skip
        api["wal"] = wal_bytes_since(start)
        api["end"] = wal_position()
        return jobs_per_checkout() * n

    worker_class = WORKER_CLASSES["FenceWorker (SimpleWorker)"]
    seconds = bench.batch(prepare, workers=workers, worker_class=worker_class)
    return {
        "seconds": seconds,
        "cpu_ms": bench.cpu.ms_per(jobs_per_checkout()) if bench.cpu else {},
        "wal": bench.wal_bytes,
        "api": api["wal"],
        "lsn": (api["end"], wal_position()),
    }


def _dbos_batch(bench: Any, n: int, workers: int) -> dict[str, Any]:
    """One batch of the DBOS twin: enqueue n workflows, then start the workers and time them."""
    from devtools.bench.runner import _orders as make_orders
    from devtools.bench.runner import wal_bytes_since as since
    from devtools.bench.runner import wal_position as position

    migrate()
    bench.reset()
    reset()
    orders = make_orders(n)
    api_from = position()
    enqueue([o.pk for o in orders])
    api = since(api_from)
    wal_from = position()
    procs = [
        bench.stack._spawn(
            f"peer-{i}", ["bench_peer_worker", "--executor", f"peer-{i}"], bench.worker_env
        )  # fmt: skip
        for i in range(workers)
    ]
    meter = bench.meter(procs)
    deadline = time.monotonic() + 600
    metered_from: int | None = None
    while True:
        done, failed = progress()
        if failed:
            raise RuntimeError(f"{failed} DBOS workflows failed; see {bench.stack.log_dir}")
        if done >= n:
            break
        if metered_from is None and _started() >= workers:  # every worker has launched
            meter.start()
            metered_from = done
        if time.monotonic() > deadline:
            raise RuntimeError(f"the DBOS batch did not finish: {done}/{n}")
        time.sleep(0.05)
    seconds_cpu = meter.stop() if metered_from is not None else {}
    wal = since(wal_from)
    wal_to = position()
    for proc in procs:
        bench.stack.kill(proc)
    bench.stack.procs = [p for p in bench.stack.procs if p not in procs]
    units = (n - (metered_from or 0)) or 1
    cpu = {role: 1000 * s / units for role, s in seconds_cpu.items() if role != "load_generator"}
    return {
        "seconds": elapsed_seconds(), "cpu_ms": cpu, "wal": wal, "api": api,
        "lsn": (wal_from, wal_to),
    }  # fmt: skip


def _started() -> int:
    """Executors that have started a workflow (a launched worker dequeues at once)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(DISTINCT executor_id) FROM {SYSTEM_SCHEMA}.workflow_status"
            f" WHERE started_at_epoch_ms IS NOT NULL"
        )
        return int(cursor.fetchone()[0])


def crash_check(bench: Any, n: int, *, keyed: bool) -> dict[str, Any]:
    """n checkouts on one DBOS worker that is SIGKILLed after the provider's answer to each
    charge (before DBOS checkpoints the step) and restarted under the same executor id, so
    that DBOS recovers the workflow and runs the step again. Charges per order are read
    from the provider's own record (`/_fake/timeline`)."""
    from devtools.bench.runner import _orders

    migrate()
    bench.reset()
    reset()
    orders = _orders(n)
    enqueue([o.pk for o in orders])
    env = {**bench.worker_env, WITH_KEY: "1" if keyed else "0"}
    kills = 0
    with tempfile.TemporaryDirectory() as crash_dir:
        env[CRASH_AFTER_CHARGE] = crash_dir
        deadline = time.monotonic() + 60 + 15 * n
        worker = bench.stack._spawn("peer-crash", ["bench_peer_worker", "--executor", "crash"], env)
        while progress()[0] < n:
            if progress()[1]:
                raise RuntimeError(f"a DBOS workflow failed; see {bench.stack.log_dir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the crash check did not finish: {progress()[0]}/{n}")
            if not worker.alive:  # killed after a charge: restarted, as a supervisor would
                kills += 1
                bench.stack.procs.remove(worker)
                worker = bench.stack._spawn(
                    "peer-crash", ["bench_peer_worker", "--executor", "crash"], env
                )
            time.sleep(0.05)
        bench.stack.kill(worker)
        bench.stack.procs.remove(worker)
    timeline = requests.get(f"{bench.url}/_fake/timeline", timeout=10).json()["data"]
    charges = Counter(
        row["metadata"].get("order_id") for row in timeline if row["object"] == "payment_intent"
    )
    return {
        "orders": n,
        "idempotency_key": keyed,
        "workers_killed": kills,
        "charges": sum(charges.values()),
        "orders_charged_twice": sum(1 for count in charges.values() if count > 1),
    }


def peer_figures(bench: Any, n: int, rounds: int, crash_orders: int) -> dict[str, Any]:
    """The fence and DBOS side by side (`side_by_side`), where each one's WAL goes (by
    table and index, for the fastest round of each), and DBOS's crash check with and
    without the idempotency key."""
    from devtools.bench.wal import reserved_wal

    with reserved_wal():
        sides = side_by_side(bench, n, workers=2, rounds=rounds)
    return {
        "orders": n,
        "rounds": rounds,
        "dbos_version": _dbos_version(),
        **sides,
        "crash": [crash_check(bench, crash_orders, keyed=k) for k in (True, False)],
    }


def _dbos_version() -> str:
    from importlib.metadata import version

    return version("dbos")


#: The markers of the peer's tables in docs/benchmarks.md.
DOC_TABLE = "bench-peer"
#: How many of each side's relations the WAL table lists (the rest are added up).
WAL_ROWS = 14


def peer_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    """The peer's figures as (figure, measured) rows: the fence against DBOS."""
    fence, dbos = f["fence"], f["dbos"]

    def both(fmt: str, key: str) -> str:
        return f"{fmt.format(fence[key])} / {fmt.format(dbos[key])}"

    wal = fence["wal_bytes_per_checkout"] / dbos["wal_bytes_per_checkout"]
    rows = [
        (
            "the peer",
            f"DBOS Transact {f['dbos_version']}: a workflow per checkout, its queue polled every "
            f"{POLLING_SECONDS} s, one workflow at a time per worker, SERIALIZABLE transactions",
        ),
        (
            f"checkouts/s, 2 workers, best of {f['rounds']} rounds of {f['orders']}: fence / DBOS",
            both("{:.1f}", "checkouts_per_second")
            + f" (fence {fence['checkouts_per_second'] / dbos['checkouts_per_second']:.2f}x)",
        ),
        (
            "CPU ms per checkout, workers + PostgreSQL + Redis + provider: fence / DBOS",
            both("{:.1f}", "cpu_ms_total"),
        ),
        (
            "WAL bytes per checkout, worker side, this database's relations and commits "
            "(pg_waldump): fence / DBOS (goal: fence below)",
            both("{:,.0f}", "wal_bytes_per_checkout")
            + f" (fence {wal:.2f}x: "
            + ("met" if wal < 1 else "not met")
            + ")",
        ),
        (
            "WAL bytes per checkout, request side (operation rows / enqueued workflow): fence / DBOS",
            both("{:,.0f}", "api_wal_bytes_per_checkout"),
        ),
    ]
    for crash in f["crash"]:
        key = "with" if crash["idempotency_key"] else "without"
        rows.append(
            (
                f"DBOS, {key} the idempotency key: {crash['orders']} orders, its worker SIGKILLed "
                "after each provider answer",
                f"{crash['charges']} charges, {crash['orders_charged_twice']} orders charged twice",
            )
        )
    return rows


def wal_table(f: dict[str, Any]) -> list[str]:
    """Where each side's WAL per checkout goes, by table and index (Markdown)."""
    lines = ["| fence: relation | bytes | records | DBOS: relation | bytes | records |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]  # fmt: skip
    sides = [_top(f["fence"]["wal_by_relation"]), _top(f["dbos"]["wal_by_relation"])]
    for i in range(max(len(s) for s in sides)):
        cells = []
        for side in sides:
            if i < len(side):
                row = side[i]
                cells += [f"`{row['name']}`", f"{row['bytes_per_checkout']:,.0f}",
                          f"{row['records']:.1f}"]  # fmt: skip
            else:
                cells += ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _top(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The largest WAL_ROWS relations, then the rest added up."""
    top, rest = rows[:WAL_ROWS], rows[WAL_ROWS:]
    if rest:
        top = [*top, {"name": f"{len(rest)} others",
                      "bytes_per_checkout": sum(r["bytes_per_checkout"] for r in rest),
                      "records": sum(r["records"] for r in rest)}]  # fmt: skip
    total = {"name": "total", "bytes_per_checkout": sum(r["bytes_per_checkout"] for r in rows),
             "records": sum(r["records"] for r in rows)}  # fmt: skip
    return [*top, total]


def peer_markdown(f: dict[str, Any]) -> list[str]:
    """The peer's section of docs/benchmarks.md: its figures, then where the WAL goes."""
    lines = ["| figure | measured |", "| --- | --- |"]
    lines += [f"| {a} | {b} |" for a, b in peer_rows(f)]
    return [*lines, "", "WAL per checkout by relation, the fastest round of each side:", "",
            *wal_table(f)]  # fmt: skip
