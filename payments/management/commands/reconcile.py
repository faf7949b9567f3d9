"""Ask the provider what happened to uncertain steps and settle them."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from payments.engine.recovery import reconcile


class Command(BaseCommand):
    help = (
        "Settle uncertain step claims by asking the provider (stored reference, else a replay "
        "with the same idempotency key, else a consistent list; never the provider's search, "
        "which lags). Never charges with a new key."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="List, ask nothing.")
        parser.add_argument("--batch-size", type=int, default=200, help="Claims per run.")

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1.")
        try:
            report = reconcile(dry_run=options["dry_run"], batch_size=batch_size)
        except Exception as exc:
            raise CommandError(f"reconcile failed: {type(exc).__name__}: {exc}") from exc
        if options["verbosity"] >= 2:
            for outcome, keys in sorted(report.outcomes.items()):
                for key in keys:
                    self.stdout.write(f"{outcome}: {key}")
        summary = ", ".join(f"{len(k)} {o}" for o, k in sorted(report.outcomes.items()))
        self.stdout.write(
            self.style.SUCCESS(
                f"Reconcile: {report.examined} examined; {summary or 'nothing to do'}."
            )
        )
