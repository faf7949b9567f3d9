"""Purge the history of old finished operations in short batches; meant for cron."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from inbox.management.commands.purge_inbox import stop_requested
from payments.conf import payments_settings
from payments.engine.retention import PurgeReport, cutoff_for, purge_history

PROGRESS_EVERY = 10


class Command(BaseCommand):
    help = (
        "Delete the claims, audit rows and provider events of finished operations whose last "
        "change is older than PAYMENTS['RETENTION_DAYS'] (400), in batches that each commit "
        "on their own; the operation rows stay (their keys are never taken again). Never "
        "touches an operation that may still move. SIGTERM or SIGINT stops it between two "
        "batches; run it again to go on."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=int,
            help="Operations per transaction. Default: PAYMENTS['PURGE_BATCH_SIZE'] (500).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the operations whose history would be purged; delete nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        conf = payments_settings()
        batch_size = options["batch_size"] or conf.purge_batch_size
        if batch_size < 1:
            raise CommandError(f"--batch-size must be a positive number, got {batch_size}.")
        cutoff = cutoff_for(conf.retention_days, timezone.now())
        verbosity = options["verbosity"]

        def progress(report: PurgeReport) -> None:
            if verbosity >= 2 or (verbosity >= 1 and report.batches % PROGRESS_EVERY == 0):
                self.stdout.write(
                    f"Batch {report.batches}: {report.operations} operations purged so far."
                )

        with stop_requested() as signals:
            try:
                report = purge_history(
                    cutoff=cutoff,
                    batch_size=batch_size,
                    dry_run=options["dry_run"],
                    should_stop=lambda: bool(signals),
                    progress=progress,
                )
            except DatabaseError as exc:
                raise CommandError(f"Purging the history failed: {exc}") from exc

        when = f"last changed before {cutoff:%Y-%m-%d %H:%M} ({conf.retention_days} days)"
        if report.dry_run:
            self.stdout.write(f"Dry run: the history of {report.operations} operations {when}.")
            return
        summary = (
            f"the history of {report.operations} operations {when}: {report.claims} claims, "
            f"{report.audit_rows} audit rows, {report.provider_events} provider events, "
            f"{report.audit_runs} audit runs, in {report.batches} batches (longest "
            f"{report.longest_batch_seconds * 1000:.1f} ms)."
        )
        if report.interrupted:
            raise CommandError(
                f"Stopped by {signals[0]} between two batches after purging {summary} "
                "Every batch committed whole; run it again to purge the rest."
            )
        if verbosity >= 1:
            self.stdout.write(self.style.SUCCESS(f"Purged {summary}"))
