"""The web tier under load: `POST /api/orders/<id>/checkout` at a fixed concurrency.

A small load generator (threads, one keep-alive `requests.Session` each) sends a
fixed list of checkout requests to a real gunicorn (`gunicorn -c gunicorn.conf.py`,
the production web process) and measures requests per second, p50 and p99
latency and the answers' status codes. Every order is asked for by several
requests with the same Idempotency-Key, sent one after the other from the list
so that they are in flight together: exactly one of them may create the
operation, the others must be answered 202 as replays, and the database must
hold one operation per key.

`web_tier` runs the same load against gunicorn on direct PostgreSQL connections
and through PgBouncer in transaction pooling (`DATABASE_POOLING=transaction`).
PgBouncer is a process of its own on a free port (devtools.topology, as for
the topology tests; Debian's binary, `make topology` installs it).
"""

from __future__ import annotations

import math
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from django.db import connection
from django.db.models import Count

from devtools.bench.cpu import CpuMeter, backend_pids, tree_pids
from devtools.topology.servers import PgBouncer, port_open, stop_process, wait_until
from devtools.topology.stack import ROOT, free_port
from payments.checkout.orders import create_order
from payments.models import Operation

#: What the load's gunicorn gets on top of the caller's environment: production's
#: settings (DEBUG off, connections kept 60 s), plain HTTP on loopback as behind
#: a TLS-terminating proxy. The API's per-client throttle (600/min by default,
#: counted per process without REDIS_CACHE_URL) would turn the load into 429s:
#: the bench measures the request, not the limit.
LOAD_ENV = {
    "DEBUG": "0",
    "SECURE_SSL_REDIRECT": "0",
    "API_RATE_PER_CLIENT": "1000000/min",
    "DB_CONN_MAX_AGE": "60",
    "LOG_LEVEL": "WARNING",
    "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
}


@dataclass(frozen=True)
class LoadShape:
    """How much load: `orders` checkouts, each sent `duplicates` times, `concurrency` at once."""

    orders: int
    duplicates: int
    concurrency: int

    @property
    def requests(self) -> int:
        return self.orders * self.duplicates


@dataclass(frozen=True)
class Call:
    """One checkout request of the plan."""

    order_id: int
    key: str


@dataclass(frozen=True)
class Answer:
    """What one request got back; status 0 is a connection error (no HTTP answer)."""

    key: str
    status: int
    replayed: bool
    operation: str
    started: float
    ended: float

    @property
    def latency(self) -> float:
        return self.ended - self.started


# --- the load --------------------------------------------------------------------------------


def plan_checkouts(shape: LoadShape, run_id: str) -> list[Call]:
    """Create `shape.orders` orders (in this process) and the requests that check them out.

    A key's duplicates are next to each other in the list, so that the clients
    take them at the same moment and they reach the server together.
    """
    calls = []
    for index in range(shape.orders):
        order = create_order(amount=1000 + index, currency="eur", email="load@example.com")
        calls += [Call(order.pk, f"load-{run_id}-{order.pk}")] * shape.duplicates
    return calls


def run_load(base_url: str, token: str, calls: list[Call], concurrency: int) -> list[Answer]:
    """Send every call from `concurrency` client threads; return the answers (any order).

    Each client keeps one session and takes the next call from a shared queue
    as soon as its last one is answered. The session keeps its connection
    where the server allows it; gunicorn's sync workers (production's default)
    close each one after its answer, so there every request connects anew.
    """
    todo: queue.SimpleQueue[Call] = queue.SimpleQueue()
    for call in calls:
        todo.put(call)
    answers: list[Answer] = []  # list.append is atomic: the clients share it
    ready = threading.Barrier(concurrency)

    def client() -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {token}"
            ready.wait()
            while True:
                try:
                    call = todo.get_nowait()
                except queue.Empty:
                    return
                answers.append(_send(session, base_url, call))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def _send(session: requests.Session, base_url: str, call: Call) -> Answer:
    started = time.perf_counter()
    try:
        response = session.post(
            f"{base_url}/api/orders/{call.order_id}/checkout",
            json={"payment_method": "pm_card_visa"},
            headers={"Idempotency-Key": call.key},
            timeout=60,
        )
    except requests.RequestException:
        return Answer(call.key, 0, False, "", started, time.perf_counter())
    ended = time.perf_counter()
    operation = str(response.json().get("operation", "")) if response.status_code == 202 else ""
    replayed = response.headers.get("Idempotent-Replayed", "").lower() == "true"
    return Answer(call.key, response.status_code, replayed, operation, started, ended)


# --- what the load measured -------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of `values`."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def operations_per_key(keys: set[str]) -> dict[str, int]:
    """How many operation rows each key has in the database (0 for none)."""
    rows = Operation.objects.filter(key__in=keys).values("key").annotate(n=Count("pk")).order_by()
    found = {row["key"]: row["n"] for row in rows}
    return {key: found.get(key, 0) for key in keys}


def summarize(answers: list[Answer], operations: dict[str, int]) -> dict[str, Any]:
    """Throughput, latency and the fence's answer to duplicates, as JSON-ready figures.

    `created_per_key` counts the answers that were not replays: exactly one per
    key. `keys_in_flight_together` counts the keys whose duplicates were all
    sent before any of them was answered (context: how concurrent they were).
    """
    seconds = max(a.ended for a in answers) - min(a.started for a in answers)
    latencies = [a.latency for a in answers]
    by_key: dict[str, list[Answer]] = {}
    for answer in answers:
        by_key.setdefault(answer.key, []).append(answer)
    created = [sum(a.status == 202 and not a.replayed for a in group) for group in by_key.values()]
    operation_names = [{a.operation for a in group if a.status == 202} for group in by_key.values()]
    statuses = Counter(str(a.status) for a in answers)
    return {
        "requests": len(answers),
        "keys": len(by_key),
        "seconds": seconds,
        "requests_per_second": len(answers) / seconds,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "statuses": dict(sorted(statuses.items())),
        "server_errors": sum(a.status >= 500 for a in answers),
        "connection_errors": statuses.get("0", 0),
        "not_202": sum(a.status != 202 for a in answers),
        "created_per_key": {"min": min(created), "max": max(created)},
        "operation_keys_per_key_max": max(len(names) for names in operation_names),
        "operations_per_key": {"min": min(operations.values()), "max": max(operations.values())},
        "keys_in_flight_together": sum(
            max(a.started for a in group) < min(a.ended for a in group) for group in by_key.values()
        ),
    }


def violations(figures: dict[str, Any]) -> list[str]:
    """What the fence promised and a load run broke: empty when all held."""
    broken = []
    if figures["server_errors"] or figures["connection_errors"]:
        broken.append(
            f"{figures['server_errors']} 5xx and {figures['connection_errors']} "
            "connection errors (goal 0)"
        )
    if figures["not_202"]:
        broken.append(f"{figures['not_202']} answers other than 202: {figures['statuses']}")
    if figures["created_per_key"] != {"min": 1, "max": 1}:
        broken.append(f"answers that created an operation per key: {figures['created_per_key']}")
    if figures["operations_per_key"] != {"min": 1, "max": 1}:
        broken.append(f"operations per key in the database: {figures['operations_per_key']}")
    if figures["operation_keys_per_key_max"] > 1:
        broken.append("duplicates of one key were answered with different operations")
    return broken


# --- gunicorn -------------------------------------------------------------------------------


@contextmanager
def gunicorn(env: dict[str, str], *, workers: int, log: Path) -> Iterator[tuple[str, int]]:
    """Run `gunicorn -c gunicorn.conf.py` (sync workers) on a free port; yield (URL, pid).

    Without a control socket: its default path (~/.gunicorn/gunicorn.ctl) is one
    per user, and another gunicorn on the machine may be using it.
    """
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as output:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "gunicorn"),
                *("-c", "gunicorn.conf.py", "--no-control-socket"),
            ],
            cwd=ROOT,
            env={
                **env,
                "GUNICORN_BIND": f"127.0.0.1:{port}",
                "WEB_CONCURRENCY": str(workers),
                "GUNICORN_THREADS": "1",
            },
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: port_open(port) or proc.poll() is not None, 60, "gunicorn")
        if proc.poll() is not None:
            raise RuntimeError(f"gunicorn exited: {log.read_text(errors='replace')[-2000:]}")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop_process(proc)


# --- one side, and the comparison -----------------------------------------------------------


def measure(
    env: dict[str, str],
    *,
    workers: int,
    shape: LoadShape,
    run_id: str,
    log: Path,
    pooler_pid: int | None = None,
) -> dict[str, Any]:
    """Start gunicorn with `env`, warm it up, run the load, read the rows; return the figures.

    gunicorn runs with DEBUG off, so with secrets of this run's own (the
    development ones are refused there); the API token is the bootstrap
    client's, as `API_TOKEN` is. The warm-up (one request per client on orders
    of its own, not counted) lets every worker import the app and open its
    connections first, and proves the workers booted: RuntimeError otherwise.
    The CPU the measured requests cost is read per process (devtools.bench.cpu):
    gunicorn, PostgreSQL's backends of this database, PgBouncer (`pooler_pid`)
    and this process, the load generator.
    """
    token = secrets.token_urlsafe(32)
    run_env = {**env, **LOAD_ENV, "API_TOKEN": token, "SECRET_KEY": secrets.token_urlsafe(50)}
    with gunicorn(run_env, workers=workers, log=log) as (base_url, pid):
        warm = LoadShape(orders=shape.concurrency, duplicates=1, concurrency=shape.concurrency)
        warm_calls = plan_checkouts(warm, f"warm-{run_id}")
        statuses = Counter(
            a.status for a in run_load(base_url, token, warm_calls, warm.concurrency)
        )
        if set(statuses) != {202}:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the warm-up got {dict(statuses)}, not only 202: {tail}")
        calls = plan_checkouts(shape, run_id)
        database = str(connection.settings_dict["NAME"])
        roles = {"gunicorn": tree_pids(lambda: [pid]), "postgresql": lambda: backend_pids(database)}
        if pooler_pid is not None:
            roles["pgbouncer"] = lambda: [pooler_pid]
        meter = CpuMeter(roles)
        load_average = os.getloadavg()[0]
        meter.start()
        answers = run_load(base_url, token, calls, shape.concurrency)
        cpu = meter.stop()
    figures = summarize(answers, operations_per_key({call.key for call in calls}))
    figures["cpu_ms_per_request"] = {
        role: seconds * 1000 / len(answers) for role, seconds in cpu.items()
    }
    # How much of the machine the run got: below its cores, other processes had the rest.
    figures["cores_busy"] = sum(cpu.values()) / figures["seconds"]
    figures["load_average_before"] = load_average
    figures["violations"] = violations(figures)
    if len(answers) != len(calls):  # a client thread died: its requests went unanswered
        figures["violations"].append(f"{len(calls) - len(answers)} requests got no answer")
    return figures


def web_tier(
    *,
    database: dict[str, Any],
    workers: int,
    shape: LoadShape,
    pool_sizes: list[int],
    rounds: int,
    log_dir: Path,
    reset: Callable[[], None],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The same load on gunicorn over direct connections and through PgBouncer, side by side.

    `database` is Django's settings dict of the (bench) database. Sides
    alternate for `rounds` rounds; each side keeps its fastest round's
    throughput and latency (other processes on the machine only slow a round
    down), and the 5xx and per-key counts of all its rounds.
    """
    sides = ["direct", *(f"pgbouncer_pool_{size}" for size in pool_sizes)]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for index in range(rounds):
        for side in sides:
            say(f"web tier, round {index + 1}/{rounds}: {side}, {workers} gunicorn workers...")
            reset()
            runs[side].append(
                _run_side(
                    side,
                    database,
                    workers=workers,
                    shape=shape,
                    run_id=f"{side}-{index}",
                    log=log_dir / f"gunicorn-{side}.log",
                )
            )
    reset()
    return {
        "workers": workers,
        "orders": shape.orders,
        "duplicates": shape.duplicates,
        "concurrency": shape.concurrency,
        "rounds": rounds,
        "sides": {side: _best(side_runs) for side, side_runs in runs.items()},
    }


def _run_side(side: str, database: dict[str, Any], **measure_options: Any) -> dict[str, Any]:
    """One run of one side: `direct`, or `pgbouncer_pool_<n>` (a PgBouncer of its own)."""
    host, port = database["HOST"] or "127.0.0.1", int(database["PORT"] or 5432)
    user, name = database["USER"] or "postgres", database["NAME"]
    env = {**os.environ, "DATABASE_URL": f"postgres://{user}@{host}:{port}/{name}"}
    env.pop("DATABASE_POOLING", None)
    if side == "direct":
        return measure(env, **measure_options)
    size = int(side.rsplit("_", 1)[1])
    bouncer = PgBouncer(pg_host=host, pg_port=port, pool_size=size).start()
    try:
        env.update(DATABASE_URL=bouncer.url(name), DATABASE_POOLING="transaction")
        return measure(
            env, pooler_pid=bouncer.proc.pid if bouncer.proc else None, **measure_options
        )
    finally:
        bouncer.destroy()


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest round's figures, with the errors and per-key counts of every round."""
    best = dict(max(runs, key=lambda r: r["requests_per_second"]))
    best["server_errors"] = sum(r["server_errors"] for r in runs)
    best["connection_errors"] = sum(r["connection_errors"] for r in runs)
    best["operations_per_key"] = {
        "min": min(r["operations_per_key"]["min"] for r in runs),
        "max": max(r["operations_per_key"]["max"] for r in runs),
    }
    best["violations"] = [v for r in runs for v in r["violations"]]
    return best
