"""Real PgBouncer, Redis (master + replica) and Sentinel processes on 127.0.0.1 for a test.

Each runs from a temporary directory on free ports, with no persistence, and is
stopped (SIGTERM, then SIGKILL) by the fixture that started it. The system's
own PostgreSQL and Redis are never reconfigured: PgBouncer points at the
running PostgreSQL (the test database), the Redis servers are new processes.
The binaries are Debian's (`make test` installs pgbouncer and redis-sentinel).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests
from psycopg import ClientCursor
from redis import Redis
from redis.sentinel import MasterNotFoundError, Sentinel

from payments.models import Invoice, LedgerEntry, Operation, OperationState, Order, OrderStatus
from tests.support.workers import ROOT

#: `make test` and CI install the binaries first: there a missing one fails the test.
REQUIRED = os.environ.get("REQUIRE_TOPOLOGY_BINARIES") == "1"
VENV_BIN = Path(sys.executable).parent


def binary(name: str) -> str:
    """Return the path of a Debian binary (also in /usr/sbin), or skip (fail under make test)."""
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )
    if found is None:
        message = f"{name} is not installed (make test installs it: apt-get install {name})"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until `condition` holds; return the seconds it took, fail after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen, *, kill: bool = False) -> None:
    """Stop a process started in its own session (its whole group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        except ProcessLookupError:
            return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def workdir(prefix: str) -> Path:
    """A temporary directory readable by an unprivileged user (PgBouncer drops root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


# --- PgBouncer -----------------------------------------------------------------------------


class PgBouncer:
    """A PgBouncer in transaction pooling in front of the running PostgreSQL.

    Every database name is passed through (`* = host=... port=...`), so the
    pytest-django test database is reachable as it is. `pool_size` server
    connections per database and user: with 1, every client's transactions run
    one after the other on one PostgreSQL session, so any state a client left
    in its session would be seen, or broken, by the next.
    """

    def __init__(self, *, pg_host: str, pg_port: int, pool_size: int = 1) -> None:
        self.pg_host, self.pg_port, self.pool_size = pg_host, pg_port, pool_size
        self.port = free_port()
        self.dir = workdir("pgbouncer-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> PgBouncer:
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        config = self.dir / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={self.pg_host} port={self.pg_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 200\n"
            "admin_users = postgres\n"
            "server_lifetime = 3600\n"
            "stats_period = 1\n"
        )
        for path in self.dir.iterdir():
            path.chmod(0o644)
        command = [binary("pgbouncer")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root: it drops to this user
            command += ["-u", _unprivileged_user()]
        self.log = (self.dir / "pgbouncer.log").open("wb")
        self.proc = subprocess.Popen(
            [*command, str(config)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(lambda: port_open(self.port) or self.proc.poll() is not None, 10, "pgbouncer")
        if self.proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited: {self.log_text()}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_text(self) -> str:
        return (self.dir / "pgbouncer.log").read_text(errors="replace")

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str, **options: Any) -> psycopg.Connection:
        """A client connection through PgBouncer (prepared statements off unless asked)."""
        options.setdefault("prepare_threshold", None)
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname=database,
            autocommit=True,
            **options,
        )

    def admin(self, command: str) -> list[dict[str, Any]]:
        """Run a command on PgBouncer's admin console (simple protocol), rows as dicts."""
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname="pgbouncer",
            autocommit=True,
            cursor_factory=ClientCursor,
        ) as conn:
            cursor = conn.execute(command)
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def pool(self, database: str) -> dict[str, Any]:
        return next(row for row in self.admin("SHOW POOLS") if row["database"] == database)

    def stats(self, database: str) -> dict[str, Any]:
        return next(row for row in self.admin("SHOW STATS") if row["database"] == database)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("no unprivileged user to run pgbouncer as")


# --- Redis master, replica and sentinels ---------------------------------------------------


class RedisHA:
    """A Redis master, one replica and three sentinels (quorum 2), all new processes.

    `down_after` is each sentinel's down-after-milliseconds: the master counts
    as down after that long without an answer, then the sentinels elect a
    leader and it promotes the replica.
    """

    MASTER_NAME = "fence-topology"

    def __init__(self, *, down_after_ms: int = 1000) -> None:
        self.down_after_ms = down_after_ms
        self.dir = workdir("redis-ha-")
        self.first_master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen] = {}

    # processes

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.dir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def _server(self, name: str, port: int, *extra: str) -> None:
        data = self.dir / name
        data.mkdir()
        self._start(
            name,
            [
                binary("redis-server"),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(data),
                "--protected-mode",
                "no",
                "--repl-diskless-sync-delay",  # a replica syncs at once, not after 5 s
                "0",
                *extra,
            ],
        )

    def start(self) -> RedisHA:
        self._server("master", self.first_master_port)
        self._server(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.first_master_port)
        )
        wait_until(lambda: self.replica_link_up(), 15, "the replica to sync")
        for index, port in enumerate(self.sentinel_ports):
            config = self.dir / f"sentinel-{index}.conf"
            config.write_text(
                f"port {port}\n"
                "bind 127.0.0.1\n"
                "protected-mode no\n"
                f"dir {self.dir}\n"
                f"sentinel monitor {self.MASTER_NAME} 127.0.0.1 {self.first_master_port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER_NAME} 10000\n"
                f"sentinel parallel-syncs {self.MASTER_NAME} 1\n"
            )
            self._start(f"sentinel-{index}", [binary("redis-sentinel"), str(config)])
        wait_until(self._sentinels_see_everyone, 20, "the sentinels to find each other")
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill_master(self) -> int:
        """SIGKILL the current master process; return its port."""
        port = self.master_port()
        name = "master" if port == self.first_master_port else "replica"
        stop_process(self.procs[name], kill=True)
        return port

    # what the servers and sentinels say

    def client(self, port: int, **options: Any) -> Redis:
        return Redis(host="127.0.0.1", port=port, socket_timeout=1, **options)

    def sentinel_client(self, index: int = 0) -> Redis:
        return self.client(self.sentinel_ports[index], decode_responses=True)

    def master_address(self) -> tuple[str, int] | None:
        """Where a client finds the master now, as the app does (redis-py's discovery).

        None during a failover: every sentinel still flags the old master down
        and none has switched to the promoted replica yet.
        """
        sentinel = Sentinel(
            [("127.0.0.1", port) for port in self.sentinel_ports],
            sentinel_kwargs={"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        )
        try:
            host, port = sentinel.discover_master(self.MASTER_NAME)
        except MasterNotFoundError:
            return None
        return (str(host), int(port))

    def master_port(self) -> int | None:
        address = self.master_address()
        return address[1] if address else None

    def replica_link_up(self) -> bool:
        try:
            info = self.client(self.replica_port).info("replication")
        except Exception:
            return False
        return info.get("master_link_status") == "up"

    def break_replication(self) -> None:
        """Cut the replica off the master: what the master is sent from now on never arrives.

        The replica is told a password the master does not have, and its link
        is closed: its reconnects fail their AUTH, so writes to the master stay
        there, as writes a master took and had not replicated when it died.
        """
        self.client(self.replica_port).config_set("masterauth", "not-the-masters-password")
        self.client(self.first_master_port).client_kill_filter(_type="slave")
        wait_until(lambda: not self.replica_link_up(), 5, "the replica's link to go down")

    def _sentinels_see_everyone(self) -> bool:
        try:
            for index in range(len(self.sentinel_ports)):
                master = self.sentinel_client(index).sentinel_master(self.MASTER_NAME)
                if int(master["num-other-sentinels"]) < 2 or int(master["num-slaves"]) < 1:
                    return False
        except Exception:
            return False
        return True

    def env(self) -> dict[str, str]:
        """What a process of the app needs to find the queue through the sentinels."""
        return {
            "REDIS_SENTINELS": ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports),
            "REDIS_SENTINEL_MASTER": self.MASTER_NAME,
            # Host and port are the sentinels' to say; the URL gives the database.
            "REDIS_URL": "redis://ignored-with-sentinels/0",
        }


# --- the web tier ---------------------------------------------------------------------------


def start_gunicorn(
    env: dict[str, str], port: int, log: Path, *, workers: int = 2
) -> subprocess.Popen:
    """Start `gunicorn -c gunicorn.conf.py` (the production web process) on `port`."""
    with log.open("ab") as output:
        proc = subprocess.Popen(
            [str(VENV_BIN / "gunicorn"), "-c", "gunicorn.conf.py"],
            cwd=ROOT,
            env={**env, "GUNICORN_BIND": f"127.0.0.1:{port}", "WEB_CONCURRENCY": str(workers)},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_until(lambda: port_open(port) or proc.poll() is not None, 30, "gunicorn")
    if proc.poll() is not None:
        raise RuntimeError(f"gunicorn exited: {log.read_text(errors='replace')[-2000:]}")
    return proc


class Api:
    """The JSON API of a running web process, as a shop's backend calls it."""

    def __init__(self, port: int, token: str) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def checkout(self, key: str, amount: int = 1500) -> tuple[int, str]:
        """Create an order and ask for its checkout; return (order id, operation key)."""
        order = self.session.post(
            f"{self.base}/api/orders",
            json={"amount": amount, "currency": "eur", "email": "topology@example.com"},
            timeout=30,
        )
        assert order.status_code == 201, order.text
        order_id = int(order.json()["id"])
        accepted = self.session.post(
            f"{self.base}/api/orders/{order_id}/checkout",
            json={"payment_method": "pm_card_visa"},
            headers={"Idempotency-Key": key},
            timeout=30,
        )
        assert accepted.status_code == 202, accepted.text
        return order_id, str(accepted.json()["operation"])

    def get(self, path: str, **headers: str) -> requests.Response:
        return self.session.get(f"{self.base}{path}", headers=headers, timeout=30)


# --- the app's workers and recovery loops ------------------------------------------------


class Fleet:
    """`rqworker` processes kept running (a dead one is replaced, as systemd would) and
    `run_recovery` loops, each writing its output to a file of its own."""

    def __init__(
        self, env: dict[str, str], name: str, logs: Path, *, workers: int = 2, recoveries: int = 1
    ) -> None:
        self.env, self.name, self.logs = {**env, "PYTHONUNBUFFERED": "1"}, name, logs
        self.restarts = 0
        self.workers = [self._worker(f"{name}-{index}") for index in range(workers)]
        self.recoveries = [
            self._start(f"recovery-{index}", _RECOVERY) for index in range(recoveries)
        ]

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("ab") as log:
            return subprocess.Popen(
                [sys.executable, "manage.py", *args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _worker(self, name: str) -> subprocess.Popen:
        args = ["rqworker", "payments", "--with-scheduler", "--name", name, "--worker-ttl", "30"]
        return self._start(name, args)

    def poll(self) -> None:
        """Replace a worker that exited (under a new name: RQ refuses a live one's)."""
        for index, proc in enumerate(self.workers):
            if proc.poll() is not None:
                self.restarts += 1
                self.workers[index] = self._worker(f"{self.name}-{index}-{self.restarts}")

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Keep the workers running until `condition` holds; return the seconds it took."""

        def check() -> bool:
            self.poll()
            return condition()

        return wait_until(check, timeout, what)

    def stop(self) -> None:
        for proc in [*self.workers, *self.recoveries]:
            stop_process(proc)

    def output(self, prefix: str = "") -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.logs.glob(f"{prefix}*.log"))
        )

    def swept(self) -> int:
        """How many operations the recovery loops' sweeps dispatched again (their output)."""
        return sum(
            int(match)
            for path in self.logs.glob("recovery-*.log")
            for match in re.findall(r"^swept (\d+) of", path.read_text(), re.MULTILINE)
        )


_RECOVERY = ["run_recovery", "--interval", "0.5"]


# --- what a run must end with ------------------------------------------------------------


def assert_paid_once(provider, orders: dict[str, int]) -> None:
    """Each order paid by one provider success, with one invoice and one ledger line."""
    for key, order_id in orders.items():
        assert Order.objects.get(pk=order_id).status == OrderStatus.PAID, key
        assert provider.state.succeeded_count(metadata={"operation_key": key}) == 1, key
        assert provider.state.succeeded_count(metadata={"order_id": str(order_id)}) == 1, key
        assert Invoice.objects.filter(order_id=order_id).count() == 1, key
        assert LedgerEntry.objects.filter(order_id=order_id).count() == 1, key


def all_settled(count: int) -> bool:
    ops = Operation.objects.all()
    return ops.count() >= count and not ops.exclude(state=OperationState.SUCCEEDED).exists()
