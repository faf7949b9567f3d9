"""Run a fake payment provider as a standalone HTTP server until SIGINT/SIGTERM.

`--contract stripe` (the default) serves the Stripe-compatible fake of
`devtools.fake_provider.server`; `--contract adyen` serves the fake Adyen Checkout API
of `devtools.fake_provider.adyen` (its contract and sources in that package's docstring);
`--contract accounting` serves the fake accounting API of the invoice export
(`devtools.fake_provider.accounting`, its contract in that package's docstring).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from devtools.fake_provider.accounting.server import FakeAccountingServer
from devtools.fake_provider.adyen.contract import KEY_RETENTION_MINIMUM
from devtools.fake_provider.adyen.server import FakeAdyenServer
from devtools.fake_provider.server import FakeProviderServer

RATE_OPTIONS = (
    "drop_after_accept_rate",
    "slow_rate",
    "fail_before_rate",
    "fail_after_rate",
    "rate_limit_rate",
)
CONTRACTS = ("stripe", "adyen", "accounting")
#: Seconds each contract keeps an idempotency key by default: Stripe's 24 hours,
#: Adyen's documented minimum of 7 days, the accounting API's 24 hours.
KEY_RETENTION = {"stripe": 86400.0, "adyen": KEY_RETENTION_MINIMUM, "accounting": 86400.0}
#: Options that only the Stripe fake has, with their defaults (refused with adyen).
STRIPE_ONLY = {
    "tls": False,
    "ca_file": None,
    "webhook_secret": None,
    "search_lag": 0.0,
    "rate_limit_rate": 0.0,
    "webhook_reorder_rate": 0.0,
    "webhook_delay_rate": 0.0,
}
#: Options that only the Adyen fake has, with their defaults (refused with stripe).
ADYEN_ONLY = {"hmac_key": None, "merchant_account": None, "capture": "immediate"}


class Command(BaseCommand):
    help = (
        "Serve a fake payment provider (its own in-memory state) with optional seeded fault "
        "injection: the Stripe-compatible one (--contract stripe, the default; see "
        "devtools.fake_provider.server) or Adyen's Checkout API (--contract adyen; see "
        "devtools.fake_provider.adyen), or the accounting API of the invoice export "
        "(--contract accounting; see devtools.fake_provider.accounting). Control it over /_fake/."
    )
    # The fake shares nothing with the app; it must start even when the app's
    # own configuration checks fail (it is what those checks talk to).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--contract",
            choices=CONTRACTS,
            default="stripe",
            help="Which provider's contract to serve (default stripe).",
        )
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
            default=None,
            help="Seconds an idempotency key is remembered (default 86400 with stripe, as at "
            "Stripe; 604800 with adyen, Adyen's documented minimum of 7 days).",
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
            "http://127.0.0.1:8000/webhooks/provider. Needs --webhook-secret (stripe) or "
            "--hmac-key (adyen: standard notifications, retried until [accepted]).",
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
            help="The only API key to accept (default: any key starting with sk_ with "
            "stripe, any X-API-Key with adyen, any Bearer key with accounting).",
        )
        parser.add_argument(
            "--hmac-key",
            default=None,
            help="adyen: the notification endpoint's HMAC key, in hex (signs "
            "additionalData.hmacSignature). Needs --webhook-url.",
        )
        parser.add_argument(
            "--merchant-account",
            action="append",
            default=None,
            help="adyen: a merchant account the API key may use (repeat for more; default: any).",
        )
        parser.add_argument(
            "--capture",
            choices=("immediate", "manual"),
            default="immediate",
            help="adyen: the merchant account's capture setting (default immediate).",
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
        if options["key_retention"] is None:
            options["key_retention"] = KEY_RETENTION[options["contract"]]
        for name in ("slow_delay", "latency", "search_lag", "key_retention"):
            if options[name] < 0:
                raise CommandError(f"--{name.replace('_', '-')} must not be negative.")
        _refuse_other_contract_options(options, rates)
        if options["contract"] == "accounting":
            self._serve(self._accounting(options), options)
            return
        if options["contract"] == "adyen":
            self._serve(self._adyen(options, rates), options)
            return

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
        self._serve(server, options)

    def _adyen(self, options: dict[str, Any], rates: dict[str, float]) -> FakeAdyenServer:
        """Build the fake Adyen Checkout API from the options."""
        if bool(options["webhook_url"]) != bool(options["hmac_key"]):
            raise CommandError("--webhook-url and --hmac-key go together.")
        # Typed Any: the fake's own config fields, apart from its constructor's arguments.
        adyen_rates: dict[str, Any] = {
            name: rate for name, rate in rates.items() if name != "rate_limit_rate"
        }
        try:
            return FakeAdyenServer(
                options["host"],
                options["port"],
                api_key=options["api_key"],
                merchant_accounts=tuple(options["merchant_account"] or ()),
                capture=options["capture"],
                seed=options["seed"],
                slow_delay=options["slow_delay"],
                latency=options["latency"],
                key_retention=options["key_retention"],
                notification_url=options["webhook_url"],
                hmac_key=options["hmac_key"],
                notification_options={
                    "duplicate_rate": options["webhook_duplicate_rate"],
                    "seed": options["seed"],
                },
                **adyen_rates,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        except OSError as exc:
            raise CommandError(f"Cannot bind {options['host']}:{options['port']}: {exc}") from exc

    def _accounting(self, options: dict[str, Any]) -> FakeAccountingServer:
        """Build the fake accounting API from the options (its faults: the control API)."""
        try:
            return FakeAccountingServer(
                options["host"],
                options["port"],
                api_key=options["api_key"],
                seed=options["seed"],
                slow_delay=options["slow_delay"],
                latency=options["latency"],
                key_retention=options["key_retention"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        except OSError as exc:
            raise CommandError(f"Cannot bind {options['host']}:{options['port']}: {exc}") from exc

    def _serve(
        self,
        server: FakeProviderServer | FakeAdyenServer | FakeAccountingServer,
        options: dict[str, Any],
    ) -> None:
        """Serve until SIGINT or SIGTERM, then stop the server."""
        stop = threading.Event()
        # Set an event from the handlers; the main thread does the shutdown, so
        # no server method runs inside a signal handler.
        previous = {
            sig: signal.signal(sig, lambda *_: stop.set())
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        server.start()
        if isinstance(server, FakeAccountingServer):
            self.stdout.write(f"Fake accounting API listening on {server.url}")
        elif isinstance(server, FakeAdyenServer):
            self.stdout.write(f"Fake Adyen Checkout API listening on {server.url}")
            self.stdout.write(f"Checkout base URL (the library's baseUrl): {server.checkout_url}")
            if server.notifications is not None:
                self.stdout.write(f"Sending signed notifications to {server.notifications.url}")
        else:
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


def _refuse_other_contract_options(options: dict[str, Any], rates: dict[str, float]) -> None:
    """Refuse an option of another contract given a value other than its default."""
    other: dict[str, Any]
    if options["contract"] == "accounting":
        # Its faults are queued or given rates over its control API (/_fake/faults, /config).
        other = {**STRIPE_ONLY, **ADYEN_ONLY, **dict.fromkeys(rates, 0.0), "webhook_url": None}
    else:
        other = STRIPE_ONLY if options["contract"] == "adyen" else ADYEN_ONLY
    for name, default in other.items():
        if options[name] != default:
            raise CommandError(
                f"--{name.replace('_', '-')} does not apply to --contract {options['contract']}."
            )
