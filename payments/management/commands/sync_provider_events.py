"""Catch up on provider events missed while the webhook endpoint was down."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inbox.durations import parse_duration
from payments.engine.handlers import systems_called
from payments.engine.systems import DEFAULT_SYSTEM
from payments.webhooks.sync import sync_events


class Command(BaseCommand):
    help = (
        "Read the provider's events (GET /v1/events) created in the last --since and handle "
        "the ones not handled yet, through the same inbox-protected path as the webhooks. "
        "Idempotent: events handled before are skipped."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--since",
            default="24h",
            help="How far back to read, with a unit: 30m, 24h, 3d (default 24h).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            since = parse_duration(options["since"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if not since:
            raise CommandError("--since must be longer than 0s.")
        if DEFAULT_SYSTEM not in systems_called():  # a project that pays through none
            self.stdout.write("No registered handler calls the provider: no events to read.")
            return
        try:
            report = sync_events(since=since)
        except Exception as exc:  # the provider is down, or answers nonsense
            raise CommandError(f"sync failed: {type(exc).__name__}: {exc}") from exc
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(report.outcomes.items()))
        self.stdout.write(
            self.style.SUCCESS(
                f"Provider events since {options['since']}: {report.listed} listed, "
                f"{report.stored} missed and now stored, {report.not_handled_types} of types "
                f"not handled; {outcomes or 'nothing to handle'}."
            )
        )
