"""`make bench-history`: the operator pages, recovery, the audit and checkouts, small and large.

Real checkouts run through the worker against the fake provider; their rows
are copied (devtools.bench.history) to `--small` operations, everything is
measured, then copied on to `--operations` and measured again. Each figure is
printed at both sizes with the ratio large/small beside it.
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

from devtools.bench.history import Template, copies_for, load
from devtools.bench.runner import WORKER_CLASSES, Bench, fenced
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
    ("orders, default", "admin:payments_order_changelist", ""),
    ("orders, search e-mail", "admin:payments_order_changelist", "?q={email}"),
    ("admin index", "admin:index", ""),
    ("needs attention", "admin:payments_operation_needs_attention", ""),
)


class Command(BaseCommand):
    help = (
        "Load a year of history copied from real checkouts and measure, at --small and at "
        "--operations operations: the operator pages' server time (p50/p95), one recovery "
        "interval, the 1-day and 30-day fence_audit (time, peak memory) and checkout "
        "throughput, with the ratio large/small. Needs a database of its own (its name must "
        "end in _bench): it empties it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--operations", type=int, default=1_000_000, help="Large size.")
        parser.add_argument("--small", type=int, default=10_000, help="Small size.")
        parser.add_argument("--template", type=int, default=20, help="Real checkouts copied.")
        parser.add_argument("--samples", type=int, default=20, help="Requests per page.")
        parser.add_argument("--checkouts", type=int, default=100, help="Checkouts per batch.")
        parser.add_argument("--latency", type=float, default=0.0, help="Provider latency (s).")

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
            template = Template.read()
            spread = copies_for(template, options["operations"])
            figures: dict[str, dict[str, float]] = {}
            for label, size in (("small", options["small"]), ("large", options["operations"])):
                copies = copies_for(template, size)
                loaded = Operation.objects.count()
                first = max(1, loaded // max(1, template.operation_count))
                say(f"loading to {size} operations...")
                started = time.monotonic()
                load(template, copies, first=first, spread_over=spread)
                say(f"  {Operation.objects.count()} operations ({time.monotonic() - started:.0f}s)")
                figures[label] = self._measure(bench, worker_class, options, say)
        self._report(figures)

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
        for window in ("1d", "30d"):
            seconds, peak = _audit(window)
            found[f"audit {window} s"] = seconds
            found[f"audit {window} peak MB"] = peak / 1e6
        say("  checkouts beside the history...")
        n = options["checkouts"]
        seconds = bench.batch(fenced(n), workers=1, worker_class=worker_class, keep_rows=True)
        found["checkouts per second"] = n / seconds
        return found

    def _report(self, figures: dict[str, dict[str, float]]) -> None:
        small, large = figures["small"], figures["large"]
        width = max(len(name) for name in small)
        self.stdout.write(f"{'':{width}}  {'small':>10}  {'large':>10}  {'large/small':>11}")
        for name, value in small.items():
            ratio = large[name] / value if value else float("nan")
            self.stdout.write(f"{name:{width}}  {value:10.2f}  {large[name]:10.2f}  {ratio:11.2f}")


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


def _recovery_interval() -> tuple[float, float]:
    """One round of `run_recovery` (a sweep and a reconciler round; nothing due): its
    seconds, and the seconds its SQL statements took (the rest is Redis and Python)."""
    in_sql: list[float] = []

    def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            in_sql.append(time.perf_counter() - started)

    started = time.perf_counter()
    with connection.execute_wrapper(timed):
        sweep()
        reconcile(time_budget=30.0)
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
