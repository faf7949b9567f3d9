"""Delete expired inbox entries in short batches; meant for cron, like clearsessions."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from inbox.conf import inbox_settings
from inbox.durations import format_duration, parse_duration
from inbox.services import purge_expired

PROGRESS_EVERY = 10


class Command(BaseCommand):
    help = (
        "Delete inbox entries older than their consumer's retention (INBOX['RETENTION']), "
        "in batches that each commit on their own, so no lock is held for long. "
        "Can be run as a cronjob."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--consumer",
            help="Purge only this consumer (queue name). Default: every consumer.",
        )
        parser.add_argument(
            "--older-than",
            metavar="DURATION",
            help=(
                "Delete entries older than this (30m, 12h, 7d, 3600s) instead of the configured "
                "retention. Shorter than the redelivery horizon lets redelivered messages run again."
            ),
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            help="Rows deleted per transaction. Default: INBOX['PURGE_BATCH_SIZE'] (1000).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the expired entries; delete nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        verbosity: int = options["verbosity"]
        consumer: str | None = options["consumer"]
        older_than = self._older_than(options["older_than"])
        try:
            conf = inbox_settings()
        except ImproperlyConfigured as exc:
            raise CommandError(f"Invalid INBOX settings: {exc}") from exc
        batch_size = options["batch_size"]
        if batch_size is None:
            batch_size = conf.purge_batch_size
        if batch_size < 1:
            raise CommandError(f"--batch-size must be a positive number, got {batch_size}.")
        if older_than is not None and older_than < conf.redelivery_horizon:
            self.stderr.write(
                self.style.WARNING(
                    f"--older-than {format_duration(older_than)} is shorter than the redelivery "
                    f"horizon ({format_duration(conf.redelivery_horizon)}): a message RQ hands "
                    "back after its entry is deleted runs again."
                )
            )

        def progress(batch: int, deleted: int, seconds: float) -> None:
            if verbosity >= 2 or (verbosity >= 1 and batch % PROGRESS_EVERY == 0):
                self.stdout.write(
                    f"Batch {batch}: {deleted} entries deleted so far ({seconds:.3f}s)."
                )

        try:
            result = purge_expired(
                consumer=consumer,
                older_than=older_than,
                batch_size=batch_size,
                dry_run=options["dry_run"],
                progress=progress,
            )
        except DatabaseError as exc:
            raise CommandError(f"Purging the inbox failed: {exc}") from exc

        if verbosity < 1:
            return
        scope = f"consumer {consumer!r}" if consumer else "all consumers"
        age = f"older than {format_duration(older_than)}" if older_than else "past retention"
        if result.dry_run:
            self.stdout.write(
                f"Dry run: {result.matched} inbox entries of {scope} {age} would be deleted."
            )
        else:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Deleted {result.deleted} inbox entries of {scope} {age} in "
                    f"{result.batches} batches (longest {result.longest_batch_seconds:.3f}s)."
                )
            )

    def _older_than(self, text: str | None) -> timedelta | None:
        if text is None:
            return None
        try:
            duration = parse_duration(text)
        except ValueError as exc:
            raise CommandError(f"--older-than: {exc}") from exc
        if duration <= timedelta(0):
            raise CommandError("--older-than must be longer than zero.")
        return duration
