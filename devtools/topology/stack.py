"""Start and stop the local stack as real processes: fake provider, API server, workers,
recovery loop. Used by `manage.py demo` and `manage.py runstack` (make run).

Each process runs in its own process group so that a "crash" can SIGKILL a
worker together with its work horse, as an OOM kill or a node loss would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.alive:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class Stack:
    """The processes of one local deployment, sharing one environment."""

    env: dict[str, str]
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    worker_count: int = 0

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start `manage.py args` with the stack's environment, `env` on top of it."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        popen = subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        proc = Proc(name, popen)
        self.procs.append(proc)
        return proc

    def start_provider(self, port: int, *fault_args: str, ca_file: Path | None = None) -> Proc:
        """Start the fake provider; with `ca_file`, over TLS, its CA written there."""
        args = ["run_fake_provider", "--port", str(port), *fault_args]
        if ca_file is not None:
            ca_file.unlink(missing_ok=True)  # wait for this run's CA, not a stale one
            args += ["--tls", "--ca-file", str(ca_file)]
        proc = self._spawn("provider", args)
        scheme = "https" if ca_file is not None else "http"
        wait_http(
            f"{scheme}://127.0.0.1:{port}/_fake/health",
            what="fake provider",
            verify=str(ca_file) if ca_file is not None else True,
        )
        return proc

    def start_fake(self, name: str, args: list[str], *, health: str) -> Proc:
        """Start `run_fake_provider args` (another system's fake), once `health` answers."""
        proc = self._spawn(name, ["run_fake_provider", *args])
        wait_http(health, what=f"fake {name}")
        return proc

    def start_api(self, port: int, name: str = "api") -> Proc:
        """Start a web process (the project's runserver) on `port`, named `name` in the logs."""
        proc = self._spawn(name, ["runserver", "--noreload", "--skip-checks", f"127.0.0.1:{port}"])
        wait_http(f"http://127.0.0.1:{port}/api/orders", what="API server", ok=(405, 401))
        return proc

    def start_worker(
        self, worker_class: str | None = None, env: dict[str, str] | None = None
    ) -> Proc:
        """Start an RQ worker on the payments queue; `env` on top of the stack's environment."""
        self.worker_count += 1
        name = f"worker-{os.getpid()}-{self.worker_count}"
        args = ["rqworker", "payments", "--with-scheduler", "--name", name]
        if worker_class:
            args += ["--worker-class", worker_class]
        return self._spawn(name, args, env)

    def start_recovery(self, interval: float, name: str = "recovery") -> Proc:
        """Start a `run_recovery` loop (several may run: each owns the claims it takes)."""
        return self._spawn(name, ["run_recovery", "--interval", str(interval)])

    def workers(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("worker-") and p.alive]

    def kill(self, proc: Proc) -> None:
        """SIGKILL the worker and its work horse (which RQ puts in a session of its own)."""
        victims = [proc.popen.pid, *descendants(proc.popen.pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.popen.wait(timeout=10)

    def stop(self) -> None:
        """Stop everything: SIGTERM, then SIGKILL what is still there after 10 s.

        Then SIGKILL what is left in the stack's process groups: a worker's
        fork (RQ's scheduler runs in one) can outlive its worker, which kept
        the test database open after a run.
        """
        for proc in self.procs:
            proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.signal_group(signal.SIGKILL)
                proc.popen.wait(timeout=5)
        for pid in group_members({proc.popen.pid for proc in self.procs}):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def group_members(groups: set[int]) -> list[int]:
    """Return the pids of this project's `manage.py` processes in one of `groups` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pgid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
        if pgid in groups and b"manage.py" in cmdline:
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Return the pids of all processes below `pid` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # the process ended while we looked
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def wait_http(
    url: str,
    *,
    what: str,
    ok: tuple[int, ...] = (200,),
    timeout: float = 30,
    verify: bool | str = True,
) -> None:
    """Wait until `url` answers with one of `ok`; raise RuntimeError after `timeout`.

    `verify` is a CA file for a server with a private CA; until the server has
    written it, the attempts fail like any other and are retried.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=1, verify=verify).status_code in ok:
                return
        except OSError:  # requests' errors, and a CA file not written yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not start at {url} within {timeout:.0f}s")
