"""Run the fake payment provider as a standalone HTTP server until SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from devtools.fake_provider.server import FakeProviderServer

RATE_OPTIONS = (
    "drop_after_accept_rate",
    "slow_rate",
    "fail_before_rate",
    "fail_after_rate",
    "rate_limit_rate",
)


class Command(BaseCommand):
    help = (
        "Serve the fake Stripe-compatible payment provider (its own in-memory state) with "
        "optional seeded fault injection. Control it over /_fake/ (see devtools.fake_provider.server)."
    )
    # The fake shares nothing with the app; it must start even when the app's
    # own configuration checks fail (it is what those checks talk to).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1)."
        )
        parser.add_argument(
            "--port", type=int, default=8765, help="Port to bind; 0 picks a free one."
        )
        parser.add_argument(
            "--seed", type=int, default=None, help="Seed for random fault injection."
        )
        for name in RATE_OPTIONS:
            mode = name.removesuffix("_rate")
            parser.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                type=float,
                default=0.0,
                help=f"Share (0..1) of create requests that get the '{mode}' fault.",
            )
        parser.add_argument(
            "--slow-delay",
            type=float,
            default=12.0,
            help="Seconds a 'slow' fault waits before answering (default 12, above the 10 s read timeout).",
        )
        parser.add_argument(
            "--latency",
            type=float,
            default=0.0,
            help="Seconds every create request takes (default 0; Stripe's take hundreds of ms).",
        )
        parser.add_argument(
            "--search-lag",
            type=float,
            default=0.0,
            help="Seconds before a new intent shows up in search results (default 0).",
        )
        parser.add_argument(
            "--key-retention",
            type=float,
            default=86400.0,
            help="Seconds an idempotency key is remembered (default 86400, as at Stripe).",
        )
        parser.add_argument(
            "--api-key",
            default=None,
            help="The only API key to accept (default: any key starting with sk_).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        rates = {name: options[name] for name in RATE_OPTIONS}
        for name, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise CommandError(
                    f"--{name.replace('_', '-')} must be between 0 and 1, got {rate}."
                )
        if sum(rates.values()) > 1.0:
            raise CommandError("The fault rates must add up to at most 1.")
        for name in ("slow_delay", "latency", "search_lag", "key_retention"):
            if options[name] < 0:
                raise CommandError(f"--{name.replace('_', '-')} must not be negative.")

        try:
            server = FakeProviderServer(
                options["host"],
                options["port"],
                api_key=options["api_key"],
                seed=options["seed"],
                slow_delay=options["slow_delay"],
                latency=options["latency"],
                search_lag=options["search_lag"],
                key_retention=options["key_retention"],
                **rates,
            )
        except OSError as exc:
            raise CommandError(f"Cannot bind {options['host']}:{options['port']}: {exc}") from exc

        stop = threading.Event()
        # Set an event from the handlers; the main thread does the shutdown, so
        # no server method runs inside a signal handler.
        previous = {
            sig: signal.signal(sig, lambda *_: stop.set())
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        server.start()
        self.stdout.write(f"Fake payment provider listening on {server.url}")
        self.stdout.flush()
        try:
            while not stop.wait(0.5):
                pass
        finally:
            server.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if options["verbosity"] >= 2:
                self.stdout.write(f"Stopped; stats: {server.state.stats()}")
