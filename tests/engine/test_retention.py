"""`purge_history`: the history of old finished operations goes in bounded batches; nothing
that may still move, and no key, goes with it.

Transactional: each batch commits on its own (`atomic(durable=True)`).
"""

from __future__ import annotations

import io
import os
import signal
from datetime import timedelta

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.utils import timezone

from payments.engine import fence, retention
from payments.exceptions import OperationConflict
from payments.management.commands import purge_history as command
from payments.models import KeyScope, Operation, OperationEvent, StepClaim
from tests.support.history import write_history

pytestmark = pytest.mark.django_db(transaction=True)

DAY = timedelta(days=1)


def _old_history(count: int = 120) -> None:
    """`count` operations changed 500 days ago and more (past the 400 days kept)."""
    with connection.cursor() as cursor:
        write_history(count, tag="old", spacing=timedelta(minutes=10), open_every=40)
        cursor.execute(
            "UPDATE payments_operation SET updated_at = updated_at - interval '500 days', "
            "created_at = created_at - interval '500 days'"
        )


def _purge(*args: str) -> tuple[str, int]:
    out = io.StringIO()
    try:
        call_command("purge_history", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue() + str(exc), exc.returncode
    return out.getvalue(), 0


def _purgeable() -> set[int]:
    return set(
        Operation.objects.filter(state__in=["succeeded", "failed"]).values_list("id", flat=True)
    )


def test_purge__removes_old_history_in_bounded_batches_and_keeps_the_rows():
    _old_history()
    finished = _purgeable()

    report = retention.purge_history(cutoff=timezone.now() - 400 * DAY, batch_size=25)

    assert report.operations == len(finished)
    assert report.batches == -(-len(finished) // 25)  # every batch full but the last
    assert not StepClaim.objects.filter(operation_id__in=finished).exists()
    assert not OperationEvent.objects.filter(operation_id__in=finished).exists()
    # The rows stay, marked: their keys are still taken.
    assert Operation.objects.filter(id__in=finished, purged_at__isnull=False).count() == len(
        finished
    )


def test_purge__never_touches_what_may_still_move():
    _old_history()
    open_ops = set(
        Operation.objects.exclude(state__in=["succeeded", "failed"]).values_list("id", flat=True)
    )
    resumable = Operation.objects.filter(state="failed").first()
    with connection.cursor() as cursor:  # a failed operation whose charge is recorded done
        cursor.execute(
            "UPDATE payments_stepclaim SET state = 'done' WHERE operation_id = %s",
            [resumable.pk],
        )
    young = write_history(10, tag="young")
    young_ids = set(Operation.objects.filter(key__startswith="young:").values_list("id", flat=True))
    parent = Operation.objects.filter(state="succeeded", key__startswith="old:").first()
    child = Operation.objects.filter(state="pending").first()
    with connection.cursor() as cursor:  # an unfinished follow-up keeps its parent
        cursor.execute(
            "UPDATE payments_operation SET parent_id = %s WHERE id = %s", [parent.pk, child.pk]
        )
    kept = open_ops | young_ids | {resumable.pk, parent.pk}
    claims_before = StepClaim.objects.filter(operation_id__in=kept).count()

    _purge("--batch-size", "10")

    assert young.count == 10
    assert not Operation.objects.filter(id__in=kept, purged_at__isnull=False).exists()
    assert StepClaim.objects.filter(operation_id__in=kept).count() == claims_before > 0


def test_purge__stops_between_two_batches_on_sigterm_and_goes_on_when_run_again(monkeypatch):
    _old_history()
    finished = _purgeable()
    real = retention.purge_history

    def signalled_after_the_first_batch(**kwargs):
        shown = kwargs["progress"]

        def progress(report):
            if report.batches == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            shown(report)

        return real(**{**kwargs, "progress": progress})

    monkeypatch.setattr(command, "purge_history", signalled_after_the_first_batch)
    output, code = _purge("--batch-size", "20")

    assert code == 1 and "Stopped by SIGTERM" in output
    assert Operation.objects.filter(purged_at__isnull=False).count() == 20
    monkeypatch.setattr(command, "purge_history", real)
    assert _purge("--batch-size", "20")[1] == 0
    assert Operation.objects.filter(purged_at__isnull=False).count() == len(finished)


def test_purge__run_again_purges_nothing_more():
    _old_history()
    first = retention.purge_history(cutoff=timezone.now() - 400 * DAY, batch_size=50)
    counts = (StepClaim.objects.count(), OperationEvent.objects.count())

    again = retention.purge_history(cutoff=timezone.now() - 400 * DAY, batch_size=50)

    assert first.operations > 0 and again.operations == 0 and again.batches == 0
    assert (StepClaim.objects.count(), OperationEvent.objects.count()) == counts


def test_purge__dry_run_counts_and_deletes_nothing():
    _old_history()
    claims = StepClaim.objects.count()

    output, code = _purge("--dry-run")

    assert code == 0 and f"history of {len(_purgeable())} operations" in output
    assert StepClaim.objects.count() == claims
    assert not Operation.objects.filter(purged_at__isnull=False).exists()


def test_purge__a_purged_key_is_never_taken_again():
    _old_history(10)
    retention.purge_history(cutoff=timezone.now() - 400 * DAY, batch_size=50)
    purged = Operation.objects.filter(purged_at__isnull=False).first()

    with pytest.raises(OperationConflict), transaction.atomic():
        fence.create_operation_in_tx(
            key=purged.key,
            kind="checkout",
            entity_type="order",
            entity_id=1,
            params={"order_id": 1},
            actor="test",
            scope=KeyScope.DERIVED,
        )


def test_purge__refuses_to_run_inside_a_transaction():
    with pytest.raises(RuntimeError, match="outside atomic"), transaction.atomic():
        retention.purge_history(cutoff=timezone.now(), batch_size=10)


def test_retention_shorter_than_the_provider_keeps_keys__is_an_error(settings):
    settings.PAYMENTS = {**settings.PAYMENTS, "RETENTION_DAYS": 1}
    ids = {m.id for m in run_checks()}
    assert {"payments.E012", "payments.W007"} <= ids


def test_retention_within_the_failed_job_retention__is_a_warning(settings):
    settings.INBOX = {**settings.INBOX, "REDELIVERY_HORIZON": 30 * 86400}
    settings.PAYMENTS = {**settings.PAYMENTS, "RETENTION_DAYS": 20}
    ids = {m.id for m in run_checks()}
    assert "payments.W007" in ids and "payments.E012" not in ids


def test_the_default_retention__passes_the_checks():
    ids = {m.id for m in run_checks()}
    assert not ids & {"payments.E012", "payments.W007"}
