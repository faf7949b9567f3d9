"""Re-enqueue operations that are due but have no live RQ job."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from payments.engine.recovery import sweep


class Command(BaseCommand):
    help = (
        "Re-enqueue operations that are due (pending, retrying past their time, or running "
        "with an expired lease) but have no live RQ job. Safe to run at any time: the fence "
        "stops duplicates."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="List, enqueue nothing.")
        parser.add_argument("--batch-size", type=int, default=500, help="Operations per run.")

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size: int = options["batch_size"]
        if batch_size < 1:
            raise CommandError("--batch-size must be at least 1.")
        try:
            report = sweep(dry_run=options["dry_run"], batch_size=batch_size)
        except Exception as exc:
            raise CommandError(f"sweep failed: {type(exc).__name__}: {exc}") from exc
        verb = "would dispatch" if options["dry_run"] else "dispatched"
        if options["verbosity"] >= 2:
            for key in report.dispatched:
                self.stdout.write(f"{verb} {key}")
        self.stdout.write(
            self.style.SUCCESS(
                f"Sweep: {report.examined} due, {report.live} with a live job, "
                f"{len(report.dispatched)} {verb}."
            )
        )
