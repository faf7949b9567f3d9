"""The bench measures production's settings, whatever the caller's environment says.

`make bench` runs from the development `.env`, DEBUG on. A worker with DEBUG on
logs every query with its values and runs the fence's statements unprepared:
it would measure a cost no production worker pays. No timing is asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from django.db import connection
from rq.job import Job
from rq.registry import FinishedJobRegistry

from devtools.bench import jobs, runner
from devtools.bench.cpu import backend_pids, process_cpu
from devtools.bench.runner import BatchCpu, Bench
from devtools.management.commands import bench as bench_command
from tests.support.config import TEST_REDIS_URL
from tests.support.workers import SIMPLE, database_url

PROBES = 30
DJANGOS, OPT_IN = "django.db.backends.postgresql.base", "project.postgresql.base"


def probed_backend(job: Job | None) -> str:
    """The database backend a finished `settings_probe` job ran on."""
    assert job is not None, "a finished job expired before the test read it"
    probe = job.return_value()
    assert probe is not None
    return probe["backend"]


@pytest.mark.django_db(transaction=True)
def test_bench__workers_on_djangos_backend__then_on_the_opt_in_one_when_asked(
    tmp_path, monkeypatch, settings
):
    """The goals are measured on Django's backend, whatever the caller's environment
    says; `use_backend` runs the next batches on the opt-in one, side by side."""
    monkeypatch.setenv("DATABASE_BEGIN_WITH_FIRST_STATEMENT", "1")  # the caller's choice
    monkeypatch.setenv("DATABASE_URL", database_url())
    monkeypatch.setenv("REDIS_URL", TEST_REDIS_URL)
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    settings.DEBUG = True

    def backends(bench: Bench) -> set[str]:
        def probes() -> int:
            for _ in range(3):
                bench.queue.enqueue(jobs.settings_probe)
            return 3

        bench.batch(probes, workers=1, worker_class=SIMPLE)
        job_ids = FinishedJobRegistry(queue=bench.queue).get_job_ids()
        return {probed_backend(j) for j in Job.fetch_many(job_ids, bench.queue.connection)}

    with Bench(latency=0, log_dir=tmp_path, say=lambda line: None) as bench:
        assert backends(bench) == {DJANGOS}
        bench.use_backend("begin_with_first_statement")
        assert backends(bench) == {OPT_IN}
        bench.use_backend("django")
        assert backends(bench) == {DJANGOS}


def test_bench_table__both_goals_on_each_backend__and_by_how_much_they_miss():
    figures = {
        "provider_latency_seconds": 0.02,
        "worker_classes": {"W": {"fenced_to_unfenced": 0.96}},
        "realistic_latency": {"latency_seconds": 0.2, "workers": 4, "fenced_to_unfenced": 0.95},
        "begin_with_first_statement": {
            "worker_class": "W",
            "default_latency": {"fenced_to_unfenced": 0.97},
            "realistic_latency": {"fenced_to_unfenced": 0.98},
        },
    }

    rows = dict(bench_command._backend_rows(figures))

    at_20, at_200 = (next(v for k, v in rows.items() if f"at {ms} ms" in k) for ms in (20, 200))
    assert at_20 == "0.96 (met) / 0.97"
    assert at_200 == "0.95 (misses by 0.02) / 0.98"


@pytest.mark.django_db(transaction=True)
def test_bench__its_workers_and_its_own_process_run_with_debug_off(tmp_path, monkeypatch, settings):
    """A batch run by `Bench` from a DEBUG-on environment: the worker reports DEBUG off
    and no query log, and the bench's process (the API side, the reconciler) too."""
    monkeypatch.setenv("DEBUG", "1")  # the development .env, as `make bench` reads it
    monkeypatch.setenv("DATABASE_URL", database_url())
    monkeypatch.setenv("REDIS_URL", TEST_REDIS_URL)
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    # What the bench assigns to settings lands in this override, undone after the test.
    settings.DEBUG = True

    with Bench(latency=0, log_dir=tmp_path, say=lambda line: None) as bench:

        def probes() -> int:
            for _ in range(PROBES):
                bench.queue.enqueue(jobs.settings_probe)
            return PROBES

        bench.batch(probes, workers=1, worker_class=SIMPLE)
        job_ids = FinishedJobRegistry(queue=bench.queue).get_job_ids()
        results = [j.return_value() for j in Job.fetch_many(job_ids, bench.queue.connection)]

        assert results == [{"debug": False, "queries_logged": False, "backend": DJANGOS}] * PROBES
        assert not connection.queries_logged
        # The batch's CPU was metered from the worker's start-up on, by process kind.
        assert bench.cpu is not None and 0 < bench.cpu.jobs <= PROBES
        assert set(bench.cpu.ms_per(1)) == {"workers", "postgres", "backends", "redis", "provider"}


def test_batch_cpu__milliseconds_per_checkout_by_process_kind_without_the_poller():
    cpu = BatchCpu({"workers": 1.2, "postgres": 0.3, "load_generator": 9.0}, jobs=30)

    assert cpu.ms_per(3) == pytest.approx({"workers": 120.0, "postgres": 30.0})


def test_process_cpu__counts_a_child_that_ended__as_the_forking_workers_horse():
    """The forking RQ worker runs each job in a child that ends with it: the child's CPU
    must count with the worker, or the forking side would look nearly free."""
    before = process_cpu(os.getpid())
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass",
        ],
        check=True,
    )
    assert process_cpu(os.getpid()) - before >= 0.25


class FakeBench:
    """Records which backend and latency each batch ran with; every batch takes 1 s."""

    def __init__(self) -> None:
        self.backend, self.latency, self.cpu = "django", 0.02, None
        self.batches: list[tuple[str, float, int]] = []

    def use_backend(self, backend: str) -> None:
        self.backend = backend

    def set_latency(self, seconds: float) -> None:
        self.latency = seconds

    def batch(self, prepare: object, *, workers: int, worker_class: str) -> float:
        self.batches.append((self.backend, self.latency, workers))
        return 1.0


def test_opt_in_backend_section__both_comparisons_on_it__then_back_to_djangos():
    bench = FakeBench()
    options = {"rounds": 2, "latency": 0.02, "realistic_latency": 0.2}

    figures = bench_command._opt_in_backend(bench, options, 10, "W")

    assert bench.batches == [
        *[("begin_with_first_statement", 0.02, 2)] * 4,
        *[("begin_with_first_statement", 0.2, 4)] * 4,
    ]
    assert (bench.backend, bench.latency) == ("django", 0.02)
    assert figures["default_latency"]["fenced_to_unfenced"] == 1.0
    assert figures["realistic_latency"]["fenced_checkouts_per_second"] == 5.0


class _MeteredBatches:
    """A stand-in for `Bench` whose batches take one second and cost `worker_seconds` of
    worker CPU over the jobs `prepare` says it queued: `_side_by_side`'s arithmetic only."""

    def __init__(self, worker_seconds: float) -> None:
        self.worker_seconds = worker_seconds
        self.cpu: BatchCpu | None = None

    def batch(self, prepare, **_: object) -> float:
        self.cpu = BatchCpu({"workers": self.worker_seconds}, jobs=prepare())
        return 1.0


@pytest.mark.parametrize("inline", [True, False])
def test_side_by_side__cpu_per_checkout__divides_by_the_checkouts_not_by_three_jobs(
    inline, settings
):
    """With the follow-ups inline a checkout is one job: 10 checkouts that cost the workers
    0.5 s are 50 ms each, whichever way the follow-ups run (it read 150 ms: every batch's
    CPU was divided by 3 jobs per checkout, as when the follow-ups were queued)."""
    settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": inline}

    def queued(n: int):
        return lambda: n * runner.jobs_per_checkout()

    compared = bench_command._side_by_side(
        _MeteredBatches(worker_seconds=0.5),
        10,
        workers=2,
        worker_class="W",
        rounds=2,
        sides=(queued, queued),
    )

    for side in ("fenced", "unfenced"):
        assert [run["workers"] for run in compared.cpu[side]] == pytest.approx([50.0, 50.0])


@pytest.mark.django_db
def test_backend_pids__another_clients_backend__never_this_processs():
    """The backends a batch's workers talk to: a client's connection is listed, this
    process's own is not, and every pid listed serves a client (an autovacuum worker on
    the database would be left out; none can be made to run on cue here)."""
    with psycopg.connect(database_url()) as other:
        pids = backend_pids(connection.settings_dict["NAME"])
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            own = cursor.fetchone()[0]
            cursor.execute(
                "SELECT DISTINCT backend_type FROM pg_stat_activity WHERE pid = ANY(%s)", [pids]
            )
            kinds = {row[0] for row in cursor.fetchall()}

        assert other.info.backend_pid in pids
        assert own not in pids
        assert kinds == {"client backend"}


def _compared(fenced_backends: float, unfenced_backends: float) -> dict:
    cpu = {"workers": 10.0, "postgres": 5.0, "redis": 1.0, "provider": 1.0}
    return {
        "unfenced_checkouts_per_second": 50.0,  # 2 workers: 40 ms a checkout each
        "cpu_ms_per_checkout": {
            "fenced": {**cpu, "backends": fenced_backends},
            "unfenced": {**cpu, "backends": unfenced_backends},
        },
    }


def test_ceiling__the_twins_checkout_plus_what_the_fences_statements_cost_its_backend():
    """40 ms a checkout per worker and 2.5 ms more of backend CPU on the fenced side: the
    fence could read at most 40 / 42.5; 0.95 leaves it 40 / 0.95 - 40 ms in all."""
    c = bench_command.ceiling(_compared(4.0, 1.5), workers=2)

    assert c is not None
    assert c["checkout_ms"] == pytest.approx(40.0)
    assert c["backend_ms"] == pytest.approx(2.5)
    assert c["ratio"] == pytest.approx(40.0 / 42.5)
    assert c["allowed_ms"] == pytest.approx(40.0 / 0.95 - 40.0)
    assert bench_command._ceiling_text(_compared(4.0, 1.5), workers=2).startswith(
        "0.941: backends +2.5 ms CPU per checkout on an unfenced checkout of 40.0 ms"
    )


def test_ceiling__unmetered_batches__said_so_instead_of_a_figure():
    v = _compared(4.0, 1.5)
    del v["cpu_ms_per_checkout"]["unfenced"]["backends"]

    assert bench_command.ceiling(v, workers=2) is None
    assert bench_command._ceiling_text(v, workers=2) == "n/a (not metered)"
