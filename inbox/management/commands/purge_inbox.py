"""Delete expired inbox entries in short batches; meant for cron, like clearsessions."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from inbox.conf import inbox_settings
from inbox.durations import format_duration, parse_duration
from inbox.services import purge_expired

PROGRESS_EVERY = 10
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_requested() -> Iterator[list[str]]:
    """Collect SIGTERM/SIGINT while the purge runs, instead of dying mid-batch.

    Yield a list that gets the signal's name; the purge checks it between
    batches, so the batch under way still commits. Off the main thread
    (where signal handlers cannot be set) the signals keep their handlers.
    """
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handle(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Command(BaseCommand):
    help = (
        "Delete inbox entries older than their consumer's retention (INBOX['RETENTION']), "
        "in batches that each commit on their own, so no lock is held for long "
        "(INBOX['PURGE_BATCH_SECONDS']). Can be run as a cronjob; SIGTERM or SIGINT stops it "
        "between two batches."
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
            help=(
                "At most this many rows per transaction; batches adapt below it to "
                "INBOX['PURGE_BATCH_SECONDS']. Default: INBOX['PURGE_BATCH_SIZE'] (20000)."
            ),
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

        with stop_requested() as signals:
            try:
                result = purge_expired(
                    consumer=consumer,
                    older_than=older_than,
                    batch_size=batch_size,
                    dry_run=options["dry_run"],
                    progress=progress,
                    should_stop=lambda: bool(signals),
                )
            except DatabaseError as exc:
                raise CommandError(f"Purging the inbox failed: {exc}") from exc

        scope = f"consumer {consumer!r}" if consumer else "all consumers"
        age = f"older than {format_duration(older_than)}" if older_than else "past retention"
        summary = (
            f"{result.deleted} inbox entries of {scope} {age} in {result.batches} batches "
            f"(largest {result.largest_batch} rows, longest "
            f"{result.longest_batch_seconds * 1000:.1f} ms from DELETE to COMMIT)."
        )
        if result.interrupted:
            raise CommandError(
                f"Stopped by {signals[0]} between two batches after deleting {summary} "
                "Every batch committed whole; run it again to delete the rest."
            )
        if verbosity < 1:
            return
        if result.dry_run:
            self.stdout.write(
                f"Dry run: {result.matched} inbox entries of {scope} {age} would be deleted."
            )
        else:
            self.stdout.write(self.style.SUCCESS(f"Deleted {summary}"))

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
