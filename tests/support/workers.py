"""Workers for the tests: an RQ worker in this process, or real `rqworker` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.db import connection
from rq import SimpleWorker
from rq.queue import Queue

from payments.testing import run_jobs, stop_process
from tests.support.config import TEST_PAYMENTS, TEST_REDIS_URL

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
    queue: Queue, *, with_scheduler: bool = False, worker_class: type = SimpleWorker
) -> None:
    """Run jobs until the queue is empty, in this process (and this DB connection)."""
    run_jobs(queue, worker_class=worker_class, with_scheduler=with_scheduler)


def run_fence_worker(queue: Queue) -> None:
    """Run jobs until the queue is empty on the product's FenceWorker, in this process."""
    run_jobs(queue)


def database_url() -> str:
    """The URL of the test database, for a process of its own."""
    db = connection.settings_dict
    auth = (db["USER"] or "postgres") + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def worker_env(provider_url: str, **extra: str) -> dict[str, str]:
    """The environment of a worker that uses the test database, test Redis and the fake."""
    env = {
        **os.environ,
        "DEBUG": "1",
        "DATABASE_URL": database_url(),
        "REDIS_URL": TEST_REDIS_URL,
        "PAYMENT_PROVIDER_URL": provider_url,
        "PROVIDER_CONNECT_TIMEOUT": str(TEST_PAYMENTS["PROVIDER_CONNECT_TIMEOUT"]),
        "PROVIDER_READ_TIMEOUT": str(TEST_PAYMENTS["PROVIDER_READ_TIMEOUT"]),
        "JOB_TIMEOUT": str(TEST_PAYMENTS["JOB_TIMEOUT"]),
        "CLAIM_LEASE": str(TEST_PAYMENTS["CLAIM_LEASE"]),
        "RETRY_BACKOFF": ",".join(str(s) for s in TEST_PAYMENTS["RETRY_BACKOFF"]),
        "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
        "SECRET_KEY": settings.SECRET_KEY,
        "API_TOKEN": settings.API_TOKEN,
    }
    env.update(extra)
    return env


FORKING = "rq.worker.Worker"
SIMPLE = "payments.engine.worker.FenceWorker"


def start_worker(
    env: dict[str, str], name: str, worker_class: str | None = None
) -> subprocess.Popen:
    """Start `manage.py rqworker payments --with-scheduler` in its own process group."""
    extra = ["--worker-class", worker_class] if worker_class else []
    return subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "rqworker",
            "payments",
            "--with-scheduler",
            "--name",
            name,
            "--worker-ttl",
            "30",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def stop_worker(proc: subprocess.Popen, *, kill: bool = False) -> str:
    """Stop a worker (its whole process group) and return what it wrote to stderr."""
    return stop_process(proc, kill=kill)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_recovery(env: dict[str, str]) -> subprocess.Popen:
    """Start the sweeper + reconciler loop, as a deployment runs it."""
    return subprocess.Popen(
        [sys.executable, "manage.py", "run_recovery", "--interval", "0.5"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


class Supervisor:
    """Keep one worker running, as systemd or Kubernetes would, next to the recovery loop."""

    def __init__(self, env: dict[str, str], name: str, worker_class: str | None = None) -> None:
        self.env, self.name, self.worker_class = env, name, worker_class
        self.restarts = 0
        self.worker = start_worker(env, name, worker_class)
        # The failpoints are the worker's: the recovery loop is never the process killed.
        self.recovery = start_recovery({k: v for k, v in env.items() if k != "FENCE_FAILPOINTS"})
        self.stderr: list[str] = []

    def poll(self) -> None:
        """Restart the worker if it died (a failpoint SIGKILLs a SimpleWorker whole)."""
        if self.worker.poll() is not None:
            self.stderr.append(stop_worker(self.worker))
            self.restarts += 1
            self.worker = start_worker(self.env, f"{self.name}-{self.restarts}", self.worker_class)

    def stop(self) -> str:
        self.stderr.append(stop_worker(self.worker))
        self.stderr.append(stop_worker(self.recovery))
        return "\n".join(self.stderr)

    def run_until(self, condition: Callable[[], bool], timeout: float, what: str) -> str:
        """Keep the worker running until `condition` holds, then stop both processes and
        return what they wrote to stderr. On a time-out the failure carries the end of that
        stderr: a worker that cannot start says why there, not in a bare time-out."""

        def holds() -> bool:
            self.poll()
            return condition()

        try:
            wait_until(holds, timeout=timeout, what=what)
        except AssertionError as timed_out:
            raise AssertionError(
                f"{timed_out}; the processes' stderr:\n{self.stop()[-4000:]}"
            ) from None
        return self.stop()
