"""The batched purge deletes only expired rows, in bounded batches, beside live traffic.

Real PostgreSQL connections (threads) and a real `purge_inbox` process; no mocks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connections, transaction
from django.utils import timezone

from inbox.models import InboxEntry
from inbox.services import FIRST_BATCH_SIZE, purge_expired, record_message
from tests.support.config import TEST_REDIS_URL
from tests.support.workers import ROOT, database_url

DAY = timedelta(days=1)


def add(consumer: str, age: timedelta, count: int = 1) -> list[int]:
    """Insert ``count`` rows handled ``age`` ago; return their ids."""
    handled_at = timezone.now() - age
    rows = InboxEntry.objects.bulk_create(
        InboxEntry(consumer=consumer, message_id=uuid.uuid4().hex, handled_at=handled_at)
        for _ in range(count)
    )
    return [row.pk for row in rows]


def remaining_ids() -> set[int]:
    return set(InboxEntry.objects.values_list("pk", flat=True))


def in_own_connection(work) -> None:
    """Run ``work`` in a thread, so on a database connection of its own, and wait for it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the test below
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the other connection did not finish"
    if errors:
        raise errors[0]


@pytest.mark.django_db
def test_purge__deletes_only_expired_rows_among_interleaved_ones(settings) -> None:
    settings.INBOX = {"RETENTION": {"default": 7 * 86400, "short": 3600}}
    keep: set[int] = set()
    expired: set[int] = set()
    # Expired and live rows alternate in primary-key order, so every batch's
    # key range holds both, of several consumers.
    for _ in range(30):
        expired.update(add("a", 8 * DAY))
        keep.update(add("a", 6 * DAY))
        expired.update(add("short", timedelta(hours=2)))
        keep.update(add("short", timedelta(minutes=30)))
        keep.update(add("b", 2 * DAY))

    result = purge_expired(batch_size=4)

    assert result.deleted == len(expired) == 60
    assert remaining_ids() == keep


@pytest.mark.django_db
@pytest.mark.parametrize("batch_seconds", [0, 0.02])
def test_purge__no_batch_exceeds_the_batch_size(batch_seconds: float) -> None:
    add("a", 8 * DAY, 500)
    add("a", DAY, 50)  # live rows after the expired ones
    sizes: list[int] = []

    def progress(batch: int, deleted: int, seconds: float) -> None:
        sizes.append(deleted - sum(sizes))

    result = purge_expired(batch_size=64, batch_seconds=batch_seconds, progress=progress)

    assert result.deleted == sum(sizes) == 500
    assert max(sizes) == result.largest_batch <= 64
    assert result.batches == len(sizes) >= 500 // 64
    assert InboxEntry.objects.count() == 50


@pytest.mark.django_db
def test_purge__first_adaptive_batch_is_small() -> None:
    add("a", 8 * DAY, FIRST_BATCH_SIZE + 10)

    result = purge_expired(batch_size=50_000, batch_seconds=0.02, max_batches=1)

    assert (result.batches, result.deleted) == (1, FIRST_BATCH_SIZE)


# transaction=True: the rows must be committed for the other connections to see
# them, and what the purge may touch is decided by commit visibility.
@pytest.mark.django_db(transaction=True)
def test_purge__a_row_inserted_during_the_purge_is_kept() -> None:
    expired = set(add("a", 8 * DAY, 100))
    inserted: list[str] = []

    def insert_fresh_row() -> None:
        message_id = uuid.uuid4().hex
        with transaction.atomic():
            assert record_message("a", message_id)
        inserted.append(message_id)

    def progress(batch: int, deleted: int, seconds: float) -> None:
        if batch == 2:  # between two batches, a handler records a new message
            in_own_connection(insert_fresh_row)

    result = purge_expired(batch_size=10, batch_seconds=0, progress=progress)

    assert result.deleted == len(expired) == 100
    assert [entry.message_id for entry in InboxEntry.objects.all()] == inserted


@pytest.mark.django_db(transaction=True)
def test_purge__never_touches_a_row_whose_handler_has_not_committed() -> None:
    add("a", 8 * DAY, 20)
    message_id = uuid.uuid4().hex
    recorded, release = threading.Event(), threading.Event()
    waited_out: list[bool] = []

    def handler() -> None:
        with transaction.atomic():
            record_message("a", message_id)
            recorded.set()
            # The purge below must not wait for this transaction.
            waited_out.append(not release.wait(timeout=10))
        connections.close_all()

    thread = threading.Thread(target=handler)
    thread.start()
    assert recorded.wait(timeout=10)
    try:
        # A day later the in-flight row is past an hour's retention by its time.
        result = purge_expired(
            older_than=timedelta(hours=1), now=timezone.now() + DAY, batch_size=3
        )
    finally:
        release.set()
        thread.join(timeout=10)

    assert waited_out == [False]
    assert result.deleted == 20
    assert list(InboxEntry.objects.values_list("message_id", flat=True)) == [message_id]


@pytest.mark.django_db(transaction=True)
def test_purge__two_purges_at_once_delete_every_row_once() -> None:
    add("a", 8 * DAY, 300)
    add("b", 8 * DAY, 300)
    results = []

    def purge() -> None:
        results.append(purge_expired(batch_size=7, batch_seconds=0))

    threads = [threading.Thread(target=lambda: in_own_connection(purge)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert sum(result.deleted for result in results) == 600
    assert InboxEntry.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_command__sigterm_stops_between_batches_and_keeps_the_rest() -> None:
    total = 3000
    add("a", 8 * DAY, total)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "REDIS_URL": TEST_REDIS_URL,
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "purge_inbox", "--batch-size", "1", "--verbosity", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("Batch 1:"), first
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert proc.returncode == 1, err
    assert "Stopped by SIGTERM between two batches" in err
    # What the command says it deleted, not its "Batch" lines counted: readline() may have
    # buffered more than the first line, and communicate() reads past that buffer.
    reported = re.search(r"after deleting (\d+) inbox entries", err)
    assert reported is not None, err
    left = InboxEntry.objects.count()
    # Every batch committed whole (one entry each), and nothing else was deleted.
    assert 0 < total - left == int(reported[1]) < total
    assert all(line.startswith("Batch") for line in out.splitlines() if line.strip())
