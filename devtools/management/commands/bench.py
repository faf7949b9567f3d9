"""`make bench`: the fence's cost and the queue's ceiling, side by side in one run."""

from __future__ import annotations

import json
import logging
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from devtools.bench import instructions
from devtools.bench.desk import desk_pages, desk_rows
from devtools.bench.doc import page, write_between_markers
from devtools.bench.peer import DOC_TABLE as PEER_TABLE
from devtools.bench.peer import peer_figures, peer_markdown, peer_rows
from devtools.bench.runner import (
    WORKER_CLASSES,
    Bench,
    db_round_trips,
    fenced,
    inbox_cost,
    jobs_per_checkout,
    noop,
    purge_rate,
    reconciler_rate,
    session_reuse,
    unfenced,
)
from devtools.bench.webload import LoadShape, web_tier
from devtools.topology.servers import MissingBinary, binary

#: The markers of the table in docs/benchmarks.md.
DOC_TABLE = "bench-table"
#: The workers of each worker class's fenced / unfenced comparison at the short charge.
SHORT_CHARGE_WORKERS = 2


class BenchOptions(TypedDict):
    """The options add_arguments declares, with the types their parsers give."""

    orders: int
    rounds: int
    noops: int
    latency: float
    realistic_latency: float
    count_orders: int
    instruction_orders: str
    session_charges: int
    inbox_jobs: int
    reconcile: int
    purge_rows: int
    purge_batch: int | None
    only: str | None
    peer_orders: int
    peer_rounds: int
    peer_crash_orders: int
    web_workers: int
    web_orders: int
    web_duplicates: int
    web_concurrency: int
    web_pool_sizes: str | None
    web_rounds: int
    desk_operations: int
    desk_samples: int
    output: str | None
    no_doc: bool


class Command(BaseCommand):
    help = (
        "Benchmark, in one run: fenced vs unfenced checkout throughput (on Django's database "
        "backend, the default, and again on the opt-in one that sends BEGIN with a "
        "transaction's first statement), RQ no-op ceiling per worker class, database round trips and worker instructions (callgrind) per checkout, "
        "scaling over 1/2/4 workers, the same "
        "over TLS with the per-charge saving of session reuse, inbox cost, reconciler rate, "
        "inbox purge rate, and the web tier under load (gunicorn on direct connections vs "
        "through PgBouncer; --only web runs that alone). Needs a database of its own (its "
        "name must end in _bench): it empties it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=200, help="Checkouts per batch.")
        parser.add_argument(
            "--rounds",
            type=int,
            default=4,
            help="Rounds of one fenced and one unfenced batch in each throughput "
            "comparison, taking turns at going first (an even number gives both orders "
            "equally); each side keeps its fastest (the machine is shared: two batches "
            "in a row differ by several percent).",
        )
        parser.add_argument("--noops", type=int, default=1000, help="No-op jobs per batch.")
        parser.add_argument(
            "--latency",
            type=float,
            default=0.02,
            help="Seconds the fake provider takes per charge.",
        )
        parser.add_argument(
            "--realistic-latency",
            type=float,
            default=0.2,
            help="A Stripe-like charge latency for a second comparison.",
        )
        parser.add_argument(
            "--count-orders", type=int, default=50, help="Checkouts whose round trips are counted."
        )
        parser.add_argument(
            "--instruction-orders",
            default="10,50",
            help="Checkouts of the two callgrind runs per side (small,large): their "
            "difference gives the instructions of one more checkout.",
        )
        parser.add_argument(
            "--session-charges",
            type=int,
            default=200,
            help="Sequential charges per side for the session reuse comparison.",
        )
        parser.add_argument("--inbox-jobs", type=int, default=1000)
        parser.add_argument("--reconcile", type=int, default=100)
        parser.add_argument("--purge-rows", type=int, default=1_000_000)
        parser.add_argument(
            "--purge-batch",
            type=int,
            default=None,
            help="Most rows per purge batch. Default: INBOX['PURGE_BATCH_SIZE'].",
        )
        parser.add_argument(
            "--only",
            choices=["web", "desk", "peer"],
            default=None,
            help="Run one section only (web: the web tier's load, direct vs PgBouncer; desk: "
            "the desk's pages with --desk-operations operations; peer: the fence beside DBOS).",
        )
        parser.add_argument(
            "--peer-orders", type=int, default=200, help="Checkouts per batch against DBOS."
        )
        parser.add_argument(
            "--peer-rounds", type=int, default=3, help="Rounds of one batch a side against DBOS."
        )
        parser.add_argument(
            "--peer-crash-orders",
            type=int,
            default=10,
            help="Orders of DBOS's crash check, with and without the idempotency key.",
        )
        parser.add_argument(
            "--desk-operations",
            type=int,
            default=10_000,
            help="Operations bulk-inserted before the desk's pages are timed.",
        )
        parser.add_argument(
            "--desk-samples", type=int, default=20, help="Requests per desk page (p50, p95)."
        )
        parser.add_argument(
            "--web-workers", type=int, default=4, help="gunicorn workers for the web tier."
        )
        parser.add_argument(
            "--web-orders", type=int, default=250, help="Orders checked out per web-tier run."
        )
        parser.add_argument(
            "--web-duplicates",
            type=int,
            default=4,
            help="Concurrent requests per order, all with the same Idempotency-Key.",
        )
        parser.add_argument(
            "--web-concurrency", type=int, default=16, help="Requests in flight at once."
        )
        parser.add_argument(
            "--web-pool-sizes",
            default=None,
            help="PgBouncer server connections per run, comma-separated "
            "(default: as many as gunicorn workers, then 1).",
        )
        parser.add_argument("--web-rounds", type=int, default=2, help="Rounds per side.")
        parser.add_argument("--output", default=None, help="JSON file for the results.")
        parser.add_argument(
            "--no-doc",
            action="store_true",
            help="Do not write the table into docs/benchmarks.md (a full run writes it).",
        )

    def handle(self, *args: object, **options: Unpack[BenchOptions]) -> None:
        name = connection.settings_dict["NAME"]
        if not name.endswith("_bench"):
            raise CommandError(
                f"the bench empties its database; {name!r} does not end in "
                "_bench (make bench sets DATABASE_URL for you)"
            )
        try:  # the web tier's PgBouncer: say so now, not after the other sections
            if options["only"] != "desk":
                binary("pgbouncer")
        except MissingBinary as exc:
            raise CommandError(str(exc)) from None
        only = options["only"]
        default_out = f"results-{only}.json" if only else "results.json"
        out = Path(options["output"] or Path(settings.BASE_DIR) / "var" / "bench" / default_out)
        n, say = options["orders"], self.stdout.write
        # The reconciler runs in this process: its step records would bury the table.
        for name in ("payments", "inbox"):
            logging.getLogger(name).setLevel(logging.WARNING)
        figures: dict[str, object] = {
            "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, "
            f"{_cpus()} cores, Python {platform.python_version()}",
            "provider_latency_seconds": options["latency"],
        }
        log_dir = Path(settings.BASE_DIR) / "var" / "log" / "bench"
        if only == "desk":
            with Bench(latency=options["latency"], log_dir=log_dir, say=say) as bench:
                bench.reset()
                figures["desk"] = desk_pages(
                    options["desk_operations"], options["desk_samples"], say
                )
                bench.reset()
            self._report(figures, out, options)
            return
        if only == "peer":
            with Bench(latency=options["latency"], log_dir=log_dir, say=say) as bench:
                figures["peer"] = self._peer(bench, options, say)
            self._report(figures, out, options)
            return
        if only == "web":
            with Bench(latency=options["latency"], log_dir=log_dir, say=say) as bench:
                figures["web_tier"] = self._web_tier(bench, options, log_dir)
            self._report(figures, out, options)
            return
        with Bench(latency=options["latency"], log_dir=log_dir, say=say) as bench:
            per_class = {}
            for cls in WORKER_CLASSES:
                say(f"{cls}: no-op ceiling, fenced and unfenced checkout (2 workers)...")
                noop_s = bench.batch(
                    noop(options["noops"]), workers=SHORT_CHARGE_WORKERS, worker_class=cls
                )
                compared = _side_by_side(
                    bench,
                    n,
                    workers=SHORT_CHARGE_WORKERS,
                    worker_class=cls,
                    rounds=options["rounds"],
                )
                per_class[cls] = {
                    "noop_jobs_per_second": options["noops"] / noop_s,
                    **compared.figures(n),
                    "fenced_jobs_per_second": jobs_per_checkout() * n / compared.seconds["fenced"],
                    "cpu_ms_per_checkout": {
                        side: _mean(runs) for side, runs in compared.cpu.items()
                    },
                }
                per_class[cls]["fenced_jobs_to_noop_jobs"] = (
                    per_class[cls]["fenced_jobs_per_second"]
                    / per_class[cls]["noop_jobs_per_second"]
                )
            figures["worker_classes"] = per_class
            best = max(per_class, key=lambda c: per_class[c]["fenced_checkouts_per_second"])
            slow = options["realistic_latency"]
            say(f"fenced vs unfenced with {best}, 4 workers, at {slow * 1000:.0f} ms per charge...")
            bench.set_latency(slow)
            compared = _side_by_side(
                bench, n // 2, workers=4, worker_class=best, rounds=options["rounds"]
            )
            bench.set_latency(options["latency"])
            figures["realistic_latency"] = {
                "latency_seconds": slow,
                "workers": 4,
                **compared.figures(n // 2),
            }
            say(
                f"the same two comparisons with {best} on the opt-in database backend "
                "(DATABASE_BEGIN_WITH_FIRST_STATEMENT=1)..."
            )
            figures["begin_with_first_statement"] = _opt_in_backend(bench, options, n, best)
            say(f"noise floor: unfenced against unfenced with {best}, 2 workers...")
            figures["noise_floor"] = _side_by_side(
                bench,
                n,
                workers=2,
                worker_class=best,
                rounds=options["rounds"],
                sides=(unfenced, unfenced),
            ).figures(n, names=("first", "second"))
            figures["faster_worker_class"] = best
            say("database round trips per checkout, fenced and unfenced (2 workers)...")
            figures["db_round_trips"] = db_round_trips(bench, options["count_orders"], workers=2)
            figures["peer"] = self._peer(bench, options, say)
            figures["instructions_per_checkout"] = self._instructions(bench, options, say)
            say("provider session reuse over plain HTTP...")
            bench.set_latency(0)
            figures["session_reuse_http"] = session_reuse(bench, options["session_charges"])
            bench.set_latency(options["latency"])
            say(f"scaling with {best} over 1, 2, 4 workers...")
            figures["scaling"] = {
                str(k): n / bench.batch(fenced(n), workers=k, worker_class=best) for k in (1, 2, 4)
            }
            say("inbox-protected vs unprotected local handler...")
            bench.reset()
            cost = inbox_cost(bench, options["inbox_jobs"], rounds=5)
            figures["inbox_ms_per_job"] = cost
            figures["inbox_cost_ratio"] = cost["protected"] / cost["unprotected"]
            say("reconciler...")
            figures["reconciler"] = reconciler_rate(bench, options["reconcile"], best)
            say(f"inbox purge of {options['purge_rows']:,} rows...")
            bench.reset()
            figures["purge"] = purge_rate(options["purge_rows"], options["purge_batch"])
            bench.reset()
            figures["web_tier"] = self._web_tier(bench, options, log_dir)
            bench.reset()
            figures["desk"] = desk_pages(options["desk_operations"], options["desk_samples"], say)
            bench.reset()
        with Bench(latency=options["latency"], log_dir=log_dir, say=say, tls=True) as bench:
            say(f"over TLS: fenced vs unfenced with {best}, 2 workers, session reuse...")
            compared = _side_by_side(
                bench, n, workers=2, worker_class=best, rounds=options["rounds"]
            )
            bench.set_latency(0)
            figures["tls"] = {
                **compared.figures(n),
                "session_reuse": session_reuse(bench, options["session_charges"]),
            }
            bench.reset()
        self._report(figures, out, options)

    def _instructions(
        self, bench: Bench, options: BenchOptions, say: Callable[[str], None]
    ) -> dict[str, float] | None:
        """Worker instructions per checkout under callgrind, fenced and unfenced (None:
        valgrind is not installed)."""
        if not instructions.available():
            say("worker instructions per checkout: skipped, valgrind is not installed")
            return None
        small, large = (int(n) for n in options["instruction_orders"].split(","))
        say(f"worker instructions per checkout under callgrind ({small} then {large})...")
        bench.set_latency(0)  # the count does not depend on it; the run is shorter
        counted = {
            side: instructions.per_checkout(bench, prepare, small=small, large=large)
            for side, prepare in (("fenced", fenced), ("unfenced", unfenced))
        }
        bench.set_latency(options["latency"])
        return counted

    def _web_tier(self, bench: Bench, options: BenchOptions, log_dir: Path) -> dict[str, Any]:
        """gunicorn on direct connections vs through PgBouncer under the same checkout load."""
        workers = options["web_workers"]
        sizes = options["web_pool_sizes"]
        pool_sizes = (
            [int(s) for s in sizes.split(",")] if sizes else sorted({workers, 1}, reverse=True)
        )
        shape = LoadShape(
            orders=options["web_orders"],
            duplicates=options["web_duplicates"],
            concurrency=options["web_concurrency"],
        )
        self.stdout.write(
            f"web tier: {shape.requests} checkout requests ({shape.orders} orders x "
            f"{shape.duplicates} duplicates), {shape.concurrency} at once..."
        )
        return web_tier(
            database=connection.settings_dict,
            workers=workers,
            shape=shape,
            pool_sizes=pool_sizes,
            rounds=options["web_rounds"],
            log_dir=log_dir,
            reset=bench.reset,
            say=self.stdout.write,
        )

    def _peer(self, bench: Bench, options: BenchOptions, say: Callable[[str], None]) -> dict:
        say(
            f"the fence beside DBOS: {options['peer_rounds']} rounds of "
            f"{options['peer_orders']} checkouts a side, then DBOS's crash check..."
        )
        return peer_figures(
            bench, options["peer_orders"], options["peer_rounds"], options["peer_crash_orders"]
        )

    def _report(self, figures: dict[str, Any], out: Path, options: BenchOptions) -> None:
        """Save the figures, print the table and the web tier's verdict; a full run also
        writes the table into docs/benchmarks.md (a section alone would replace it with
        a part)."""
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2, sort_keys=True))
        table = _table(figures)
        if "peer" in figures:  # its own section of docs/benchmarks.md, below
            table += [f"  {a}: {b}" for a, b in peer_rows(figures["peer"])]
        for line in table:
            self.stdout.write(line)
        verdict = _web_verdict(figures["web_tier"]) if "web_tier" in figures else []
        for line, ok in verdict:
            self.stdout.write(self.style.SUCCESS(line) if ok else self.style.ERROR(line))
        self.stdout.write(f"\nSaved to {out}")
        if options["only"] is None and not options["no_doc"]:
            try:
                write_between_markers(page(), DOC_TABLE, _markdown(figures, verdict))
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(f"Written into {page()}")
        if "peer" in figures and not options["no_doc"]:  # its own section: --only peer too
            try:
                write_between_markers(page(), PEER_TABLE, peer_markdown(figures["peer"]))
            except ValueError as exc:
                raise CommandError(str(exc)) from exc


def _opt_in_backend(bench: Bench, options: BenchOptions, n: int, best: str) -> dict[str, Any]:
    """Fenced vs unfenced on the opt-in backend (BEGIN with the first statement), as on
    the default: 2 workers at the bench's latency, 4 at the realistic one."""
    rounds, slow = options["rounds"], options["realistic_latency"]
    bench.use_backend("begin_with_first_statement")
    try:
        default = _side_by_side(bench, n, workers=2, worker_class=best, rounds=rounds)
        bench.set_latency(slow)
        realistic = _side_by_side(bench, n // 2, workers=4, worker_class=best, rounds=rounds)
    finally:
        bench.set_latency(options["latency"])
        bench.use_backend("django")
    return {
        "worker_class": best,
        "default_latency": default.figures(n),
        "realistic_latency": realistic.figures(n // 2),
    }


@dataclass
class SideBySide:
    """Alternating batches of two sides: each side's best seconds, the ratio of each round's
    pair (run back to back, on the machine as it was then), each metered batch's CPU."""

    seconds: dict[str, float]
    round_ratios: list[float]
    cpu: dict[str, list[dict[str, float]]]

    def figures(self, n: int, names: tuple[str, str] = ("fenced", "unfenced")) -> dict[str, Any]:
        """Checkouts per second of each side, their ratio (best against best) and the rounds',
        keyed by the sides' `names` (the noise floor's two sides are both the twin)."""
        first, second = self.seconds["fenced"], self.seconds["unfenced"]
        a, b = names
        return {
            f"{a}_checkouts_per_second": n / first,
            f"{b}_checkouts_per_second": n / second,
            f"{a}_to_{b}": second / first,
            f"{a}_to_{b}_by_round": self.round_ratios,
        }


def _side_by_side(
    bench: Bench,
    n: int,
    *,
    workers: int,
    worker_class: str,
    rounds: int,
    sides: tuple[Callable[[int], Callable[[], int]], Callable[[int], Callable[[], int]]] = (
        fenced,
        unfenced,
    ),
) -> SideBySide:
    """Alternate batches of n checkouts of the two `sides` (called fenced and unfenced)
    `rounds` times: each side's best seconds (the machine is shared), each round's
    unfenced / fenced seconds, and each metered batch's CPU per checkout by side.

    The rounds take turns at going first (fenced then unfenced, then unfenced then
    fenced, ...): a batch's place in its round must not favour a side. The noise floor
    (the unfenced twin against itself) read 0.96 in the median with the same side always
    first.
    """
    seconds: dict[str, list[float]] = {"fenced": [], "unfenced": []}
    cpu: dict[str, list[dict[str, float]]] = {"fenced": [], "unfenced": []}
    for turn in range(rounds):
        order = list(zip(("fenced", "unfenced"), sides, strict=True))
        for side, prepare in order if turn % 2 == 0 else order[::-1]:
            seconds[side].append(
                bench.batch(prepare(n), workers=workers, worker_class=worker_class)
            )
            cpu[side] += [bench.cpu.ms_per(jobs_per_checkout())] if bench.cpu else []
    return SideBySide(
        seconds={side: min(runs) for side, runs in seconds.items()},
        round_ratios=[u / f for f, u in zip(seconds["fenced"], seconds["unfenced"], strict=True)],
        cpu=cpu,
    )


#: The sides whose CPU per checkout the table shows, and the process kinds, in order.
CPU_SIDES = ("fenced", "unfenced")
CPU_ROLES = ("workers", "postgres", "redis", "provider")


def _mean(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each process kind's mean over the runs (empty if no run was metered)."""
    return {role: sum(run[role] for run in runs) / len(runs) for role in runs[0]} if runs else {}


def _cpu_sum(ms: dict[str, float]) -> str:
    """`a + b + c + d = total` in CPU_ROLES' order, or `n/a` for a batch never metered."""
    if not ms:
        return "n/a"
    parts = [ms[role] for role in CPU_ROLES]
    return " + ".join(f"{part:.1f}" for part in parts) + f" = {sum(parts):.1f}"


def _instr(f: dict) -> str:
    """Fenced and unfenced instructions per checkout, and what the fence adds."""
    counted = f.get("instructions_per_checkout")
    if not counted:
        return "n/a (valgrind is not installed)"
    fenced, unfenced = counted["fenced"] / 1e6, counted["unfenced"] / 1e6
    return (
        f"{fenced:.1f} M / {unfenced:.1f} M (the fence: {fenced - unfenced:+.1f} M, "
        f"{fenced / unfenced:.2f}x)"
    )


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _table(f: dict) -> list[str]:
    """The figures as aligned lines, for the terminal."""
    rows = _rows(f)
    width = max(len(a) for a, _ in rows)
    return [""] + [f"  {a:<{width}}  {b}" for a, b in rows]


def _markdown(f: dict, verdict: list[tuple[str, bool]]) -> list[str]:
    """The figures as a Markdown table, and the web tier's verdict, for docs/benchmarks.md."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| figure | measured |", "| --- | --- |"]
    lines += [f"| {cell(a)} | {cell(b)} |" for a, b in _rows(f)]
    return lines + [""] + [f"* {line}" for line, _ in verdict]


def _rows(f: dict) -> list[tuple[str, str]]:
    rows = [
        ("machine", f["machine"]),
        ("provider latency per charge", f"{f['provider_latency_seconds'] * 1000:.0f} ms"),
    ]
    if "worker_classes" in f:
        rows += _queue_rows(f)
    if "web_tier" in f:
        rows += _web_rows(f["web_tier"])
    if "desk" in f:
        rows += desk_rows(f["desk"])
    return rows


def _queue_rows(f: dict) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for cls, v in f["worker_classes"].items():
        rows += [
            (f"{cls}: no-op jobs/s (context)", f"{v['noop_jobs_per_second']:.0f}"),
            (f"{cls}: fenced checkouts/s", f"{v['fenced_checkouts_per_second']:.1f}"),
            (f"{cls}: unfenced checkouts/s", f"{v['unfenced_checkouts_per_second']:.1f}"),
            (
                f"{cls}: fenced / unfenced, 2 workers (goal >= {DEFAULT_LATENCY_GOAL})",
                f"{_ratio(v)}; {_goal(v['fenced_to_unfenced'], DEFAULT_LATENCY_GOAL)}",
            ),
            (
                f"{cls}: fenced jobs/s / no-op jobs/s (context)",
                f"{v['fenced_jobs_to_noop_jobs']:.2f}",
            ),
            (
                f"{cls}: CPU ms per checkout, fenced / unfenced: "
                "workers + PostgreSQL + Redis + provider",
                " / ".join(_cpu_sum(v["cpu_ms_per_checkout"][side]) for side in CPU_SIDES),
            ),
        ]
    best = f["faster_worker_class"]
    rows.append(("faster worker class", best))
    rows.append(
        (
            f"{best}: fenced / unfenced at most, {SHORT_CHARGE_WORKERS} workers, if the fence "
            "cost its workers nothing but its statements' CPU in PostgreSQL (the workers' "
            "backends)",
            _ceiling_text(f["worker_classes"][best], workers=SHORT_CHARGE_WORKERS),
        )
    )
    r = f["realistic_latency"]
    rows.append(
        (
            f"at {r['latency_seconds'] * 1000:.0f} ms per charge, {r['workers']} workers: "
            f"fenced / unfenced (goal >= {REALISTIC_LATENCY_GOAL})",
            f"{_ratio(r)}; {_goal(r['fenced_to_unfenced'], REALISTIC_LATENCY_GOAL)}; "
            f"{r['fenced_checkouts_per_second']:.1f} vs "
            f"{r['unfenced_checkouts_per_second']:.1f} checkouts/s",
        )
    )
    if "begin_with_first_statement" in f:
        rows += _backend_rows(f)
    if "noise_floor" in f:
        rows.append(
            (
                "noise floor, 2 workers: unfenced / unfenced (the same work on both sides)",
                _ratio(f["noise_floor"], "first_to_second"),
            )
        )
    d = f["db_round_trips"]
    for side, goal in (("fenced", " (goal <= 15, <= 7 commits)"), ("unfenced", "")):
        w = d[side]["worker_per_checkout"]
        rows.append(
            (
                f"DB round trips per {side} checkout, worker side{goal}",
                f"{_trips(w)}; {w['transactions']:.1f} transactions committed "
                f"({w['commits']:.1f} COMMIT + {w['autocommits']:.1f} single statements)",
            )
        )
        by_job = d[side]["by_job"]
        rows.append(
            (
                f"DB round trips per {side} job, by job function",
                ", ".join(
                    f"{name.rsplit('.', 1)[-1]} {trips['total']:.1f}"
                    for name, trips in sorted(by_job.items())
                ),
            )
        )
    rows.append(
        (
            "Redis round trips per checkout, worker side, fenced / unfenced (the job, RQ's "
            "start and end of it, the fence's two metric counts)",
            f"{d['fenced']['worker_per_checkout'].get('redis', 0):.1f} / "
            f"{d['unfenced']['worker_per_checkout'].get('redis', 0):.1f}",
        )
    )
    rows.append(
        (
            "WAL bytes per checkout, worker side, fenced / unfenced",
            f"{d['fenced']['wal_bytes_per_checkout']:,.0f} / "
            f"{d['unfenced']['wal_bytes_per_checkout']:,.0f} (every row version and index "
            "entry written)",
        )
    )
    rows.append(("worker instructions per checkout (callgrind), fenced / unfenced", _instr(f)))
    a = d["fenced"]["api_per_checkout"]
    rows.append(
        (
            "DB round trips per fenced checkout, API side (goal <= 6)",
            f"{_trips(a)} (unfenced: 0, it only enqueues)",
        )
    )
    t = f["tls"]
    rows.append(
        (
            "over TLS, 2 workers: fenced / unfenced",
            f"{_ratio(t)}; {t['fenced_checkouts_per_second']:.1f} vs "
            f"{t['unfenced_checkouts_per_second']:.1f} checkouts/s",
        )
    )
    for label, s in (("HTTP", f["session_reuse_http"]), ("TLS", t["session_reuse"])):
        rows.append(
            (
                f"{label}: ms per charge, session reused / new session per charge",
                f"{s['reuse_ms']:.2f} / {s['new_session_ms']:.2f} "
                f"(saving {s['saving_ms']:.2f} ms per charge)",
            )
        )
    s = f["scaling"]
    rows.append(
        ("fenced checkouts/s with 1 / 2 / 4 workers", f"{s['1']:.1f} / {s['2']:.1f} / {s['4']:.1f}")
    )
    c = f["inbox_ms_per_job"]
    rows.append(
        (
            "inbox: ms per job unprotected / protected",
            f"{c['unprotected']:.2f} / {c['protected']:.2f}",
        )
    )
    rows.append(("inbox cost ratio (goal <= 1.15)", f"{f['inbox_cost_ratio']:.2f}"))
    r = f["reconciler"]
    rows.append(
        (
            "reconciler: uncertain claims settled/s",
            f"{r['per_second']:.1f} ({r['settled']} of {r['uncertain']})",
        )
    )
    p = f["purge"]
    rows += [
        ("purge: rows", f"{p['rows']:,}"),
        (
            "purge: batched rows/s",
            f"{p['batched_rows_per_second']:,.0f} ({p['batches']} batches, largest "
            f"{p['largest_batch']:,} rows, at most {p['batch_size']:,}, aiming at "
            f"{p['batch_seconds_target'] * 1000:.0f} ms)",
        ),
        ("purge: one unbounded DELETE rows/s", f"{p['unbounded_rows_per_second']:,.0f}"),
        (
            "purge: longest batch, DELETE to COMMIT (goal <= 50 ms)",
            f"{p['longest_batch_seconds'] * 1000:.1f} ms",
        ),
        (
            "purge: batched / unbounded rate (goal >= 0.5)",
            f"{p['ratio_batched_to_unbounded_rate']:.2f}",
        ),
    ]
    return rows


#: The throughput goals, fenced / unfenced, measured on the default backend (Django's).
DEFAULT_LATENCY_GOAL = 0.95
REALISTIC_LATENCY_GOAL = 0.97


def ceiling(v: dict[str, Any], *, workers: int) -> dict[str, float] | None:
    """What fenced / unfenced could at best read, with the fence's statements as they are.

    A worker's checkout is serial: its own CPU, its backend's, the provider's
    answer. Were everything the fence adds on the workers free (its Python, its
    Redis counts), a fenced checkout would still take what an unfenced one takes
    (`checkout_ms`: `workers` over the twin's checkouts per second, its best
    batch) plus the CPU its statements cost the workers' PostgreSQL backends
    over the twin's (`backend_ms`, the batches' mean). `allowed_ms` is what the
    default goal leaves for the fence's whole cost, `backend_ms` included. None
    if a side's batches were never metered. Only for FenceWorker: the forking
    Worker opens a connection per job, whose backend ends before the meter
    reads it. The backends' CPU includes each batch's first use of its
    connections (the fence's statements prepared, the catalog read), which a
    long-lived worker pays once: it errs against the fence, by a little.
    """
    cpu = v["cpu_ms_per_checkout"]
    if not all("backends" in cpu.get(side, {}) for side in CPU_SIDES):
        return None
    backend_ms = cpu["fenced"]["backends"] - cpu["unfenced"]["backends"]
    checkout_ms = workers * 1000 / v["unfenced_checkouts_per_second"]
    return {
        "ratio": checkout_ms / (checkout_ms + max(backend_ms, 0.0)),
        "backend_ms": backend_ms,
        "checkout_ms": checkout_ms,
        "allowed_ms": checkout_ms / DEFAULT_LATENCY_GOAL - checkout_ms,
    }


def _ceiling_text(v: dict[str, Any], *, workers: int) -> str:
    c = ceiling(v, workers=workers)
    if c is None:
        return "n/a (not metered)"
    return (
        f"{c['ratio']:.3f}: backends {c['backend_ms']:+.1f} ms CPU per checkout on an unfenced "
        f"checkout of {c['checkout_ms']:.1f} ms per worker; the goal of "
        f"{DEFAULT_LATENCY_GOAL} allows {c['allowed_ms']:.1f} ms for all the fence adds"
    )


def _goal(ratio: float, goal: float) -> str:
    """Whether a fenced / unfenced ratio meets its goal, or by how much it misses."""
    return "met" if ratio >= goal else f"misses by {goal - ratio:.2f}"


def _backend_rows(f: dict) -> list[tuple[str, str]]:
    """The throughput goals on each database backend: Django's (the default, the goals'),
    then the opt-in one that sends a transaction's BEGIN with its first statement."""
    opt_in = f["begin_with_first_statement"]
    default = f["worker_classes"][opt_in["worker_class"]]
    rows = []
    for label, goal, stock, begin_with_first in (
        (
            f"{f['provider_latency_seconds'] * 1000:.0f} ms, 2 workers",
            DEFAULT_LATENCY_GOAL,
            default,
            opt_in["default_latency"],
        ),
        (
            f"{f['realistic_latency']['latency_seconds'] * 1000:.0f} ms, "
            f"{f['realistic_latency']['workers']} workers",
            REALISTIC_LATENCY_GOAL,
            f["realistic_latency"],
            opt_in["realistic_latency"],
        ),
    ):
        rows.append(
            (
                f"fenced / unfenced at {label}, {opt_in['worker_class']}: Django's backend "
                f"(default) / BEGIN with the first statement (opt-in); goal >= {goal}",
                f"{stock['fenced_to_unfenced']:.2f} "
                f"({_goal(stock['fenced_to_unfenced'], goal)}) / "
                f"{begin_with_first['fenced_to_unfenced']:.2f}",
            )
        )
    return rows


def _side_name(side: str) -> str:
    return "direct" if side == "direct" else f"PgBouncer pool {side.rsplit('_', 1)[1]}"


def _web_rows(w: dict) -> list[tuple[str, str]]:
    """The web tier's figures, one column per side (direct, then each PgBouncer pool)."""
    sides = w["sides"]

    def each(fmt: Callable[[dict], str]) -> str:
        return " / ".join(fmt(v) for v in sides.values())

    return [
        (
            f"web tier: {w['workers']} gunicorn workers, {w['orders'] * w['duplicates']} "
            f"checkouts ({w['orders']} keys x {w['duplicates']}), {w['concurrency']} at once",
            " / ".join(_side_name(side) for side in sides),
        ),
        ("web: requests/s", each(lambda v: f"{v['requests_per_second']:.1f}")),
        ("web: p50 / p99 latency, ms", each(lambda v: f"{v['p50_ms']:.0f}, {v['p99_ms']:.0f}")),
        (
            "web: 5xx + connection errors (goal 0)",
            each(lambda v: str(v["server_errors"] + v["connection_errors"])),
        ),
        (
            "web: answers by status",
            each(lambda v: ", ".join(f"{code} x {count}" for code, count in v["statuses"].items())),
        ),
        (
            "web: operations per key, max (goal 1)",
            each(lambda v: str(v["operations_per_key"]["max"])),
        ),
        (
            "web: CPU ms per request: gunicorn + PostgreSQL + PgBouncer + load generator",
            each(_cpu_per_request),
        ),
        (
            "web: cores busy with the run / load average before it (other processes)",
            each(lambda v: f"{v['cores_busy']:.2f}, {v['load_average_before']:.1f}"),
        ),
        (
            "web: keys whose duplicates were all in flight together",
            each(lambda v: f"{v['keys_in_flight_together']} of {v['keys']}"),
        ),
    ]


def _cpu_per_request(v: dict) -> str:
    cpu = v["cpu_ms_per_request"]
    parts = [cpu["gunicorn"], cpu["postgresql"], cpu.get("pgbouncer", 0.0), cpu["load_generator"]]
    return " + ".join(f"{part:.1f}" for part in parts) + f" = {sum(parts):.1f}"


def _web_verdict(w: dict) -> list[tuple[str, bool]]:
    """One line per side: the fence's promise under concurrent duplicates, held or broken."""
    lines = []
    for side, v in w["sides"].items():
        if v["violations"]:
            lines.append(
                (f"web tier, {_side_name(side)}: BROKEN: {'; '.join(v['violations'])}", False)
            )
        else:
            lines.append(
                (
                    f"web tier, {_side_name(side)}: held: every request answered 202, "
                    "one created per key and the others replays, one operation per key, 0 5xx",
                    True,
                )
            )
    return lines


def _ratio(v: dict[str, Any], key: str = "fenced_to_unfenced") -> str:
    """A side-by-side's ratio (best batch against best batch), then its rounds' spread: how
    far apart two batches run back to back land on this machine."""
    rounds = v.get(f"{key}_by_round") or []
    spread = (
        f" (rounds {min(rounds):.2f}-{max(rounds):.2f}, median {statistics.median(rounds):.2f})"
        if rounds
        else ""
    )
    return f"{v[key]:.2f}{spread}"


def _trips(t: dict[str, float]) -> str:
    """A round-trip total and the parts it adds up from (devtools.bench.dbcount.RoundTrips)."""
    text = (
        f"{t['total']:.1f} = {t['statements']:.1f} statements ({t['savepoints']:.1f} savepoint) "
        f"+ {t['begins']:.1f} BEGIN + {t['commits']:.1f} COMMIT + {t['rollbacks']:.1f} ROLLBACK "
        f"+ {t['health_checks']:.1f} health checks + {t['prepares']:.1f} prepares"
    )
    if t.get("syncs") or t.get("pipelined"):
        text += (
            f" + {t['syncs']:.1f} pipelines - {t['pipelined']:.1f} sent in a pipeline "
            "(a statement and its COMMIT wait for one answer)"
        )
    if t.get("deallocates"):
        text += f" + {t['deallocates']:.1f} DEALLOCATE"
    return text
