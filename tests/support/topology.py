"""The topology tests' side of real PgBouncer, Redis (master + replica) and Sentinel processes.

The processes themselves are devtools/topology/servers.py's (the chaos run's
`--topology ha` starts the same ones); here: skipping a test whose binary is
missing (failing it under make test), the web tier, a fleet of workers and
recovery loops, and when a run has settled (what it must end with: flows.assert_paid_once).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from django.db.models import Q

from devtools.topology.servers import (
    MissingBinary,
    PgBouncer,
    PostgresCluster,
    RedisHA,
    port_open,
    stop_process,
    wait_until,
)
from devtools.topology.servers import binary as find_binary
from devtools.topology.stack import free_port
from payments.models import Operation, OperationState
from tests.support.workers import ROOT

#: `make test` and CI install the binaries first: there a missing one fails the test.
REQUIRED = os.environ.get("REQUIRE_TOPOLOGY_BINARIES") == "1"
VENV_BIN = Path(sys.executable).parent

__all__ = [
    "Api",
    "Fleet",
    "PgBouncer",
    "PostgresCluster",
    "RedisHA",
    "all_settled",
    "binary",
    "free_port",
    "port_open",
    "start_gunicorn",
    "stop_process",
    "wait_until",
]


def binary(name: str) -> str:
    """Return the path of a Debian binary, or skip the test (fail it under make test)."""
    try:
        return find_binary(name)
    except MissingBinary as exc:
        if REQUIRED:
            pytest.fail(str(exc))
        pytest.skip(str(exc))


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


# --- when a run has settled ----------------------------------------------------------------


def checkout_settled(op: Operation) -> bool:
    """Tell whether a checkout and both its follow-ups succeeded.

    The ledger line is written by a follow-up that runs after the checkout's
    own success: an assertion on it before then would race.
    """
    done = Operation.objects.filter(Q(pk=op.pk) | Q(parent=op), state=OperationState.SUCCEEDED)
    return done.count() == 3


def all_settled(count: int) -> bool:
    ops = Operation.objects.all()
    return ops.count() >= count and not ops.exclude(state=OperationState.SUCCEEDED).exists()
