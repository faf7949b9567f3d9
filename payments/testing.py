"""The test kit for handler authors: run the jobs, and crash a real worker at every fence point.

Public and shipped with the fence (docs/testing.md); imported by tests only, never by the
fence itself. With pytest-django, in a test marked `django_db(transaction=True)` (worker
processes must see the committed rows):

    from payments.testing import crash_matrix, run_jobs

    def test_confirm_booking__once_whatever_the_crash():
        def start(key):
            return request_confirmation(Booking.objects.create(guest="Ada"), key)

        table = crash_matrix(start, count=lambda op: {"notify": sent_to(op)})
        table.assert_held()   # prints the table; fails naming each point that did not hold

`run_jobs()` runs what the queue holds in this process, on the fence's worker class.
`crash_matrix` starts, for each fence point of each step the operation declares (and its
final commit), a fresh operation and a real `rqworker` process told to SIGKILL itself
there (FENCE_FAILPOINTS), restarted as a supervisor would, beside the recovery loop
(`run_recovery`), until the operation is final. Then it checks what the fence promises:
the operation succeeded, every declared step's claim is done, and each effect ran as its
kind allows (an effect with a lookup exactly once; a side effect at most once or at least
once, as its policy says), counted by your `count(op)`. A point the run never reached (a
local step has no claim commit of its own before a call) is reported as such, not failed.

The worker processes run `python -m django` with a settings module the kit writes: yours
(DJANGO_SETTINGS_MODULE), with DEBUG on (failpoints are honoured only then), the test
database's name, and short leases (`LEASE_SECONDS`), so that a killed worker's lease runs
out within seconds. Your project's directory must be the current one (as for pytest).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from django.conf import settings
from django.db import connections
from rq.queue import Queue

from payments.engine.failpoints import (
    AFTER_CLAIM_COMMIT,
    AFTER_PROVIDER_ACCEPT,
    AFTER_RECORD_COMMIT,
    BEFORE_RECORD_COMMIT,
    point_at,
)
from payments.engine.handlers import get_handler
from payments.fake_system import FakeSystem
from payments.models import ClaimState, Operation, OperationState

__all__ = [
    "CrashCase",
    "CrashTable",
    "FakeSystem",
    "crash_matrix",
    "crash_points",
    "run_jobs",
    "stop_process",
]

#: The workers' claim lease and job timeout in a crash matrix (seconds): how long a killed
#: worker's operation waits before the next worker takes it over.
LEASE_SECONDS = 3

#: The fence points of one step, in protocol order: its claim committed, the external
#: system's accept (the effect happened, nothing recorded), and its record's commit.
STEP_POINTS = (AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, BEFORE_RECORD_COMMIT)


def run_jobs(
    queue: str | Queue = "", *, worker_class: type | None = None, with_scheduler: bool = False
) -> None:
    """Run every job of a queue in this process, until it is empty: by default the fence's
    queue (PAYMENTS["QUEUE"]) on the fence's worker class (payments.engine.worker.FenceWorker).
    `queue`: a queue's name or an RQ queue; `worker_class`: another RQ worker class."""
    import django_rq

    from payments.conf import payments_settings
    from payments.engine.worker import FenceWorker

    rq_queue = (
        queue
        if isinstance(queue, Queue)
        else django_rq.get_queue(queue or payments_settings().queue)
    )
    worker = worker_class or FenceWorker
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:  # work() installs its own signal handlers; the test runner gets its own back
        worker([rq_queue], connection=rq_queue.connection).work(
            burst=True, with_scheduler=with_scheduler
        )
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def stop_process(proc: subprocess.Popen, *, kill: bool = False) -> str:
    """Stop a process started in a session of its own (its whole group: SIGTERM, or SIGKILL
    with `kill` or when it has not ended 15 s later); return what it wrote to stderr.

    The group is signalled even when its leader has ended: a worker killed at a fence
    point leaves its children (RQ's scheduler) alive, holding its stderr open, as a
    supervisor that stops a unit's whole group (systemd's default) would not."""
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except ProcessLookupError:
        pass  # the whole group has ended
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return (err or b"").decode(errors="replace")


def crash_points(kind: str) -> list[str]:
    """Every point a crash matrix kills a worker at, for operations of `kind`: each fence
    point of each step its handler declares, in run order (`after_provider_accept@charge`),
    then the operation's final commit, before its job is acknowledged
    (`after_record_commit@<kind>`)."""
    spec = get_handler(kind)
    steps = spec.order or spec.step_order
    return [point_at(point, step) for step in steps for point in STEP_POINTS] + [
        point_at(AFTER_RECORD_COMMIT, kind)
    ]


@dataclass
class CrashCase:
    """One row of the matrix: where the worker was killed, and what the fence left."""

    point: str
    operation: str = ""
    crashed: bool = False
    state: str = ""
    steps: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return not self.problems


@dataclass
class CrashTable:
    """The matrix's rows; `str()` is its table, `assert_held()` fails on any row that broke."""

    kind: str
    cases: list[CrashCase]

    def __str__(self) -> str:
        count = len(self.cases)
        head = f"crash matrix of {self.kind}: {count} point{'' if count == 1 else 's'}"
        lines = [head, f"{'point':44} {'crashed':12} {'state':10} {'effects':24} verdict"]
        for case in self.cases:
            counts = ", ".join(f"{k}={v}" for k, v in sorted(case.counts.items())) or "-"
            verdict = "held" if case.held else "BROKE: " + "; ".join(case.problems)
            crashed = "yes" if case.crashed else "not reached"
            lines.append(f"{case.point:44} {crashed:12} {case.state:10} {counts:24} {verdict}")
        return "\n".join(lines)

    @property
    def broken(self) -> list[CrashCase]:
        return [case for case in self.cases if not case.held]

    def assert_held(self) -> None:
        """Print the table; raise AssertionError naming every point where the fence broke."""
        print(self)
        if self.broken:
            raise AssertionError(
                f"{len(self.broken)} of {len(self.cases)} crash points broke:\n{self}"
            )


def crash_matrix(
    start: Callable[[str], Any],
    *,
    count: Callable[[Operation], Mapping[str, int]] | None = None,
    check: Callable[[Operation], None] | None = None,
    points: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    handler_modules: list[str] | None = None,
    timeout: float = 60.0,
) -> CrashTable:
    """Kill a real worker at every fence point of an operation; see what each redelivery left.

    `start(key)` starts one operation with that key, as your service does, and returns it
    (an Operation, or a tuple whose first item is one, as `create_operation_in_tx`
    returns). `count(op)`: how many times each external step's effect happened at the
    external system (its fake's record), by step name; an effect with a lookup must
    have happened once, an at-most-once side effect at most once, an at-least-once one at
    least once. `check(op)`: your own assertions on the business rows (raise to fail the
    row). `points`: a subset of crash_points(kind). `env`: more environment for the
    worker processes (a fake system's URL). `handler_modules`: modules of handlers the
    workers must import besides the discovered ones (a handler a test declares; its
    PAYMENTS["HANDLER_MODULES"]). `timeout`: seconds each case may take.
    """
    if isinstance(handler_modules, str):
        raise TypeError("handler_modules is a list of dotted module paths, not one string")
    _refuse_other_workers()
    # The first operation names the kind, and so the points; each case then starts its own.
    first = _operation_of(start(f"crash-{os.getpid()}-0"))
    todo = points if points is not None else crash_points(first.kind)
    cases: list[CrashCase] = []
    with tempfile.TemporaryDirectory(prefix="fence-crash-") as tmp:
        workdir = Path(tmp)
        module = _worker_settings(workdir, list(handler_modules or []))
        base_env = {
            **os.environ,
            **(env or {}),
            "DJANGO_SETTINGS_MODULE": module,
            "PYTHONPATH": os.pathsep.join(
                [str(workdir), os.getcwd(), os.environ.get("PYTHONPATH", "")]
            ),
        }
        for index, point in enumerate(todo):
            op = first if index == 0 else _operation_of(start(f"crash-{os.getpid()}-{index}"))
            cases.append(_run_case(op, point, workdir, base_env, count, check, timeout))
            # What the case left queued (its follow-ups, a late redelivery) runs now, with
            # no failpoint: the next case's worker kills only in the next case's operation.
            run_jobs()
    return CrashTable(first.kind, cases)


def _refuse_other_workers() -> None:
    """Refuse to start while another worker listens on the fence's queue's Redis database
    (a development `rqworker`): it would take the matrix's jobs and run them without its
    failpoints, and the verdicts would be about its runs.

    A listener is a connection to that database blocked waiting for a job (RQ's BLPOP or
    BLMOVE), a named one subscribed to a channel (a worker's command channel, on a
    connection RQ names after it), or one named as a worker RQ lists for the queue (a
    worker busy with a job is not blocked): read from Redis' CLIENT LIST,
    so a worker whose registration a test's FLUSHDB erased is still seen, and one that
    died without unregistering (a SIGKILL) is not. Where CLIENT LIST is refused (a
    managed Redis' ACL), the check is skipped.
    """
    import django_rq
    from redis.exceptions import ResponseError
    from rq.worker import Worker

    from payments.conf import payments_settings

    queue = django_rq.get_queue(payments_settings().queue)
    redis = queue.connection
    where = redis.connection_pool.connection_kwargs
    db = int(where.get("db", 0))
    registered = {worker.name for worker in Worker.all(queue=queue)}
    try:
        # A sync client (redis-py's annotations also allow the asyncio client's Awaitable).
        clients = cast(list[dict[str, Any]], redis.client_list())
    except ResponseError:
        return
    others = sorted(
        {
            client.get("name") or f"a client at {client.get('addr', '?')}"
            for client in clients
            if int(client.get("db", -1)) == db
            and (
                client.get("cmd") in WAITING_COMMANDS
                or client.get("name") in registered
                or (client.get("name") and client.get("cmd") in SUBSCRIBING_COMMANDS)
            )
        }
    )
    if others:
        raise RuntimeError(
            f"crash_matrix: workers listen on Redis db {db} at "
            f"{where.get('host', '?')}:{where.get('port', '?')}, where the queue "
            f"{queue.name!r} is: {', '.join(others[:5])}. They would run the matrix's jobs "
            "without its failpoints. Stop them, or give the tests a Redis database of their "
            "own (docs/testing.md)."
        )


#: The Redis commands a worker waits for a job with (rq's Queue.dequeue_any), on a
#: connection RQ leaves unnamed.
WAITING_COMMANDS = frozenset({"blpop", "blmove", "brpoplpush"})
#: A worker also listens for commands (rq:pubsub:<name>) on a connection named after it.
SUBSCRIBING_COMMANDS = frozenset({"subscribe", "psubscribe"})


def _forget_workers(queue_name: str, names: list[str]) -> None:
    """Unregister the case's workers (SIGKILLed: none said it died), as RQ does for a
    worker that stops, so that the next matrix does not take them for another's."""
    import django_rq
    from rq.worker import Worker

    connection = django_rq.get_queue(queue_name).connection
    for name in names:
        found = Worker.find_by_key(
            Worker.redis_worker_namespace_prefix + name, connection=connection
        )
        if found is not None:
            found.register_death()


def _operation_of(started: Any) -> Operation:
    op = started[0] if isinstance(started, tuple) else started
    if not isinstance(op, Operation):
        raise TypeError(f"start(key) returned {started!r}, not an Operation")
    return op


def _worker_settings(workdir: Path, handler_modules: list[str]) -> str:
    """Write the workers' settings module: the project's, on the test database, DEBUG on
    (failpoints), short leases. Returns its name."""
    name = f"fence_crash_settings_{os.getpid()}"
    project = os.environ.get("DJANGO_SETTINGS_MODULE") or settings.SETTINGS_MODULE
    # Each database alias as the test runs it (its test database's name), and the queues
    # as the test enqueues on them (the test's Redis, not the settings module's).
    databases = "".join(
        f"DATABASES[{alias!r}]['NAME'] = {connections[alias].settings_dict['NAME']!r}\n"
        f"DATABASES[{alias!r}].pop('TEST', None)\n"
        for alias in settings.DATABASES
    )
    (workdir / f"{name}.py").write_text(
        f"from {project} import *  # noqa: F403\n"
        f"DEBUG = True\n"
        f"{databases}"
        f"RQ_QUEUES = {settings.RQ_QUEUES!r}\n"
        f"PAYMENTS = {{**globals().get('PAYMENTS', {{}}), 'JOB_TIMEOUT': {LEASE_SECONDS}, "
        f"'CLAIM_LEASE': {LEASE_SECONDS}, 'PROVIDER_CONNECT_TIMEOUT': 0.5, "
        f"'PROVIDER_READ_TIMEOUT': 1.0, 'RETRY_BACKOFF': [0, 0]}}\n"
        f"PAYMENTS['HANDLER_MODULES'] = [*PAYMENTS.get('HANDLER_MODULES', ()), "
        f"*{handler_modules!r}]\n"
        f"for _queue in RQ_QUEUES.values():\n"
        f"    _queue['DEFAULT_TIMEOUT'] = {LEASE_SECONDS}\n"
    )
    return name


def _start(args: list[str], env: Mapping[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "django", *args],
        env=dict(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


FINAL = (OperationState.SUCCEEDED, OperationState.FAILED, OperationState.NEEDS_REVIEW)


def _run_case(
    op: Operation,
    point: str,
    workdir: Path,
    base_env: Mapping[str, str],
    count: Callable[[Operation], Mapping[str, int]] | None,
    check: Callable[[Operation], None] | None,
    timeout: float,
) -> CrashCase:
    from payments.conf import payments_settings

    marker = workdir / f"failpoint-{op.pk}"
    env = {**base_env, "FENCE_FAILPOINTS": point, "FENCE_FAILPOINT_MARKER": str(marker)}
    case = CrashCase(point=point, operation=op.key)
    queue = payments_settings().queue
    worker_args = ["rqworker", queue, "--with-scheduler", "--worker-ttl", "30"]
    recovery_env = {k: v for k, v in env.items() if k != "FENCE_FAILPOINTS"}
    recovery = _start(["run_recovery", "--interval", "0.5"], recovery_env)
    # Named for this test process too: a worker killed in an earlier run leaves its name in
    # Redis for a while, and RQ refuses to start a second worker of the same name.
    name = f"crash-{os.getpid()}-{op.pk}"
    names = [f"{name}-0"]
    worker = _start([*worker_args, "--name", names[0]], env)
    stderr: list[str] = []
    began = time.monotonic()
    restarts = 0
    try:
        while time.monotonic() - began < timeout:
            if worker.poll() is not None:  # killed at the point: restart it, as systemd would
                stderr.append(stop_process(worker))
                restarts += 1
                names.append(f"{name}-{restarts}")
                worker = _start([*worker_args, "--name", names[-1]], env)
            op.refresh_from_db()
            if op.state in FINAL:
                break
            time.sleep(0.1)
    finally:
        stderr.append(stop_process(worker))
        stderr.append(stop_process(recovery))
        _forget_workers(queue, names)
    case.seconds = time.monotonic() - began
    case.crashed = marker.with_name(f"{marker.name}.{point}").exists()
    if not case.crashed and _must_crash(op.kind, point):
        case.problems.append(
            "never reached: an external step's and the final commit's points always are"
        )
    op.refresh_from_db()
    case.state = op.state
    case.steps = dict(op.claims.values_list("step", "state"))
    if op.state != OperationState.SUCCEEDED:
        tail = "\n".join(stderr)[-1500:]
        case.problems.append(f"operation {op.state}, not succeeded ({op.last_error!r}) {tail}")
    _check_steps(op, case, count, check)
    return case


def _must_crash(kind: str, point: str) -> bool:
    """Whether a run must reach `point`: each point of an external step (with a lookup)
    and the final commit; a step declared None is a local step (its points are never
    reached) or a side effect (they are), which its declaration does not say."""
    name, _, qualifier = point.partition("@")
    return name == AFTER_RECORD_COMMIT or qualifier in get_handler(kind).effects


def _check_steps(
    op: Operation,
    case: CrashCase,
    count: Callable[[Operation], Mapping[str, int]] | None,
    check: Callable[[Operation], None] | None,
) -> None:
    """Each declared step done (once: its claim is unique), each effect as its kind allows."""
    from payments.engine.effects import DeliveryPolicy

    spec = get_handler(op.kind)
    for step in spec.order or spec.step_order:
        state = case.steps.get(step)
        if state is not None and state != ClaimState.DONE:
            case.problems.append(f"step {step} {state}")
    counts = dict(count(op)) if count is not None else {}
    case.counts = counts
    for step, times in counts.items():
        claim = op.claims.filter(step=step).first()
        policy = str((claim.result or {}).get("policy", "")) if claim is not None else ""
        if step in spec.effects and times != 1:
            case.problems.append(f"{step} happened {times} times at the external system")
        elif policy == DeliveryPolicy.AT_MOST_ONCE and times > 1:
            case.problems.append(f"{step} (at most once) happened {times} times")
        elif policy == DeliveryPolicy.AT_LEAST_ONCE and times < 1:
            case.problems.append(f"{step} (at least once) never happened")
    if check is not None:
        try:
            check(op)
        except Exception as exc:  # the author's check failed this row: say how, go on
            case.problems.append(f"check: {type(exc).__name__}: {exc}")
