"""`make bench-history`: the operator pages, recovery, the audit and checkouts, small and large.

Real checkouts run through the worker against the fake provider (the
template, then a batch timed on the nearly empty database, then `--declined`
checkouts the provider refuses: failed operations, as a shop's history holds
them); their rows are copied
(devtools.bench.history) to `--small` operations, everything is measured,
then copied on to `--operations` and measured again. Each figure is printed
at both sizes with the ratio large/small and the issue's goal beside it, and
the table is written into docs/benchmarks.md (devtools.bench.doc).
"""

from __future__ import annotations

import functools
import io
import logging
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from django.test import Client
from django.urls import reverse

from devtools.bench.doc import page, write_between_markers
from devtools.bench.history import Template, copies_for, first_free_copy, load
from devtools.bench.runner import WORKER_CLASSES, Bench, fenced
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.recovery import reconcile, sweep
from payments.models import Operation, StepClaim

#: (name, URL name, query) of each operator page measured.
PAGES = (
    ("operations, default", "admin:payments_operation_changelist", ""),
    ("operations, failed", "admin:payments_operation_changelist", "?state__exact=failed"),
    ("operations, kind", "admin:payments_operation_changelist", "?kind=checkout"),
    ("search pi_ reference", "admin:payments_operation_changelist", "?q={reference}"),
    ("search order id", "admin:payments_operation_changelist", "?q={order}"),
    ("search e-mail", "admin:payments_operation_changelist", "?q={email}"),
    ("orders, default", "admin:shop_order_changelist", ""),
    ("orders, search e-mail", "admin:shop_order_changelist", "?q={email}"),
    ("admin index", "admin:index", ""),
    ("needs attention", "admin:payments_operation_needs_attention", ""),
    ("metrics scrape", "metrics", ""),
)
#: The issue's goals (#32), at the large size: a page's p95, a recovery interval's SQL.
PAGE_P95_MS = 300.0
RECOVERY_SQL_MS = 50.0
#: `manage.py reconcile` with nothing to do, large over small (#39): flat with history.
RECONCILE_RATIO = 3.0
#: The 30-day audit's peak memory over the 1-day one's; checkouts large over empty.
AUDIT_MEMORY_RATIO = 2.0
CHECKOUT_RATIO = 0.95
#: The markers of the table in docs/benchmarks.md.
DOC_TABLE = "bench-history-table"


class Command(BaseCommand):
    help = (
        "Load a year of history copied from real checkouts and measure, at --small and at "
        "--operations operations: the operator pages' server time (p50/p95), one recovery "
        "interval, `manage.py reconcile`, the 1-day and 30-day fence_audit (time, peak "
        "memory) and checkout "
        "throughput, with the ratio large/small. Needs a database of its own (its name must "
        "end in _bench): it empties it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--operations", type=int, default=1_000_000, help="Large size.")
        parser.add_argument("--small", type=int, default=10_000, help="Small size.")
        parser.add_argument("--template", type=int, default=20, help="Real checkouts copied.")
        parser.add_argument(
            "--declined",
            type=int,
            default=20,
            help="Checkouts the provider refuses, copied with the real ones: the failed "
            "operations of the history (20 beside the 320 paid: 2%% of its operations).",
        )
        parser.add_argument("--samples", type=int, default=20, help="Requests per page.")
        parser.add_argument("--checkouts", type=int, default=100, help="Checkouts per batch.")
        parser.add_argument(
            "--checkout-rounds",
            type=int,
            default=3,
            help="Checkout batches timed at each size; each size keeps its fastest (the "
            "machine is shared: two batches in a row differ by several percent).",
        )
        parser.add_argument("--latency", type=float, default=0.0, help="Provider latency (s).")
        parser.add_argument(
            "--no-doc",
            action="store_true",
            help="Do not write the table into docs/benchmarks.md (print it only).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        name = connection.settings_dict["NAME"]
        if not name.endswith("_bench"):
            raise CommandError(
                f"the bench empties its database; {name!r} does not end in _bench "
                "(make bench-history sets DATABASE_URL for you)"
            )
        if options["small"] >= options["operations"]:
            raise CommandError("--small must be below --operations.")
        for logger in ("payments", "inbox"):
            logging.getLogger(logger).setLevel(logging.WARNING)
        say = self.stdout.write
        log_dir = Path(settings.BASE_DIR) / "var" / "log" / "bench"
        worker_class = next(iter(WORKER_CLASSES))
        with Bench(latency=options["latency"], log_dir=log_dir, say=say) as bench:
            say(f"template: {options['template']} real checkouts through the worker...")
            bench.batch(fenced(options["template"]), workers=1, worker_class=worker_class)
            say("checkouts on the empty database...")
            empty = _checkouts_per_second(bench, worker_class, options)
            if options["declined"]:
                say(f"{options['declined']} checkouts the provider refuses...")
                bench.batch(
                    _declined(options["declined"]),
                    workers=1,
                    worker_class=worker_class,
                    keep_rows=True,
                )
            template = Template.read()  # every batch's rows: real checkouts, all of them
            spread = copies_for(template, options["operations"])
            figures: dict[str, dict[str, float]] = {}
            for label, size in (("small", options["small"]), ("large", options["operations"])):
                loaded = Operation.objects.count()
                # Copies until `size` operations, from the first whose ids are free.
                first = first_free_copy(template)
                missing = size - loaded
                copies = first - 1 + copies_for(template, missing + template.operation_count)
                say(f"loading to {size} operations...")
                started = time.monotonic()
                load(template, copies, first=first, spread_over=max(spread, copies))
                say(f"  {Operation.objects.count()} operations ({time.monotonic() - started:.0f}s)")
                figures[label] = self._measure(bench, worker_class, options, say)
        self._report(figures, empty, options)

    def _measure(
        self, bench: Bench, worker_class: str, options: dict[str, Any], say: Callable[[str], None]
    ) -> dict[str, float]:
        found: dict[str, float] = {}
        client = Client()
        client.force_login(_superuser())
        terms = _terms()
        for name, url_name, query in PAGES:
            url = reverse(url_name) + query.format(**terms)
            times = [
                _timed(functools.partial(_get, client, url)) for _ in range(options["samples"])
            ]
            found[f"{name} p50 ms"] = statistics.median(times) * 1000
            found[f"{name} p95 ms"] = _p95(times) * 1000
        rounds = [_recovery_interval() for _ in range(5)]
        found["recovery interval ms"] = statistics.median(r[0] for r in rounds) * 1000
        found["recovery interval SQL ms"] = statistics.median(r[1] for r in rounds) * 1000
        rounds = [_reconcile_command() for _ in range(5)]
        found["reconcile ms"] = statistics.median(r[0] for r in rounds) * 1000
        found["reconcile SQL ms"] = statistics.median(r[1] for r in rounds) * 1000
        for window in ("1d", "30d"):
            seconds, peak = _audit(window)
            found[f"audit {window} s"] = seconds
            found[f"audit {window} peak MB"] = peak / 1e6
        say("  checkouts beside the history...")
        found["checkouts per second"] = _checkouts_per_second(bench, worker_class, options)
        return found

    def _report(
        self, figures: dict[str, dict[str, float]], empty: float, options: dict[str, Any]
    ) -> None:
        lines = _table(figures, empty, options)
        for line in lines:
            self.stdout.write(line)
        if not options["no_doc"]:
            try:
                write_between_markers(page(), DOC_TABLE, lines)
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(f"\nWritten into {page()}")


def _checkouts_per_second(bench: Bench, worker_class: str, options: dict[str, Any]) -> float:
    """The fastest of `--checkout-rounds` batches of `--checkouts` checkouts, in checkouts
    per second; their rows are kept (the history they add is a few hundred operations)."""
    n = options["checkouts"]
    fastest = min(
        bench.batch(fenced(n), workers=1, worker_class=worker_class, keep_rows=True)
        for _ in range(options["checkout_rounds"])
    )
    return n / fastest


def _table(
    figures: dict[str, dict[str, float]], empty: float, options: dict[str, Any]
) -> list[str]:
    """The figures as a Markdown table: small, large, large/small, the goal and its verdict."""
    small, large = figures["small"], figures["large"]
    lines = [
        f"{options['small']:,} and {options['operations']:,} operations "
        f"({options['template']} real checkouts and {options['declined']} declined ones "
        f"copied; {options['samples']} requests a page, "
        f"{options['checkouts']} checkouts a batch, the fastest of "
        f"{options['checkout_rounds']} batches, 1 worker).",
        "",
        "| figure | small | large | large/small | goal | met |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for name, value in small.items():
        ratio = large[name] / value if value else float("nan")
        goal, met = _goal(name, value, large[name])
        lines.append(f"| {name} | {value:.2f} | {large[name]:.2f} | {ratio:.2f} | {goal} | {met} |")
    audit = [size["audit 30d peak MB"] / size["audit 1d peak MB"] for size in (small, large)]
    lines.append(
        f"| audit peak memory 30d / 1d | {audit[0]:.2f} | {audit[1]:.2f} | | "
        f"<= {AUDIT_MEMORY_RATIO:g} | {_yes(audit[1] <= AUDIT_MEMORY_RATIO)} |"
    )
    checkouts = [size["checkouts per second"] / empty for size in (small, large)]
    lines.append(
        f"| checkouts per second / empty database's ({empty:.2f}) | {checkouts[0]:.2f} | "
        f"{checkouts[1]:.2f} | | >= {CHECKOUT_RATIO:g} | {_yes(checkouts[1] >= CHECKOUT_RATIO)} |"
    )
    return lines


def _goal(name: str, small: float, large: float) -> tuple[str, str]:
    """The goal a figure is held to at the large size, and whether it meets it."""
    if name.endswith("p95 ms"):
        return f"<= {PAGE_P95_MS:g}", _yes(large <= PAGE_P95_MS)
    if name == "recovery interval SQL ms":
        return f"<= {RECOVERY_SQL_MS:g}", _yes(large <= RECOVERY_SQL_MS)
    if name == "reconcile SQL ms":
        ratio = large / small if small else float("inf")
        return f"large/small <= {RECONCILE_RATIO:g}", _yes(ratio <= RECONCILE_RATIO)
    return "", ""


def _yes(met: bool) -> str:
    return "yes" if met else "**no**"


def _superuser() -> User:
    user, _ = User.objects.get_or_create(
        username="bench-history", defaults={"is_staff": True, "is_superuser": True}
    )
    return user


def _terms() -> dict[str, str]:
    """A reference, an order id and an e-mail from the middle of the history."""
    last = StepClaim.objects.order_by("-id").values_list("id", flat=True).first() or 0
    middle = (
        StepClaim.objects.filter(id__gte=last // 2, provider_reference__startswith="pi_")
        .exclude(provider_reference="")
        .order_by("id")
        .only("provider_reference")
        .first()
    )
    op = Operation.objects.filter(entity_type="order").order_by("-id").first()
    order = op.entity_id if op is not None else "1"
    return {
        "reference": middle.provider_reference if middle is not None else "pi_none",
        "order": order,
        "email": f"buyer{order}@example.com",
    }


def _get(client: Client, url: str) -> None:
    response = client.get(url)
    if response.status_code != 200:
        raise CommandError(f"{url} answered {response.status_code}")


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _p95(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def _declined(n: int) -> Callable[[], int]:
    """Ask for n checkouts with a card the provider refuses: each a failed operation."""

    def prepare() -> int:
        for i in range(n):
            order = create_order(amount=1000 + i, currency="eur", email="bench@example.com")
            request_checkout(
                order_id=order.pk,
                key=f"bench-declined-{order.pk}",
                payment_method="pm_card_chargeDeclined",
                actor="bench",
            )
        return n  # a refused checkout has no follow-up

    return prepare


def _recovery_interval() -> tuple[float, float]:
    """One round of `run_recovery` (a sweep and a reconciler round; nothing due): its
    seconds, and the seconds its SQL statements took (the rest is Redis and Python)."""

    def interval() -> None:
        sweep()
        reconcile(time_budget=30.0)

    return _with_sql_time(interval)


def _reconcile_command() -> tuple[float, float]:
    """`manage.py reconcile` (nothing uncertain, nothing stranded: it reads the failed
    operations and the unsettled claims only): its seconds, and its SQL statements'."""
    return _with_sql_time(lambda: call_command("reconcile", stdout=io.StringIO()))


def _with_sql_time(call: Callable[[], object]) -> tuple[float, float]:
    """Run `call`: its seconds, and the seconds its SQL statements took."""
    in_sql: list[float] = []

    def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            in_sql.append(time.perf_counter() - started)

    started = time.perf_counter()
    with connection.execute_wrapper(timed):
        call()
    return time.perf_counter() - started, sum(in_sql)


def _audit(window: str) -> tuple[float, int]:
    """fence_audit over `window`: seconds and peak traced memory (findings are expected:
    the provider knows only the template's intents)."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        call_command("fence_audit", "--since", window, "--format", "json", stdout=io.StringIO())
    except CommandError:
        pass  # exit 1: the copies' references are unknown to the provider
    finally:
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return seconds, peak
