"""inbox_handler / inbox_guard: a message's effects commit exactly once."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry

from inbox.context import current_message
from inbox.exceptions import (
    FollowUpEnqueueRefused,
    InvalidMessageId,
    MissingMessageId,
    TransactionRequired,
)
from inbox.handlers import inbox_guard
from inbox.models import InboxEntry
from inbox.queues import MessageQueue
from inbox.services import record_message
from tests.support.inbox_jobs import (
    AFTER_COMMIT,
    BEFORE_COMMIT,
    QUEUE_NAME,
    arm_crash,
    effect_job,
    effect_then_ack_job,
    follow_up_job,
)
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db


def failure_of(job: Job) -> str:
    """The exception text of the job's last (failed) run."""
    result = job.latest_result()
    assert result is not None and result.exc_string is not None
    return result.exc_string


def skip_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "inbox" and r.levelno == logging.INFO and r.getMessage().startswith("Skip")
    ]


def test_first_delivery__runs_handler_and_records_message(queue: MessageQueue, effects) -> None:
    job = queue.enqueue(effect_job, "a")

    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count("a") == 1
    entry = InboxEntry.objects.get()
    assert (entry.consumer, entry.message_id) == (QUEUE_NAME, job.id)


def test_redelivery_after_commit__skips_handler_and_logs(
    queue: MessageQueue, effects, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox")
    # The worker dies after the handler committed and before the ack: the job
    # fails although its effects are in, and an operator requeues it.
    arm_crash(queue.connection, AFTER_COMMIT)
    job = queue.enqueue(effect_then_ack_job, "a")
    run_worker(queue)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert effects.count() == 1

    FailedJobRegistry(queue=queue).requeue(job.id)
    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count() == 1
    assert InboxEntry.objects.count() == 1
    assert skip_lines(caplog) == [f"Skipping message {job.id} for {QUEUE_NAME}"]


def test_crash_before_commit__records_nothing(queue: MessageQueue, effects) -> None:
    arm_crash(queue.connection, BEFORE_COMMIT)

    job = queue.enqueue(effect_job, "a")
    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert effects.count() == 0
    assert not InboxEntry.objects.exists()


def test_redelivery_after_crash_before_commit__runs_handler_once(
    queue: MessageQueue, effects, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox")
    arm_crash(queue.connection, BEFORE_COMMIT)
    job = queue.enqueue(effect_job, "a")
    run_worker(queue)

    FailedJobRegistry(queue=queue).requeue(job.id)
    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count() == 1
    assert InboxEntry.objects.filter(message_id=job.id).count() == 1
    assert skip_lines(caplog) == []


def test_missing_message_id__runs_with_warning_by_default(
    queue: MessageQueue, effects, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="inbox")
    # A plain rq Queue stands for another tool: no message id in meta.
    job = Queue(QUEUE_NAME, connection=queue.connection).enqueue(effect_job, "a")

    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count() == 1
    assert not InboxEntry.objects.exists()
    [warning] = [r for r in caplog.records if r.name == "inbox" and r.levelno == logging.WARNING]
    assert job.id in warning.getMessage()
    assert "without inbox protection" in warning.getMessage()


def test_missing_message_id__strict_mode_fails_job_visibly(
    queue: MessageQueue, effects, settings
) -> None:
    settings.INBOX = {"STRICT_MESSAGE_ID": True}
    job = Queue(QUEUE_NAME, connection=queue.connection).enqueue(effect_job, "a")

    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert job.id in FailedJobRegistry(queue=queue).get_job_ids()
    assert "MissingMessageId" in failure_of(job)
    assert effects.count() == 0


def test_handler_called_outside_rq__strict_mode_raises(settings) -> None:
    settings.INBOX = {"STRICT_MESSAGE_ID": True}

    with pytest.raises(MissingMessageId):
        effect_job("a")


def test_guard__second_delivery_yields_false(effects) -> None:
    message_id = uuid.uuid4().hex

    with inbox_guard("webhooks", message_id) as first:
        assert first is True
    with inbox_guard("webhooks", message_id) as second:
        assert second is False
    with inbox_guard("other-consumer", message_id) as other:
        assert other is True


def test_guard__handler_error_rolls_back_record(effects) -> None:
    message_id = uuid.uuid4().hex

    with pytest.raises(RuntimeError), inbox_guard("webhooks", message_id):
        raise RuntimeError("handler failed")

    assert not InboxEntry.objects.exists()
    with inbox_guard("webhooks", message_id) as again:
        assert again is True


def test_guard__rejects_empty_message_id() -> None:
    with pytest.raises(InvalidMessageId), inbox_guard("webhooks", ""):
        pass


# transaction=True: the condition under test is autocommit, which the test
# case's own transaction would hide.
@pytest.mark.django_db(transaction=True)
def test_record_message__outside_transaction_raises() -> None:
    with pytest.raises(TransactionRequired) as info:
        record_message("webhooks", uuid.uuid4().hex)

    assert "transaction.atomic()" in str(info.value)
    assert not InboxEntry.objects.exists()


def test_record_message__true_once_per_consumer_and_message() -> None:
    message_id = uuid.uuid4().hex
    with transaction.atomic():
        assert record_message("webhooks", message_id) is True
        assert record_message("webhooks", message_id) is False
        assert record_message("emails", message_id) is True


def test_follow_up_enqueue__refused_and_handler_rolled_back(queue: MessageQueue, effects) -> None:
    job = queue.enqueue(follow_up_job, "a")

    run_worker(queue)

    assert job.get_status(refresh=True) == JobStatus.FAILED
    exc_string = failure_of(job)
    assert "FollowUpEnqueueRefused" in exc_string
    assert "outbox" in exc_string
    # Nothing committed, so a redelivery (after the fix) runs the handler again.
    assert effects.count() == 0
    assert not InboxEntry.objects.exists()
    assert queue.count == 0


def test_follow_up_enqueue__refused_for_every_enqueue_path(queue: MessageQueue) -> None:
    message_id = uuid.uuid4().hex
    with inbox_guard("webhooks", message_id):
        with pytest.raises(FollowUpEnqueueRefused) as info:
            queue.enqueue(effect_job, "a")
        assert (info.value.consumer, info.value.message_id) == ("webhooks", message_id)
        with pytest.raises(FollowUpEnqueueRefused):
            queue.enqueue_in(timedelta(minutes=1), effect_job, "a")
        with pytest.raises(FollowUpEnqueueRefused):
            queue.enqueue_many([Queue.prepare_data(effect_job, ("a",))])
    assert queue.count == 0


def test_follow_up_guard__ends_with_the_handler(queue: MessageQueue, redis_conn: Redis) -> None:
    with inbox_guard("webhooks", uuid.uuid4().hex):
        assert current_message() is not None

    assert current_message() is None
    assert queue.enqueue(effect_job, "a") is not None
