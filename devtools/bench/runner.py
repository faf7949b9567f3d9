"""The benchmark scenarios. Every figure is measured in the same run, side by side.

Throughput comes from RQ's own job timestamps (first start to last end of the
batch), so worker start-up is not counted; jobs are enqueued before the
workers start. Provider calls go over real HTTP (or HTTPS, `tls=True`) to the
fake provider, which answers after `latency` seconds as a real provider would
(Stripe's creates take hundreds of milliseconds; the default here is a
conservative 20 ms). Both sides run with the same pooling: one provider
session per worker process, one Redis client per process, database
connections kept for 60 s (DB_CONN_MAX_AGE, as in production).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

import requests
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.worker import Worker

from devtools.bench import jobs
from devtools.bench.cpu import CpuMeter, backend_pids, processes_named, tree_pids
from devtools.bench.dbcount import RoundTrips, counting, recorded
from devtools.databases.scratch import claim_scratch, flush_scratch
from devtools.topology.stack import Stack, free_port
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.conf import payments_settings
from payments.engine.queues import payments_queue
from payments.engine.recovery import reconcile
from payments.models import Operation, OperationState
from payments.provider.client import ProviderClient, new_session
from payments.shop.models import Order

WORKER_CLASSES = {
    "Worker (forking)": "rq.worker.Worker",
    "FenceWorker (SimpleWorker)": "payments.engine.worker.FenceWorker",
}
#: FenceWorker that records each job's database round trips (devtools.bench.dbcount).
COUNTING_WORKER = "devtools.bench.workers.CountingWorker"
TABLES = [
    "payments_operationevent", "payments_stepclaim", "payments_invoice",
    "payments_ledgerentry", "payments_salesday", "payments_fenceauditrun",
    "payments_operation", "payments_order", "inbox_inboxentry",
]  # fmt: skip


#: The environment variable that opts a process in to project.postgresql (project/settings.py).
OPT_IN_BACKEND = "DATABASE_BEGIN_WITH_FIRST_STATEMENT"
#: The database backends the bench compares, by name: Django's own (the default) and the
#: opt-in one that sends a transaction's BEGIN with its first statement.
BACKENDS = {"django": "0", "begin_with_first_statement": "1"}


def production_settings(backend: str = "django") -> dict[str, str]:
    """What the bench's workers run with on top of the caller's environment: DEBUG off,
    and the database backend named (BACKENDS), whatever the caller's environment says.

    `make bench` runs from the development `.env`, DEBUG on. With DEBUG on,
    Django logs every query with its values, and the fence does not prepare its
    statements (payments.engine.driver.statement_cursors): each statement would
    cost a worker what it never costs in production, the fenced side's more
    than the twin's. DEBUG off needs secrets: this run's own, as the web tier's
    gunicorn gets. DEVTOOLS keeps the app of the bench's job functions installed.
    """
    return {
        "DEBUG": "0",
        "DEVTOOLS": "1",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "API_TOKEN": secrets.token_urlsafe(32),
        OPT_IN_BACKEND: BACKENDS[backend],
    }


class Bench:
    """Runs batches of jobs on real worker processes against one fake provider."""

    def __init__(
        self, *, latency: float, log_dir: Path, say: Callable[[str], None], tls: bool = False
    ) -> None:
        self.say = say
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        # With TLS the fake provider writes its throwaway CA here; every process
        # (workers and this one) trusts it through requests' REQUESTS_CA_BUNDLE.
        self.ca_file = log_dir / "fake-provider-ca.pem" if tls else None
        env = {
            **os.environ,
            "PAYMENT_PROVIDER_URL": self.url,
            "LOG_LEVEL": "WARNING",
            "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
            # Production keeps connections (DEBUG defaults to closing them per job).
            "DB_CONN_MAX_AGE": "60",
        }
        if self.ca_file is not None:
            env["REQUESTS_CA_BUNDLE"] = str(self.ca_file)
        self.stack = Stack(env=env, log_dir=log_dir)
        self.worker_env = production_settings()
        #: The last batch's CPU (see `batch`); None if it ended before every worker started.
        self.cpu: BatchCpu | None = None
        #: WAL bytes PostgreSQL wrote while the last batch's workers ran (see `batch`).
        self.wal_bytes = 0
        self.latency = latency
        self.queue = payments_queue()
        claim_scratch(self.queue.connection, "the bench")
        settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": env["PAYMENT_PROVIDER_URL"]}
        settings.EMAIL_BACKEND = env["EMAIL_BACKEND"]
        # The API side is counted in this process, and the reconciler runs in it: keep
        # its connection as production does, and its settings (see production_settings).
        connection.settings_dict["CONN_MAX_AGE"] = int(env["DB_CONN_MAX_AGE"])
        settings.DEBUG = False
        self._saved_ca_bundle: str | None = None

    def __enter__(self) -> Bench:
        if self.ca_file is not None:
            self._saved_ca_bundle = os.environ.get("REQUESTS_CA_BUNDLE")
            os.environ["REQUESTS_CA_BUNDLE"] = str(self.ca_file)
        self.stack.start_provider(self.port, "--latency", str(self.latency), ca_file=self.ca_file)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()
        if self.ca_file is not None:
            if self._saved_ca_bundle is None:
                os.environ.pop("REQUESTS_CA_BUNDLE", None)
            else:
                os.environ["REQUESTS_CA_BUNDLE"] = self._saved_ca_bundle

    def use_backend(self, backend: str) -> None:
        """Start the next batches' workers on the database backend `backend` (BACKENDS)."""
        self.worker_env[OPT_IN_BACKEND] = BACKENDS[backend]

    def control(self, path: str, body: dict[str, Any] | None = None) -> None:
        """POST to the fake provider's control API."""
        requests.post(f"{self.url}/_fake/{path}", json=body, timeout=5).raise_for_status()

    def set_latency(self, seconds: float) -> None:
        """Change how long the provider takes per charge."""
        self.control("config", {"latency": seconds})

    def reset(self) -> None:
        """Empty the bench database's tables and the queue's Redis database."""
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
        flush_scratch(self.queue.connection, "the bench")
        # Ids restart, so operation keys (and idempotency keys) repeat: the
        # provider must forget the last batch or it would replay its answers.
        self.control("reset")

    def meter(self, procs: list[Any]) -> CpuMeter:
        """A CPU meter over these worker processes, PostgreSQL, Redis and the provider.

        `backends` is the part of `postgres` spent by the backends the workers talk to
        (every client backend of the bench's database but this process's): the time
        their statements take PostgreSQL, without its background processes (the WAL
        writer, autovacuum). A worker waits for it, statement by statement.
        """
        provider = [p for p in self.stack.procs if p.name == "provider"]
        database = connection.settings_dict["NAME"]
        return CpuMeter(
            {
                "workers": tree_pids(lambda: [p.popen.pid for p in procs]),
                "postgres": processes_named("postgres"),
                "backends": lambda: backend_pids(database),
                "redis": processes_named("redis-server"),
                "provider": tree_pids(lambda: [p.popen.pid for p in provider]),
            }
        )

    def batch(
        self,
        prepare: Callable[[], int],
        *,
        workers: int,
        worker_class: str,
        keep_rows: bool = False,
    ) -> float:
        """Enqueue with `prepare` (returns how many jobs will run), run them; return seconds.

        Also reads the CPU the batch cost per process kind (`self.cpu`), from
        the moment every worker has registered (started up) to the last job's end,
        and the WAL PostgreSQL wrote from the jobs' enqueueing to their end
        (`self.wal_bytes`: what the workers wrote, the database's whole-cluster
        log, so nothing else may write meanwhile). `keep_rows`: the tables keep
        their rows (`make bench-history` measures checkouts beside a year of
        them); the queue and the provider start empty either way.
        """
        if keep_rows:
            flush_scratch(self.queue.connection, "the bench")
            self.control("reset")
        else:
            self.reset()
        expected = prepare()
        wal_from = wal_position()
        path = WORKER_CLASSES.get(worker_class, worker_class)
        procs = [self.stack.start_worker(path, env=self.worker_env) for _ in range(workers)]
        meter = self.meter(procs)
        finished = FinishedJobRegistry(queue=self.queue)
        failed = FailedJobRegistry(queue=self.queue)
        deadline = time.monotonic() + 600
        metered_from: int | None = None  # jobs done when the meter started
        while (done_count := finished.count + failed.count) < expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch did not finish: {finished.count}/{expected}")
            if metered_from is None and Worker.count(queue=self.queue) >= workers:
                meter.start()
                metered_from = done_count
            time.sleep(0.05)
        self.cpu = (
            BatchCpu(meter.stop(), jobs=expected - metered_from)
            if metered_from is not None
            else None
        )
        self.wal_bytes = wal_bytes_since(wal_from)
        for proc in procs:
            self.stack.kill(proc)
        self.stack.procs = [p for p in self.stack.procs if p not in procs]
        if failed.count:
            raise RuntimeError(f"{failed.count} jobs failed; see {self.stack.log_dir}")
        done = [
            j for j in Job.fetch_many(finished.get_job_ids(), connection=self.queue.connection) if j
        ]
        # A finished job has both times: its worker set them as it started and ended it.
        start = min(cast(datetime, j.started_at) for j in done)
        end = max(cast(datetime, j.ended_at) for j in done)
        return (end - start).total_seconds()


def wal_position() -> str:
    """Where PostgreSQL's write-ahead log ends now (the whole cluster's)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_insert_lsn()")
        return str(cursor.fetchone()[0])


def wal_bytes_since(position: str) -> int:
    """Bytes of WAL written since `position` (every index entry and row version is in it)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", [position])
        return int(cursor.fetchone()[0])


@dataclass(frozen=True)
class BatchCpu:
    """CPU seconds by process kind over the metered part of a batch, and its jobs."""

    seconds: dict[str, float]
    jobs: int

    def ms_per(self, jobs_each: int) -> dict[str, float]:
        """CPU milliseconds by process kind per unit of `jobs_each` jobs (a checkout's:
        jobs_per_checkout())."""
        units = self.jobs / jobs_each
        return {
            role: 1000 * seconds / units
            for role, seconds in self.seconds.items()
            if role != "load_generator"  # this process, polling
        }


def jobs_per_checkout() -> int:
    """The checkout's job, and one job per follow-up it queues: none while the ledger line
    and the sales counter run inline (PAYMENTS["INLINE_FOLLOW_UPS"]), on both sides."""
    return 1 if payments_settings().inline_follow_ups else 3


def _orders(n: int) -> list[Order]:
    return [
        create_order(amount=1000 + i, currency="eur", email="bench@example.com") for i in range(n)
    ]


def fenced(n: int, api_side: RoundTrips | None = None) -> Callable[[], int]:
    """Ask for n checkouts; with `api_side`, add up the round trips of the requests."""

    def prepare() -> int:
        for order in _orders(n):
            with counting() as counter:
                # Django closes stale connections at each request's start and
                # end: the request's first query then runs a health check.
                close_old_connections()
                request_checkout(
                    order_id=order.pk,
                    key=f"bench-{order.pk}",
                    payment_method="pm_card_visa",
                    actor="bench",
                )
            if api_side is not None:
                api_side.add(counter.snapshot())
        return jobs_per_checkout() * n

    return prepare


def unfenced(n: int) -> Callable[[], int]:
    def prepare() -> int:
        queue = payments_queue()
        for order in _orders(n):
            queue.enqueue(jobs.unfenced_checkout, order.pk, "pm_card_visa")
        return jobs_per_checkout() * n

    return prepare


def db_round_trips(bench: Bench, n: int, workers: int) -> dict[str, dict[str, Any]]:
    """Database round trips per checkout, fenced and unfenced, worker side and API side.

    The counting worker is FenceWorker with a counter; the API side is the
    fenced checkout request (`request_checkout`, which the API view calls:
    authentication is not counted). The unfenced twin's request only enqueues.
    """
    api = RoundTrips()
    bench.batch(fenced(n, api), workers=workers, worker_class=COUNTING_WORKER)
    fenced_jobs, fenced_wal = recorded(bench.queue.connection), bench.wal_bytes
    bench.batch(unfenced(n), workers=workers, worker_class=COUNTING_WORKER)
    unfenced_jobs, unfenced_wal = recorded(bench.queue.connection), bench.wal_bytes
    result: dict[str, dict[str, Any]] = {}
    for side, by_job, wal in (
        ("fenced", fenced_jobs, fenced_wal),
        ("unfenced", unfenced_jobs, unfenced_wal),
    ):
        worker = sum(by_job.values(), RoundTrips())
        result[side] = {
            "worker_per_checkout": worker.per(n),
            "jobs_per_checkout": worker.jobs / n,
            "by_job": {name: t.per(t.jobs or 1) for name, t in sorted(by_job.items())},
            "wal_bytes_per_checkout": wal / n,
        }
    result["fenced"]["api_per_checkout"] = api.per(n)
    result["unfenced"]["api_per_checkout"] = RoundTrips().per(1)
    return result


def session_reuse(bench: Bench, n: int, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per charge from this process: one kept-alive session vs a new one per charge.

    Sequential charges at the provider's current latency, alternating sides
    and taking each side's best round (noise only adds time). The new session
    is closed after its charge, as `with ProviderClient(...)` does.
    """
    api_key = payments_settings().provider_api_key
    client_of = partial(ProviderClient, bench.url, api_key, connect_timeout=5.0, read_timeout=10.0)
    best = {"reuse": float("inf"), "new_session": float("inf")}
    for r in range(rounds):
        with client_of(session=new_session()) as client:
            _charge(client, f"warm-{r}")  # the kept-alive side starts connected, as a worker does
            started = time.perf_counter()
            for i in range(n):
                _charge(client, f"reuse-{r}-{i}")
            best["reuse"] = min(best["reuse"], (time.perf_counter() - started) / n)
        started = time.perf_counter()
        for i in range(n):
            with client_of() as client:
                _charge(client, f"new-{r}-{i}")
        best["new_session"] = min(best["new_session"], (time.perf_counter() - started) / n)
    bench.control("reset")
    return {
        "charges": n,
        "reuse_ms": best["reuse"] * 1000,
        "new_session_ms": best["new_session"] * 1000,
        "saving_ms": (best["new_session"] - best["reuse"]) * 1000,
    }


def _charge(client: ProviderClient, key: str) -> None:
    client.create_payment_intent(
        amount=1000,
        currency="eur",
        payment_method="pm_card_visa",
        metadata={"step": "bench-session"},
        idempotency_key=key,
    )


def noop(n: int) -> Callable[[], int]:
    def prepare() -> int:
        queue = payments_queue()
        with queue.connection.pipeline() as pipe:
            queue.enqueue_many([queue.prepare_data(jobs.noop) for _ in range(n)], pipeline=pipe)
            pipe.execute()
        return n

    return prepare


def inbox_cost(bench: Bench, n: int, rounds: int) -> dict[str, float]:
    """Per-job milliseconds of a local handler with and without the inbox (in-process)."""
    from rq import SimpleWorker

    order = create_order(amount=1, currency="eur", email="bench@example.com")
    timings: dict[str, list[float]] = {"unprotected": [], "protected": []}
    for _ in range(rounds):
        for name, func in (
            ("unprotected", jobs.local_unprotected),
            ("protected", jobs.local_protected),
        ):
            flush_scratch(bench.queue.connection, "the bench")
            with bench.queue.connection.pipeline() as pipe:
                bench.queue.enqueue_many(
                    [bench.queue.prepare_data(func, (order.pk,)) for _ in range(n)], pipeline=pipe
                )
                pipe.execute()
            worker = SimpleWorker([bench.queue], connection=bench.queue.connection)
            started = time.perf_counter()
            worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
            timings[name].append((time.perf_counter() - started) / n * 1000)
    # The fastest round of each side: noise (other processes on 2 cores) only adds time.
    return {name: min(values) for name, values in timings.items()}


def reconciler_rate(bench: Bench, m: int, worker_class: str) -> dict[str, float]:
    """Settle m uncertain charges (accepted, answer dropped); claims settled per second."""
    prepare = fenced(m)

    def uncertain_only() -> int:
        bench.control("faults", {"mode": "drop_after_accept", "count": m})
        prepare()
        return m  # the checkouts end uncertain; no follow-ups yet

    bench.batch(uncertain_only, workers=2, worker_class=worker_class)
    uncertain = Operation.objects.filter(state=OperationState.UNCERTAIN).count()
    if uncertain != m:
        states = sorted(Operation.objects.values_list("state", flat=True))
        raise RuntimeError(f"expected {m} uncertain operations, found {states}")
    started = time.perf_counter()
    report = reconcile(batch_size=m)
    seconds = time.perf_counter() - started
    return {
        "uncertain": uncertain,
        "settled": report.count("done"),
        "seconds": seconds,
        "per_second": report.count("done") / seconds,
    }


def purge_rate(rows: int, batch_size: int | None = None, rounds: int = 2) -> dict[str, float]:
    """Batched purge of expired inbox rows against one unbounded DELETE of the same rows.

    Each side runs ``rounds`` times, alternating, on ``rows`` freshly inserted
    rows 30 days old; each side's best round counts (the machine is shared).
    The rows are vacuumed before each run, as autovacuum has long visited
    rows past a 7-day retention, and checkpointed (the fill's WAL is setup,
    not purge work). ``batch_size`` caps the rows per batch
    (default ``INBOX["PURGE_BATCH_SIZE"]``); batches adapt to
    ``INBOX["PURGE_BATCH_SECONDS"]``. The longest batch is the longest any
    batch of any round held its row locks, from its DELETE to its COMMIT.
    """
    from inbox.conf import inbox_settings
    from inbox.services import purge_expired

    def fill() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO inbox_inboxentry (consumer, message_id, handled_at) "
                "SELECT 'bench-purge', md5(g::text), now() - interval '30 days' "
                "FROM generate_series(1, %s) g",
                [rows],
            )
            cursor.execute("VACUUM ANALYZE inbox_inboxentry")
            # The fill writes ~500 MB of WAL: with PostgreSQL's default max_wal_size it
            # would set off checkpoints during the measured purge that the purge did not
            # cause. Both sides start from a checkpoint (superuser or pg_checkpoint only).
            try:
                cursor.execute("CHECKPOINT")
            except DatabaseError:
                pass

    def batched() -> tuple[float, Any]:
        fill()
        started = time.perf_counter()
        result = purge_expired(
            consumer="bench-purge", older_than=timedelta(days=7), batch_size=batch_size
        )
        return time.perf_counter() - started, result

    def unbounded() -> tuple[float, int]:
        fill()
        started = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM inbox_inboxentry WHERE consumer = 'bench-purge' "
                "AND handled_at < now() - interval '7 days'"
            )
            deleted = cursor.rowcount
        return time.perf_counter() - started, deleted

    batched_runs, unbounded_runs = [], []
    for _ in range(rounds):
        batched_runs.append(batched())
        unbounded_runs.append(unbounded())
    batched_seconds, result = min(batched_runs, key=lambda run: run[0])
    unbounded_seconds, unbounded_rows = min(unbounded_runs, key=lambda run: run[0])
    batched_rate = result.deleted / batched_seconds
    unbounded_rate = unbounded_rows / unbounded_seconds
    conf = inbox_settings()
    return {
        "rows": result.deleted,
        "batch_size": batch_size or conf.purge_batch_size,
        "batch_seconds_target": conf.purge_batch_seconds,
        "batches": result.batches,
        "largest_batch": result.largest_batch,
        "batched_seconds": batched_seconds,
        "batched_rows_per_second": batched_rate,
        "longest_batch_seconds": max(run[1].longest_batch_seconds for run in batched_runs),
        "unbounded_rows": unbounded_rows,
        "unbounded_seconds": unbounded_seconds,
        "unbounded_rows_per_second": unbounded_rate,
        "ratio_batched_to_unbounded_rate": batched_rate / unbounded_rate,
    }
