"""Retention: purge_expired, the opportunistic purge and the purge_inbox command."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from inbox.durations import format_duration, parse_duration
from inbox.handlers import inbox_guard
from inbox.models import InboxEntry
from inbox.services import purge_expired

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 1, 15, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def add_entries(consumer: str, handled_at: datetime, count: int = 1) -> None:
    InboxEntry.objects.bulk_create(
        InboxEntry(consumer=consumer, message_id=uuid.uuid4().hex, handled_at=handled_at)
        for _ in range(count)
    )


def count(consumer: str | None = None) -> int:
    entries = InboxEntry.objects.all()
    return (entries.filter(consumer=consumer) if consumer else entries).count()


def test_purge__retention_boundary() -> None:
    retention = 7 * DAY
    add_entries("inside", NOW - retention)  # exactly at the cutoff: kept
    add_entries("inside", NOW - retention + timedelta(seconds=1))
    add_entries("outside", NOW - retention - timedelta(microseconds=1))

    result = purge_expired(now=NOW)

    assert result.deleted == 1
    assert count("inside") == 2
    assert count("outside") == 0


def test_purge__per_consumer_retention(settings) -> None:
    settings.INBOX = {"RETENTION": {"default": 7 * 86400, "short": 3600}}
    add_entries("short", NOW - timedelta(hours=2))
    add_entries("short", NOW - timedelta(minutes=30))
    add_entries("other", NOW - timedelta(hours=2))
    add_entries("other", NOW - 8 * DAY)

    result = purge_expired(now=NOW)

    assert result.deleted == 2
    assert count("short") == 1
    assert count("other") == 1


def test_purge__one_consumer_only(settings) -> None:
    add_entries("a", NOW - 8 * DAY, 2)
    add_entries("b", NOW - 8 * DAY, 2)

    result = purge_expired(consumer="a", now=NOW)

    assert result.deleted == 2
    assert (count("a"), count("b")) == (0, 2)


def test_purge__older_than_overrides_retention() -> None:
    add_entries("a", NOW - timedelta(hours=2))
    add_entries("a", NOW - timedelta(minutes=30))

    assert purge_expired(older_than=timedelta(hours=1), now=NOW).deleted == 1


def test_purge__deletes_in_batches_and_reports_progress() -> None:
    add_entries("a", NOW - 8 * DAY, 10)
    calls: list[tuple[int, int]] = []

    result = purge_expired(
        batch_size=3, now=NOW, progress=lambda batch, deleted, secs: calls.append((batch, deleted))
    )

    assert (result.deleted, result.batches) == (10, 4)
    assert calls == [(1, 3), (2, 6), (3, 9), (4, 10)]
    assert result.longest_batch_seconds > 0
    assert count() == 0


def test_purge__max_batches_bounds_the_work() -> None:
    add_entries("a", NOW - 8 * DAY, 10)

    result = purge_expired(batch_size=3, max_batches=1, now=NOW)

    assert (result.deleted, result.batches) == (3, 1)
    assert count() == 7


def test_purge__dry_run_counts_and_deletes_nothing() -> None:
    add_entries("a", NOW - 8 * DAY, 10)
    add_entries("a", NOW, 1)

    result = purge_expired(dry_run=True, batch_size=3, now=NOW)

    assert (result.dry_run, result.matched, result.deleted, result.batches) == (True, 10, 0, 0)
    assert count() == 11


def test_purge__rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        purge_expired(batch_size=0)
    with pytest.raises(ValueError):
        purge_expired(older_than=timedelta(0))


def test_opportunistic_purge__runs_one_batch_after_commit(
    settings, django_capture_on_commit_callbacks
) -> None:
    settings.INBOX = {"PURGE_CHANCE": 1, "PURGE_BATCH_SIZE": 2}
    old = timezone.now() - 8 * DAY
    add_entries("webhooks", old, 5)
    add_entries("other", old, 5)

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with inbox_guard("webhooks", uuid.uuid4().hex) as handle:
            assert handle
            # Never inside the handler's transaction.
            assert count("webhooks") == 6

    assert len(callbacks) == 1
    assert count("webhooks") == 6 - 2  # one batch of this consumer only
    assert count("other") == 5


def test_opportunistic_purge__off_with_zero_chance(
    settings, django_capture_on_commit_callbacks
) -> None:
    settings.INBOX = {"PURGE_CHANCE": 0}

    with django_capture_on_commit_callbacks() as callbacks:
        with inbox_guard("webhooks", uuid.uuid4().hex):
            pass

    assert callbacks == []


def test_opportunistic_purge__not_after_a_duplicate(
    settings, django_capture_on_commit_callbacks
) -> None:
    settings.INBOX = {"PURGE_CHANCE": 1}
    message_id = uuid.uuid4().hex
    with inbox_guard("webhooks", message_id):
        pass

    with django_capture_on_commit_callbacks() as callbacks:
        with inbox_guard("webhooks", message_id) as handle:
            assert not handle

    assert callbacks == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30m", timedelta(minutes=30)),
        ("12h", timedelta(hours=12)),
        ("7d", 7 * DAY),
        ("3600s", timedelta(hours=1)),
    ],
)
def test_parse_duration__accepts_units(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["7", "7w", "-1d", "1.5h", "", "d"])
def test_parse_duration__rejects_other_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration__largest_exact_unit() -> None:
    assert [
        format_duration(d) for d in (7 * DAY, timedelta(minutes=90), timedelta(seconds=61))
    ] == ["7d", "90m", "61s"]


def call(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("purge_inbox", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_command__purges_and_ends_with_summary() -> None:
    add_entries("a", timezone.now() - 8 * DAY, 10)

    out, _ = call("--batch-size", "3")

    # Four batches: below the every-tenth-batch progress line of verbosity 1.
    [summary] = out.strip().splitlines()
    assert summary.startswith(
        "Deleted 10 inbox entries of all consumers past retention in 4 batches"
    )
    assert count() == 0


def test_command__verbosity_2_reports_every_batch() -> None:
    add_entries("a", timezone.now() - 8 * DAY, 10)

    out, _ = call("--batch-size", "3", "--verbosity", "2")

    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "Batch 1",
        "Batch 2",
        "Batch 3",
        "Batch 4",
    ]
    assert lines[-1].startswith("Deleted 10")


def test_command__progress_every_tenth_batch() -> None:
    add_entries("a", timezone.now() - 8 * DAY, 25)

    out, _ = call("--batch-size", "1")

    assert [line for line in out.splitlines() if line.startswith("Batch")] == [
        line for line in out.splitlines() if line.startswith(("Batch 10:", "Batch 20:"))
    ]
    assert len(out.strip().splitlines()) == 3


def test_command__dry_run_with_consumer_and_older_than() -> None:
    add_entries("a", timezone.now() - timedelta(hours=2), 3)
    add_entries("b", timezone.now() - timedelta(hours=2), 3)

    out, err = call("--dry-run", "--consumer", "a", "--older-than", "1h")

    assert out.strip() == "Dry run: 3 inbox entries of consumer 'a' older than 1h would be deleted."
    assert "shorter than the redelivery horizon" in err
    assert count() == 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--batch-size", "0"), "--batch-size must be a positive number"),
        (("--batch-size", "-5"), "--batch-size must be a positive number"),
        (("--older-than", "7x"), "Cannot parse duration"),
        (("--older-than", "7"), "Cannot parse duration"),
        (("--older-than", "0d"), "longer than zero"),
    ],
)
def test_command__bad_arguments_raise_command_error(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        call(*args)


def test_command__database_error_becomes_command_error() -> None:
    # PostgreSQL text cannot hold NUL: a real driver error, no mock.
    with pytest.raises(CommandError, match="Purging the inbox failed"):
        call("--consumer", "bad\x00name")


def test_command__invalid_settings_become_command_error(settings) -> None:
    settings.INBOX = {"PURGE_BATCH_SIZE": 0}

    with pytest.raises(CommandError, match="PURGE_BATCH_SIZE"):
        call()
