"""Run the fake payment provider as a standalone HTTP server until SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
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
            "--tls",
            action="store_true",
            help="Serve HTTPS with a throwaway certificate (trustme); its CA goes to --ca-file.",
        )
        parser.add_argument(
            "--ca-file",
            default=None,
            help="With --tls: where to write the CA (PEM) for REQUESTS_CA_BUNDLE "
            "(default var/fake_provider/ca.pem).",
        )
        parser.add_argument(
            "--webhook-url",
            default=None,
            help="POST every event (signed, retried until a 2xx) to this URL, e.g. "
            "http://127.0.0.1:8000/webhooks/provider. Needs --webhook-secret.",
        )
        parser.add_argument(
            "--webhook-secret",
            default=None,
            help="The signing secret of the webhooks (the app's PAYMENT_PROVIDER_WEBHOOK_SECRET).",
        )
        for fault in ("duplicate", "reorder", "delay"):
            parser.add_argument(
                f"--webhook-{fault}-rate",
                dest=f"webhook_{fault}_rate",
                type=float,
                default=0.0,
                help=f"Share (0..1) of events that get the '{fault}' webhook fault.",
            )
        parser.add_argument(
            "--webhook-delay",
            type=float,
            default=2.0,
            help="Seconds a delayed webhook waits before its first attempt (default 2).",
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

        if bool(options["webhook_url"]) != bool(options["webhook_secret"]):
            raise CommandError("--webhook-url and --webhook-secret go together.")
        webhook_options = {
            "duplicate_rate": options["webhook_duplicate_rate"],
            "reorder_rate": options["webhook_reorder_rate"],
            "delay_rate": options["webhook_delay_rate"],
            "delay": options["webhook_delay"],
            "seed": options["seed"],
        }
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
                tls=options["tls"],
                webhook_url=options["webhook_url"],
                webhook_secret=options["webhook_secret"],
                webhook_options=webhook_options,
                **rates,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        except OSError as exc:
            raise CommandError(f"Cannot bind {options['host']}:{options['port']}: {exc}") from exc
        if options["tls"]:
            ca_file = server.write_ca(
                options["ca_file"] or Path(settings.BASE_DIR) / "var" / "fake_provider" / "ca.pem"
            )
            self.stdout.write(f"CA certificate (for REQUESTS_CA_BUNDLE): {ca_file}")

        stop = threading.Event()
        # Set an event from the handlers; the main thread does the shutdown, so
        # no server method runs inside a signal handler.
        previous = {
            sig: signal.signal(sig, lambda *_: stop.set())
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        server.start()
        self.stdout.write(f"Fake payment provider listening on {server.url}")
        if server.webhooks is not None:
            self.stdout.write(f"Sending signed webhooks to {server.webhooks.url}")
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
