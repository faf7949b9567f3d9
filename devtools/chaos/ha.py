"""The chaos run past one host: `python manage.py demo --topology ha`.

The run starts its own parts, on free ports of 127.0.0.1, and owns them:

* a PostgreSQL cluster (initdb into a temporary directory, Debian's binaries),
  migrated directly;
* PgBouncer in transaction pooling in front of it: the API, the workers and the
  recovery loops connect through it (`DATABASE_POOLING=transaction`, kept
  connections health-checked);
* a Redis master, a replica and three sentinels: every process finds the queue
  through them (`REDIS_SENTINELS`);
* three `run_recovery` processes, the usual workers, worker SIGKILLs and the
  fake provider's faults (devtools/chaos/run.py).

While checkouts are posted and charges are in flight it breaks, one after the
other: the Redis master (SIGKILL; Sentinel promotes the replica), PgBouncer
(stopped, started again on its port) and PostgreSQL (a fast shutdown, started
again). Each fault lands on a timeline with the throughput (operations settled
per second) in a window before and after it, and the time until the backlog
it hit was drained. The audit at the end reads the run's own database (this
process is pointed at the cluster for the run), and the usual invariants apply.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from html import escape
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections, connection, connections
from django.db.models import Min, Q

from devtools.chaos.run import SETTLED, ChaosConfig, ChaosResult, read_db, run_chaos
from devtools.topology.servers import PgBouncer, PostgresCluster, RedisHA, wait_until
from devtools.topology.stack import ROOT, Stack
from payments.conf import payments_settings
from payments.models import Operation, OperationEvent

DATABASE = "fence_ha"
REDIS_FAILOVER = "redis master failover"
PGBOUNCER_RESTART = "pgbouncer restart"
POSTGRES_RESTART = "postgresql restart"
FAULTS = (REDIS_FAILOVER, PGBOUNCER_RESTART, POSTGRES_RESTART)
#: PgBouncer's pause after a failed login to PostgreSQL (its default 15 s would turn the
#: PostgreSQL restart into 15 s of refused clients; docs/deployment.md, "Deploying").
SERVER_LOGIN_RETRY = 1


@dataclass(frozen=True)
class HaSchedule:
    """When the faults come: `first_after` s into the checkouts, then one `gap` s after the
    previous one is over; a restarted part stays down `downtime` s. Throughput is counted in
    windows of `window` s before and after each fault."""

    first_after: float = 5.0
    gap: float = 10.0
    downtime: float = 1.0
    window: float = 5.0
    faults: tuple[str, ...] = FAULTS

    def checkout_span(self) -> float:
        """Seconds the checkouts must last so that the last fault still finds charges in flight."""
        return self.first_after + len(self.faults) * (self.gap + 2.0) + self.window


@dataclass
class Fault:
    """One fault as it happened: wall-clock times (epoch seconds)."""

    name: str
    started: float
    recovered: float
    in_flight: int
    detail: str
    #: Filled in at the end, from the settle times in the database.
    settled_per_s_before: float = 0.0
    settled_per_s_after: float = 0.0
    drained_after_s: float | None = None


@dataclass
class HaTopology:
    """The parts the run owns, and the faults it has caused (a chaos.Topology)."""

    schedule: HaSchedule
    log: Callable[[str], None]
    postgres: PostgresCluster = field(default_factory=PostgresCluster)
    redis: RedisHA = field(default_factory=RedisHA)
    bouncer: PgBouncer | None = None
    faults_done: list[Fault] = field(default_factory=list)
    started_at: float = 0.0

    # the parts

    def start(self) -> HaTopology:
        """Start PostgreSQL (and migrate it), PgBouncer before it, Redis with its sentinels."""
        self.postgres.init().start()
        self.postgres.create_database(DATABASE)
        self._migrate()
        self.bouncer = PgBouncer(
            pg_host="127.0.0.1",
            pg_port=self.postgres.port,
            pool_size=20,
            server_login_retry=SERVER_LOGIN_RETRY,
        )
        self.bouncer.start()
        self.redis.start()
        self.log(
            f"topology ha: PostgreSQL :{self.postgres.port} ({self.postgres.dir}), PgBouncer "
            f":{self.bouncer.port} (transaction pooling, 20 server connections), Redis master "
            f":{self.redis.first_master_port}, replica :{self.redis.replica_port}, sentinels "
            + ", ".join(f":{port}" for port in self.redis.sentinel_ports)
        )
        return self

    def _migrate(self) -> None:
        """`migrate` directly against PostgreSQL (never through PgBouncer, docs/deployment.md, "Topology")."""
        env = {**_child_env(), "DATABASE_URL": self.postgres.url(DATABASE)}
        env.pop("DATABASE_POOLING", None)
        for name in ("REDIS_SENTINELS", "REDIS_SENTINEL_MASTER"):
            env.pop(name, None)
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"migrate failed: {done.stdout}{done.stderr}")

    def stop(self) -> None:
        """Stop and remove every part (each stop runs even if another fails)."""
        with contextlib.ExitStack() as parts:
            parts.callback(self.postgres.destroy)
            parts.callback(self.redis.stop)
            if self.bouncer is not None:
                parts.callback(self.bouncer.destroy)

    def env(self) -> dict[str, str]:
        """Every process of the run: the database through PgBouncer, the queue through Sentinel."""
        assert self.bouncer is not None, "start() first"
        return {
            "DATABASE_URL": self.bouncer.url(DATABASE),
            "DATABASE_POOLING": "transaction",
            # Kept connections, as production keeps them: a restart breaks them under the
            # processes, and CONN_HEALTH_CHECKS must replace them.
            "DB_CONN_MAX_AGE": "60",
            **self.redis.env(),
        }

    @contextlib.contextmanager
    def this_process(self) -> Iterator[None]:
        """Point this process (the run's checks and its audit) at the run's own database,
        directly, and at the queue through the sentinels; put both back afterwards."""
        db = connections["default"].settings_dict
        saved_db = dict(db)
        queue = settings.RQ_QUEUES[payments_settings().queue]
        saved_queue = dict(queue)
        connections["default"].close()
        db.update(HOST="127.0.0.1", PORT=str(self.postgres.port), NAME=DATABASE, CONN_MAX_AGE=0)
        queue.pop("URL", None)
        queue.update(
            SENTINELS=[("127.0.0.1", port) for port in self.redis.sentinel_ports],
            MASTER_NAME=self.redis.MASTER_NAME,
            DB=0,
            SENTINEL_KWARGS={"socket_connect_timeout": 1.0, "socket_timeout": 1.0},
        )
        try:
            yield
        finally:
            connections["default"].close()
            db.clear()
            db.update(saved_db)
            queue.clear()
            queue.update(saved_queue)

    # the faults

    def faults(
        self, stack: Stack, result: ChaosResult, stop: threading.Event, say: Callable[[str], None]
    ) -> None:
        """Run the schedule: each fault while checkouts are posted and charges are in flight."""
        self.started_at = time.time()
        actions = {
            REDIS_FAILOVER: self._redis_failover,
            PGBOUNCER_RESTART: self._pgbouncer_restart,
            POSTGRES_RESTART: self._postgres_restart,
        }
        pause = self.schedule.first_after
        try:
            for name in self.schedule.faults:
                if stop.wait(pause):
                    return
                in_flight = self._wait_in_flight(result.run_id, stop)
                started = time.time()
                detail = actions[name]()
                fault = Fault(name, started, time.time(), in_flight, detail)
                self.faults_done.append(fault)
                say(
                    f"  [{started - self.started_at:5.1f}s] {name}: {detail}; "
                    f"{in_flight} operations in flight; checkouts posted so far: "
                    f"{len(result.orders)}"
                )
                pause = self.schedule.gap
        finally:
            connection.close()  # this thread's own connection

    def _wait_in_flight(self, run_id: str, stop: threading.Event, patience: float = 10.0) -> int:
        """Wait (up to `patience` s) until some of the run's operations are in flight; return
        how many are (0 only if none came: the fault is then recorded as hitting none)."""
        deadline = time.monotonic() + patience
        while True:
            in_flight = self._in_flight(run_id)
            if in_flight or time.monotonic() >= deadline or stop.wait(0.1):
                return in_flight

    def _in_flight(self, run_id: str) -> int:
        prefix = f"chaos-{run_id}-"
        return read_db(
            lambda: (
                Operation.objects.filter(
                    Q(key__startswith=prefix) | Q(parent__key__startswith=prefix)
                )
                .exclude(state__in=SETTLED)
                .count()
            )
        )

    def _redis_failover(self) -> str:
        killed = time.monotonic()
        old_port = self.redis.kill_master()
        wait_until(
            lambda: self.redis.master_port() not in (None, old_port), 60, "Sentinel to promote"
        )
        return (
            f"master :{old_port} SIGKILLed, replica :{self.redis.master_port()} promoted "
            f"{time.monotonic() - killed:.1f}s later"
        )

    def _pgbouncer_restart(self) -> str:
        assert self.bouncer is not None
        self.bouncer.stop()
        time.sleep(self.schedule.downtime)
        self.bouncer.start()
        return (
            f"stopped (SIGTERM: clients cut), down {self.schedule.downtime:.0f}s, "
            f"started again on :{self.bouncer.port}"
        )

    def _postgres_restart(self) -> str:
        self.postgres.stop()
        time.sleep(self.schedule.downtime)
        self.postgres.start()
        return (
            f"fast shutdown (sessions terminated), down {self.schedule.downtime:.0f}s, "
            f"started again on :{self.postgres.port}"
        )


def _child_env() -> dict[str, str]:
    """The environment a manage.py child of this process starts from."""
    return {**os.environ, "API_TOKEN": settings.API_TOKEN, "SECRET_KEY": settings.SECRET_KEY}


# --- the run and its timeline --------------------------------------------------------------


def ha_config(config: ChaosConfig, schedule: HaSchedule) -> ChaosConfig:
    """The run's configuration with a topology: 3 recovery processes, checkouts spread over
    the schedule; no Redis flush (the failover loses the queue's unreplicated writes
    instead) and no outage of the webhook endpoint (the restarts cut it off its database;
    a `runserver` started again during one exits at once, as the development server does)."""
    interval = max(config.checkout_interval, schedule.checkout_span() / max(config.orders, 1))
    return replace(
        config,
        recoveries=3,
        flush=False,
        endpoint_down=0.0,
        checkout_interval=round(interval, 3),
    )


def run_ha(
    config: ChaosConfig,
    *,
    log_dir: Path,
    say: Callable[[str], None],
    schedule: HaSchedule | None = None,
) -> ChaosResult:
    """Start the topology, run the chaos scenario on it with its faults, measure, stop it."""
    schedule = schedule or HaSchedule()
    topology = HaTopology(schedule=schedule, log=say)
    try:
        topology.start()
        config = ha_config(config, schedule)
        say(
            f"topology ha: {config.recoveries} recovery processes, a checkout every "
            f"{config.checkout_interval:g}s; no Redis flush and no webhook endpoint outage: "
            f"instead {', '.join(schedule.faults)}, the first {schedule.first_after:g}s in, "
            f"then {schedule.gap:g}s apart"
        )
        with topology.this_process():
            result = run_chaos(config, log_dir=log_dir, say=say, topology=topology)
            if result.report:
                result.report["timeline"] = timeline(result, topology)
                result.violations += topology_violations(result, schedule)
    finally:
        topology.stop()
    return result


def timeline(result: ChaosResult, topology: HaTopology) -> dict[str, object]:
    """Each fault with the throughput around it and the time until its backlog drained.

    Throughput is operations of the run (checkouts, follow-ups, refunds) settled
    per second, from each operation's first settling event. The backlog of a
    fault is every operation created before the fault was over (its part
    answered again); it drained when the last of them settled.
    """
    close_old_connections()
    prefix = f"chaos-{result.run_id}-"
    run_ops = Operation.objects.filter(
        Q(key__startswith=prefix) | Q(parent__key__startswith=prefix)
    )
    settled_at = {
        op: _epoch(at)
        for op, at in OperationEvent.objects.filter(
            operation__in=run_ops, step="", to_state__in=SETTLED
        )
        .values_list("operation_id")
        .annotate(at=Min("created_at"))
        .values_list("operation_id", "at")
    }
    created_at = {op: _epoch(at) for op, at in run_ops.values_list("id", "created_at")}
    settle_times = sorted(settled_at.values())
    window = topology.schedule.window
    start = topology.started_at or min(created_at.values(), default=0.0)
    end = max(settle_times, default=start)
    for fault in topology.faults_done:
        fault.settled_per_s_before = _rate(settle_times, fault.started - window, fault.started)
        fault.settled_per_s_after = _rate(settle_times, fault.recovered, fault.recovered + window)
        backlog = [op for op, at in created_at.items() if at <= fault.recovered]
        if all(op in settled_at for op in backlog):
            last = max((settled_at[op] for op in backlog), default=fault.recovered)
            fault.drained_after_s = round(max(last, fault.recovered) - fault.started, 1)
    per_second = [
        _count(settle_times, start + second, start + second + 1)
        for second in range(int(end - start) + 1)
    ]
    return {
        "window_s": window,
        "settled_per_s_overall": round(len(settle_times) / max(end - start, 1.0), 1),
        "settled_per_second": per_second,
        "faults": [
            {
                **asdict(fault),
                "at_s": round(fault.started - start, 1),
                "outage_s": round(fault.recovered - fault.started, 1),
                "settled_per_s_before": round(fault.settled_per_s_before, 1),
                "settled_per_s_after": round(fault.settled_per_s_after, 1),
            }
            for fault in topology.faults_done
        ],
    }


def topology_violations(result: ChaosResult, schedule: HaSchedule) -> list[str]:
    """What the topology adds to the invariants: every fault happened, and its backlog drained."""
    faults = result.report["timeline"]["faults"]  # type: ignore[index]
    problems = []
    happened = {fault["name"] for fault in faults}
    for name in schedule.faults:
        if name not in happened:
            problems.append(f"the {name} did not happen")
    for fault in faults:
        if fault["drained_after_s"] is None:
            problems.append(f"operations in flight at the {fault['name']} never settled")
    return problems


def timeline_lines(report: dict[str, object]) -> list[str]:
    """The timeline as text lines for the terminal."""
    data = report["timeline"]
    assert isinstance(data, dict)
    lines = [
        f"  timeline (throughput = operations settled per second, windows of "
        f"{data['window_s']:.0f}s; overall {data['settled_per_s_overall']}/s)"
    ]
    for fault in data["faults"]:
        drained = fault["drained_after_s"]
        lines.append(
            f"    +{fault['at_s']:5.1f}s  {fault['name']:<22} outage {fault['outage_s']:4.1f}s  "
            f"in flight {fault['in_flight']:3d}  throughput {fault['settled_per_s_before']:5.1f}"
            f" -> {fault['settled_per_s_after']:5.1f}/s  drained "
            + (f"{drained:.1f}s after" if drained is not None else "never")
        )
        lines.append(f"             {fault['detail']}")
    return lines


def _epoch(moment: datetime) -> float:
    return moment.timestamp()


def _count(times: list[float], low: float, high: float) -> int:
    return sum(1 for t in times if low <= t < high)


def _rate(times: list[float], low: float, high: float) -> float:
    return _count(times, low, high) / max(high - low, 1e-9)


def timeline_html(report: dict[str, object]) -> str:
    """The timeline as an HTML section: settled per second with each fault marked, and a table."""
    data = report.get("timeline")
    if not isinstance(data, dict):
        return ""
    per_second: list[int] = data["settled_per_second"]
    top = max(per_second, default=1) or 1
    step, height = 8, 120
    width = max(step * len(per_second), 200)
    bars = "".join(
        f'<rect x="{i * step}" y="{height - int(height * n / top)}" width="{step - 1}" '
        f'height="{int(height * n / top)}" fill="#1565c0"/>'
        for i, n in enumerate(per_second)
    )
    marks = "".join(
        f'<rect x="{int(fault["at_s"] * step)}" y="0" width="{max(2, int(fault["outage_s"] * step))}"'
        f' height="{height}" fill="#c62828" opacity="0.35"/>'
        f'<text x="{int(fault["at_s"] * step) + 3}" y="{14 + 14 * index}" font-size="12">'
        f"{escape(fault['name'])}</text>"
        for index, fault in enumerate(data["faults"])
    )
    rows = "".join(
        f"<tr><td>+{fault['at_s']} s</td><td>{escape(fault['name'])}</td>"
        f"<td>{fault['outage_s']} s</td><td>{fault['in_flight']}</td>"
        f"<td>{fault['settled_per_s_before']} &rarr; {fault['settled_per_s_after']}</td>"
        f"<td>{fault['drained_after_s'] if fault['drained_after_s'] is not None else 'never'}</td>"
        f"<td>{escape(fault['detail'])}</td></tr>"
        for fault in data["faults"]
    )
    return (
        "<h2>Topology faults on a timeline</h2>"
        f"<p>Operations settled per second (checkouts, follow-ups, refunds); red: each fault "
        f"until its part answered again. Throughput in windows of {data['window_s']} s before "
        "the fault and after its part answered again; drained: seconds from the fault until "
        "the last operation created before it was over had settled.</p>"
        f'<svg width="{width}" height="{height + 4}" role="img">{bars}{marks}</svg>'
        "<table><tr><td>at</td><td>fault</td><td>outage</td><td>in flight</td>"
        "<td>settled/s before &rarr; after</td><td>drained (s)</td><td>what happened</td></tr>"
        f"{rows}</table>"
    )
