"""`make demo`: the chaos run. No double charge, no double refund, nothing lost, whatever dies."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict, Unpack

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from devtools.chaos.ha import HaSchedule, run_ha, timeline_lines
from devtools.chaos.report import table, write_files
from devtools.chaos.run import ChaosConfig, pending_work, run_chaos


def _rate(value: str) -> float:
    rate = float(value)
    if not 0 <= rate <= 1:
        raise ValueError(value)
    return rate


def _interval(value: str) -> tuple[float, float]:
    low, _, high = value.partition("-")
    pair = (float(low), float(high or low))
    if pair[0] <= 0 or pair[1] < pair[0]:
        raise ValueError(value)
    return pair


#: The seconds of `make demo`'s provider incident (`--incident`): short, as the run is.
DEMO_INCIDENT = 30.0

#: The exit code of a run whose work did not drain in time (1: an invariant was violated).
NOT_DRAINED = 3


class DemoOptions(TypedDict):
    """The options add_arguments declares, with the types their parsers give."""

    orders: int
    workers: int
    drop_rate: float
    slow_rate: float
    fail_rate: float
    decline_rate: float
    capture_rate: float
    refund_rate: float
    kill_interval: tuple[float, float]
    no_flush: bool
    seed: int
    timeout: float
    worker_class: str | None
    no_reckless: bool
    search_lag: float
    grace: int
    no_webhooks: bool
    no_export: bool
    adyen_rate: float
    endpoint_down: float
    incident: float
    incident_drop: float
    topology: str
    fault_gap: float
    output: str | None


class Command(BaseCommand):
    help = (
        "Chaos run: start the fake provider with faults, K real RQ workers, the API server and "
        "the recovery loop; check N orders out through the HTTP API while a random worker that "
        "has started working is SIGKILLed every few seconds and Redis is flushed once; once "
        "orders are paid, refund a share of them through the API (half partially, half "
        "fully), still under the kills and the provider's faults; wait until every operation "
        "is settled; print and save a report (JSON and HTML). Exits 1 on any invariant "
        "violation, 3 when the work did not drain within --timeout (a slow machine: pass a "
        "longer one)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        d = ChaosConfig()
        parser.add_argument("--orders", type=int, default=d.orders, help="N orders.")
        parser.add_argument("--workers", type=int, default=d.workers, help="K workers.")
        parser.add_argument(
            "--drop-rate",
            type=_rate,
            default=d.drop_rate,
            help="Charges accepted, then the connection dropped.",
        )
        parser.add_argument(
            "--slow-rate",
            type=_rate,
            default=d.slow_rate,
            help="Charges answered after the client's timeout.",
        )
        parser.add_argument(
            "--fail-rate",
            type=_rate,
            default=d.fail_rate,
            help="500s (half before executing, half after).",
        )
        parser.add_argument(
            "--decline-rate",
            type=_rate,
            default=d.decline_rate,
            help="Orders paid with a card that is declined.",
        )
        parser.add_argument(
            "--capture-rate",
            type=_rate,
            default=d.capture_rate,
            help="Orders paid by manual capture (a hold, then a capture of 50-100 %% of it).",
        )
        parser.add_argument(
            "--refund-rate",
            type=_rate,
            default=d.refund_rate,
            help="Orders refunded once paid, through the API: half partially, half fully "
            "(some as two partial refunds). Chosen from the seed.",
        )
        parser.add_argument(
            "--kill-interval",
            type=_interval,
            default=(d.kill_min, d.kill_max),
            metavar="MIN-MAX",
            help="Seconds between worker kills, e.g. 0.5-2.",
        )
        parser.add_argument("--no-flush", action="store_true", help="Do not flush Redis.")
        parser.add_argument("--seed", type=int, default=d.seed, help="Replay a run's choices.")
        parser.add_argument(
            "--timeout",
            type=float,
            default=d.timeout,
            help="Seconds to wait for every operation to settle.",
        )
        parser.add_argument(
            "--worker-class", default=None, help="RQ worker class, e.g. rq.worker.SimpleWorker."
        )
        parser.add_argument(
            "--no-reckless",
            action="store_true",
            help='No reckless operator (by default one presses "mark failed" then "start a '
            'new attempt" on every uncertain, needs-review and failed checkout the desk offers).',
        )
        parser.add_argument(
            "--search-lag",
            type=float,
            default=d.search_lag,
            metavar="SECONDS",
            help="How far the provider's search lags behind its writes (it must decide nothing).",
        )
        parser.add_argument(
            "--grace",
            type=int,
            default=d.grace,
            metavar="SECONDS",
            help="RECONCILE_GRACE of the run's processes and of the reckless operator's desk.",
        )
        parser.add_argument(
            "--no-webhooks",
            action="store_true",
            help="No provider events: uncertain outcomes are settled by the reconciler and by "
            "workers' replays alone.",
        )
        parser.add_argument(
            "--adyen-rate",
            type=_rate,
            default=d.adyen_rate,
            metavar="RATE",
            help="The share of orders made and paid (checkouts, captures, refunds) through a "
            "shop that pays through a fake Adyen of the run's own, under the same rates and "
            "kills, its signed notifications to the run's web process; 0: none.",
        )
        parser.add_argument(
            "--no-export",
            action="store_true",
            help="No invoice export: by default every paid order is exported to a fake "
            "accounting API of the run's own, under the same drop, fail and slow rates and "
            "worker kills; the report counts its invoices (one per export).",
        )
        parser.add_argument(
            "--endpoint-down",
            type=float,
            default=d.endpoint_down,
            metavar="SECONDS",
            help="With webhooks: the web process that receives them is SIGKILLed once a quarter "
            "of the orders are checked out and started again SECONDS later; 0: never.",
        )
        parser.add_argument(
            "--incident",
            type=float,
            default=DEMO_INCIDENT,
            metavar="SECONDS",
            help="A provider incident once a third of the orders are in: every new request "
            "held in flight for SECONDS (a same-key request meanwhile: 409), a share of the "
            "answers dropped; the report shows the audit rows per operation it caught, what "
            "the desk showed at its midpoint and how it settled after. 0: none. "
            f"Default {DEMO_INCIDENT:g}; 240 for a four-minute one (with a longer --timeout).",
        )
        parser.add_argument(
            "--incident-drop",
            type=_rate,
            default=d.incident_drop,
            metavar="RATE",
            help="The share of answers the incident drops instead of holding them.",
        )
        parser.add_argument(
            "--topology",
            choices=("single", "ha"),
            default="single",
            help="single: the processes on this host's PostgreSQL and Redis (default). ha: a "
            "PostgreSQL cluster of the run's own behind PgBouncer (transaction pooling), Redis "
            "with a replica and three sentinels, 3 recovery processes; a Redis master failover, "
            "a PgBouncer restart and a PostgreSQL restart while charges are in flight, each on "
            "a timeline with the throughput around it (no Redis flush).",
        )
        parser.add_argument(
            "--fault-gap",
            type=float,
            default=HaSchedule().gap,
            metavar="SECONDS",
            help="With --topology ha: seconds from one fault's end to the next fault.",
        )
        parser.add_argument(
            "--output", default=None, help="Directory for report.json and report.html."
        )

    def handle(self, *args: object, **options: Unpack[DemoOptions]) -> None:
        if not settings.DEBUG:
            raise CommandError(
                "demo starts workers with DEBUG on and flushes its Redis database: it is a "
                "development tool; set DEBUG=1 (make demo gives it its own database and Redis)."
            )
        if options["orders"] < 1 or options["workers"] < 1:
            raise CommandError("--orders and --workers must be at least 1.")
        if options["endpoint_down"] < 0:
            raise CommandError("--endpoint-down must not be negative.")
        if options["incident"] < 0:
            raise CommandError("--incident must not be negative.")
        if options["search_lag"] < 0 or options["grace"] < 1:
            raise CommandError("--search-lag must not be negative and --grace at least 1.")
        kill_min, kill_max = options["kill_interval"]
        config = ChaosConfig(
            orders=options["orders"], workers=options["workers"],
            drop_rate=options["drop_rate"], slow_rate=options["slow_rate"],
            fail_rate=options["fail_rate"], decline_rate=options["decline_rate"],
            refund_rate=options["refund_rate"], capture_rate=options["capture_rate"],
            kill_min=kill_min, kill_max=kill_max, flush=not options["no_flush"],
            seed=options["seed"], timeout=options["timeout"],
            worker_class=options["worker_class"],
            webhooks=not options["no_webhooks"], endpoint_down=options["endpoint_down"],
            reckless=not options["no_reckless"], search_lag=options["search_lag"],
            grace=options["grace"], incident=options["incident"],
            incident_drop=options["incident_drop"], export=not options["no_export"],
            adyen_rate=options["adyen_rate"],
        )  # fmt: skip
        var = Path(settings.BASE_DIR) / "var"
        self.stdout.write(
            f"Chaos run: {config.orders} orders, {config.workers} workers, kills every "
            f"{kill_min}-{kill_max}s, faults drop {config.drop_rate:.0%} / slow "
            f"{config.slow_rate:.0%} / 500 {config.fail_rate:.0%}, declines "
            f"{config.decline_rate:.0%}, captures {config.capture_rate:.0%}, refunds {config.refund_rate:.0%} of the orders, "
            f"seed {config.seed}; search lags {config.search_lag:g}s, grace {config.grace}s, "
            + ("a reckless operator at the desk; " if config.reckless else "")
            + (f"a {config.incident:g}s provider incident; " if config.incident else "")
            + (
                f"webhooks on (duplicates, reordering, delays; endpoint down "
                f"{config.endpoint_down:g}s mid-run)"
                if config.webhooks
                else "webhooks off"
            )
        )
        # The in-process actors (the reckless operator, the reconciler the report runs) log
        # JSON records: to a file, so that the console shows the run's progress and report.
        in_process = var / "log" / "demo.log"
        self.stdout.write(f"In-process logs: {in_process}")
        with logs_to(in_process):
            if options["topology"] == "ha":
                if options["fault_gap"] <= 0:
                    raise CommandError("--fault-gap must be positive.")
                gap = options["fault_gap"]
                schedule = HaSchedule(first_after=min(5.0, gap), gap=gap, window=min(5.0, gap / 2))
                result = run_ha(
                    config, log_dir=var / "log", say=self.stdout.write, schedule=schedule
                )
            else:
                result = run_chaos(config, log_dir=var / "log", say=self.stdout.write)
        if not result.report:
            raise CommandError("the chaos run did not finish; see the logs")
        self.stdout.write("")
        for line in table(result):
            self.stdout.write(line)
        if "timeline" in result.report:
            for line in timeline_lines(result.report):
                self.stdout.write(line)
        out = Path(options["output"]) if options["output"] else var / "demo" / result.run_id
        json_path, html_path = write_files(result, out)
        self.stdout.write(f"\nReport: {html_path}\n        {json_path}")
        if result.violations:
            raise CommandError("invariant violated: " + "; ".join(result.violations))
        if not result.report.get("settled_in_time"):
            left = result.pending or pending_work(result)
            pending = ", ".join(f"{state} {n}" for state, n in sorted(left.items()))
            raise CommandError(
                f"not drained in time: {pending or 'nothing'} still pending after "
                f"{config.timeout:g} s (no invariant was violated by what settled). A slow or "
                f"busy machine: pass a longer --timeout (make demo DEMO_ARGS='--timeout "
                f"{int(config.timeout * 2)}').",
                returncode=NOT_DRAINED,
            )
        self.stdout.write(
            self.style.SUCCESS(
                "No double charge, no charge without a claim, one invoice and one ledger line per "
                "paid order; no double refund, no over-refund, no refund without a claim, one "
                "credit note per refund; every operation settled."
            )
        )


@contextmanager
def logs_to(path: Path) -> Iterator[None]:
    """Send this process's log records to `path` (with the console's format and filters)
    instead of the console while the block runs; the console handlers come back after."""
    root = logging.getLogger()
    consoles = [
        h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, mode="w")
    if consoles:
        to_file.setFormatter(consoles[0].formatter)
        for kept in consoles[0].filters:
            to_file.addFilter(kept)
    for console in consoles:
        root.removeHandler(console)
    root.addHandler(to_file)
    try:
        yield
    finally:
        root.removeHandler(to_file)
        to_file.close()
        for console in consoles:
            root.addHandler(console)
