"""Run the sweeper and the reconciler in a loop (one process per deployment)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from payments.engine.recovery import reconcile, sweep


class Command(BaseCommand):
    help = (
        "Every --interval seconds, sweep (re-enqueue due operations without a live job) and "
        "reconcile (settle uncertain claims). Stops on SIGTERM or SIGINT."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--interval", type=float, default=10.0, help="Seconds between runs.")
        parser.add_argument("--once", action="store_true", help="Run one round and exit.")

    def handle(self, *args: Any, **options: Any) -> None:
        interval: float = options["interval"]
        if interval <= 0:
            raise CommandError("--interval must be positive.")
        stop = threading.Event()
        # A quiet round prints nothing: this line says the loop is alive, and how often
        # (flushed: under systemd or docker stdout is a pipe, buffered).
        if options["once"]:
            self.stdout.write("run_recovery: one round (a sweep and a reconcile)")
        else:
            # One round needs no handlers (nor does the caller of call_command lose its own).
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            self.stdout.write(
                f"run_recovery: a sweep and a reconcile every {interval:g} s; a round that "
                "finds nothing prints nothing; stops on SIGTERM or Ctrl-C"
            )
        self.stdout.flush()
        while not stop.is_set():
            close_old_connections()
            # Each half runs even when the other fails (Redis down must not stop
            # reconciliation, a provider outage must not stop the sweep).
            try:
                swept = sweep()
            except Exception as exc:
                self.stderr.write(f"sweep failed: {type(exc).__name__}: {exc}")
            else:
                if swept.dispatched or options["verbosity"] >= 2:
                    self.stdout.write(
                        f"swept {len(swept.dispatched)} of {swept.examined} due operations"
                    )
            # A connection the sweep's error left broken (a PostgreSQL or PgBouncer
            # restart cut it) is replaced here, not failed on by the reconcile.
            close_old_connections()
            try:
                settled = reconcile(time_budget=max(interval * 3, 30.0))
            except Exception as exc:
                self.stderr.write(f"reconcile failed: {type(exc).__name__}: {exc}")
            else:
                if settled.examined or options["verbosity"] >= 2:
                    self.stdout.write(
                        f"reconciled {settled.examined}: "
                        + ", ".join(f"{len(k)} {o}" for o, k in sorted(settled.outcomes.items()))
                    )
            if options["once"]:
                break
            stop.wait(interval)
