"""CPU seconds spent by the processes of a load run, read from /proc (Linux).

Throughput on a shared machine moves with whatever else runs there; the CPU
each request costs does not, or much less. `CpuMeter` takes a snapshot of the
processes' user + system time before and after a run and gives the difference
per role (gunicorn's workers, PostgreSQL's backends of one database,
PgBouncer, the load generator itself).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from django.db import connection

from devtools.topology.stack import descendants

_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process so far, with its children that ended and
    were waited for (the forking RQ worker's work horse, one per job); 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(field) for field in fields[11:15]) / _TICKS  # utime, stime, cutime, cstime


def backend_pids(database: str) -> list[int]:
    """PostgreSQL's backends serving clients of `database`, except this process's own (not
    its autovacuum workers, which pg_stat_activity lists under the database too)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'",
            [database],
        )
        return [row[0] for row in cursor.fetchall()]


class CpuMeter:
    """CPU seconds per role between `start()` and `stop()`.

    Each role is a function that lists its pids now; a process that appears
    during the run counts from zero. One that ends during the run counts with
    its parent once the parent has waited for it (the forking RQ worker's
    horse, one per job); otherwise it is lost (gunicorn's workers and the
    kept connections outlive a run).
    """

    def __init__(self, roles: dict[str, Callable[[], list[int]]]) -> None:
        self.roles = roles
        self._before: dict[str, dict[int, float]] = {}
        self._client_before = 0.0

    def _snapshot(self) -> dict[str, dict[int, float]]:
        return {
            role: {pid: process_cpu(pid) for pid in pids()} for role, pids in self.roles.items()
        }

    def start(self) -> None:
        self._before = self._snapshot()
        self._client_before = time.process_time()

    def stop(self) -> dict[str, float]:
        """CPU seconds per role, and `load_generator` for this process."""
        client = time.process_time() - self._client_before
        after = self._snapshot()
        spent = {
            role: sum(seconds - self._before[role].get(pid, 0.0) for pid, seconds in now.items())
            for role, now in after.items()
        }
        spent["load_generator"] = client
        return spent


def processes_named(name: str) -> Callable[[], list[int]]:
    """Every process whose command name is `name` (PostgreSQL's, Redis's), read from /proc."""

    def pids() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "comm").read_text().strip() == name:
                    found.append(int(entry.name))
            except OSError:
                continue  # the process ended while we looked
        return found

    return pids


def tree_pids(roots: Callable[[], list[int]]) -> Callable[[], list[int]]:
    """The processes `roots` lists and everything below them."""
    return lambda: [pid for root in roots() for pid in (root, *descendants(root))]
