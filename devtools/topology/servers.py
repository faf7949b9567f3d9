"""Real PostgreSQL, PgBouncer, Redis (master + replica) and Sentinel processes on 127.0.0.1.

The chaos run's `--topology ha` (devtools/chaos/ha.py) and the topology tests
(tests/topology) start them from here. Each runs from a temporary directory on
free ports and is stopped (SIGTERM, then SIGKILL) by whoever started it. The
system's own PostgreSQL and Redis are never reconfigured: a PgBouncer points at
a PostgreSQL it is given (the running one, or a `PostgresCluster` started
here), the Redis servers are new processes. The binaries are Debian's
(`make topology` installs pgbouncer and redis-sentinel; PostgreSQL's are under
/usr/lib/postgresql/<version>/bin).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import ClientCursor
from redis import Redis
from redis.sentinel import MasterNotFoundError, Sentinel

from devtools.topology.stack import free_port


class MissingBinary(RuntimeError):
    """A binary the topology needs is not installed (`make topology` installs it)."""


def binary(name: str) -> str:
    """Return the path of a Debian binary (also in /usr/sbin); raise MissingBinary if absent."""
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )
    if found is None:
        raise MissingBinary(
            f"{name} is not installed (make topology installs it: apt-get install {name})"
        )
    return found


def postgres_bin_dir() -> Path:
    """The newest Debian PostgreSQL's bin directory (initdb, pg_ctl), or MissingBinary."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if not found:
        raise MissingBinary("PostgreSQL's server binaries are not under /usr/lib/postgresql/*/bin")
    return found[-1].parent


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until `condition` holds; return the seconds it took, raise after `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():
            return time.monotonic() - started
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen, *, kill: bool = False) -> None:
    """Stop a process started in its own session (its whole group, even when its leader
    has ended: a killed worker's children, RQ's scheduler, would live on)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except ProcessLookupError:
        pass  # the whole group has ended
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


def unprivileged_user() -> str:
    """The user PgBouncer and PostgreSQL run as when this process is root."""
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("no unprivileged user to run pgbouncer or postgres as")


# --- PostgreSQL ----------------------------------------------------------------------------


class PostgresCluster:
    """A PostgreSQL cluster of its own (initdb into a temporary directory), on a free port.

    Whoever starts it owns it: `stop()` and `start()` again restart it (a fast
    shutdown: sessions are cut, open transactions rolled back), `destroy()`
    removes it. Durability is traded for speed (fsync off): nothing here
    outlives the process that made it, and a clean shutdown writes everything.
    Run as root, the server runs as the `postgres` user.
    """

    def __init__(self, *, max_connections: int = 100) -> None:
        self.bin = postgres_bin_dir()
        self.port = free_port()
        self.dir = workdir("postgres-")
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.max_connections = max_connections
        self._user = unprivileged_user() if os.geteuid() == 0 else None

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if self._user is not None:
            command = ["runuser", "-u", self._user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {done.stdout}{done.stderr}")

    def init(self) -> PostgresCluster:
        """Create the cluster (trust authentication for 127.0.0.1, user postgres)."""
        if self._user is not None:
            shutil.chown(self.dir, self._user)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
        )
        return self

    def start(self) -> PostgresCluster:
        """Start the server and wait until it accepts connections."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
            f"-c max_connections={self.max_connections} -c fsync=off "
            "-c full_page_writes=off -c synchronous_commit=off"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")
        return self

    def stop(self) -> None:
        """Stop the server (fast: connected sessions are terminated), if it runs."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        """Stop the server and remove the cluster's files."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')


# --- PgBouncer -----------------------------------------------------------------------------


class PgBouncer:
    """A PgBouncer in transaction pooling in front of a PostgreSQL.

    Every database name is passed through (`* = host=... port=...`), so any
    database of that server (the pytest-django test database too) is reachable
    as it is. `pool_size` server connections per database and user: with 1,
    every client's transactions run one after the other on one PostgreSQL
    session, so any state a client left in its session would be seen, or
    broken, by the next. `stop()` then `start()` again is a restart on the
    same port. `server_login_retry`: seconds PgBouncer refuses every client
    after a failed login to PostgreSQL (its default, 15, turns a PostgreSQL
    restart of one second into 15 s of errors; docs/deployment.md, "Deploying").
    """

    def __init__(
        self,
        *,
        pg_host: str,
        pg_port: int,
        pool_size: int = 1,
        server_login_retry: int | None = None,
    ) -> None:
        self.pg_host, self.pg_port, self.pool_size = pg_host, pg_port, pool_size
        self.server_login_retry = server_login_retry
        self.port = free_port()
        self.dir = workdir("pgbouncer-")
        self.proc: subprocess.Popen | None = None

    def _write_config(self) -> Path:
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
            + (
                f"server_login_retry = {self.server_login_retry}\n"
                if self.server_login_retry is not None
                else ""
            )
        )
        for path in self.dir.iterdir():
            path.chmod(0o644)
        return config

    def start(self) -> PgBouncer:
        """Start PgBouncer and wait until it listens."""
        command = [binary("pgbouncer")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root: it drops to this user
            command += ["-u", unprivileged_user()]
        config = self._write_config()
        with (self.dir / "pgbouncer.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*command, str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self.proc
        wait_until(lambda: port_open(self.port) or proc.poll() is not None, 10, "pgbouncer")
        if proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited: {self.log_text()}")
        return self

    def stop(self) -> None:
        """Stop PgBouncer (SIGTERM: an immediate shutdown, clients cut); keep its files."""
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def destroy(self) -> None:
        """Stop PgBouncer and remove its files."""
        self.stop()
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
        with (self.dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True
            )
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
        """Start the master and the replica, then the sentinels; wait until they agree."""
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
        """SIGKILL every process and remove the files."""
        for proc in self.procs.values():
            stop_process(proc, kill=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill_master(self) -> int:
        """SIGKILL the current master process; return its port."""
        port = self.master_port()
        name = "master" if port == self.first_master_port else "replica"
        stop_process(self.procs[name], kill=True)
        return port or 0

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
            info: dict[str, Any] = self.client(self.replica_port).info("replication")  # type: ignore[assignment]
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

    def env(self, db: int = 0) -> dict[str, str]:
        """What a process of the app needs to find the queue through the sentinels."""
        return {
            "REDIS_SENTINELS": ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports),
            "REDIS_SENTINEL_MASTER": self.MASTER_NAME,
            # Host and port are the sentinels' to say; the URL gives the database.
            "REDIS_URL": f"redis://ignored-with-sentinels/{db}",
        }
