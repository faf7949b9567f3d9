"""MessageQueue: every job carries a stable message id and its consumer."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import django_rq
import pytest
from django.conf import settings
from django.db import transaction
from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, ScheduledJobRegistry

from inbox.exceptions import InvalidMessageId
from inbox.models import InboxEntry
from inbox.queues import MessageQueue, is_message_id, message_id_for_job_id
from tests.support.inbox_jobs import (
    BEFORE_COMMIT,
    QUEUE_NAME,
    arm_crash,
    effect_job,
    explicit_consumer_job,
)
from tests.support.workers import run_worker


def test_settings__every_configured_queue_is_a_message_queue(redis_conn: Redis) -> None:
    for name in settings.RQ_QUEUES:
        assert isinstance(django_rq.get_queue(name, connection=redis_conn), MessageQueue)


def test_enqueue__without_job_id__uses_fresh_hex_id_as_message_id(queue: MessageQueue) -> None:
    first = queue.enqueue(effect_job, "a")
    second = queue.enqueue(effect_job, "a")

    stored = Job.fetch(first.id, connection=queue.connection)
    assert is_message_id(first.id)
    assert stored.meta == {"message_id": first.id, "consumer": QUEUE_NAME}
    assert second.id != first.id


def test_enqueue__hex_job_id__is_the_message_id(queue: MessageQueue) -> None:
    job_id = uuid.uuid4().hex

    job = queue.enqueue(effect_job, "a", job_id=job_id)

    assert job.id == job_id
    assert job.meta["message_id"] == job_id


def test_enqueue__other_job_id__gets_stable_derived_message_id(queue: MessageQueue) -> None:
    first = queue.enqueue(effect_job, "a", job_id="order-42")
    again = queue.enqueue(effect_job, "a", job_id="order-42")
    upper = queue.enqueue(effect_job, "a", job_id="A" * 32)

    assert first.id == "order-42"
    assert is_message_id(first.meta["message_id"])
    assert again.meta["message_id"] == first.meta["message_id"]
    assert first.meta["message_id"] == message_id_for_job_id("order-42")
    assert upper.meta["message_id"] != "A" * 32  # only lowercase hex is taken as is


def test_enqueue__keeps_caller_meta_and_does_not_mutate_it(queue: MessageQueue) -> None:
    meta = {"trace": "t-1"}

    job = queue.enqueue(effect_job, "a", meta=meta)

    assert meta == {"trace": "t-1"}
    assert Job.fetch(job.id, connection=queue.connection).meta["trace"] == "t-1"


def test_enqueue__conflicting_meta_message_id__is_refused(queue: MessageQueue) -> None:
    with pytest.raises(InvalidMessageId):
        queue.enqueue(effect_job, "a", job_id=uuid.uuid4().hex, meta={"message_id": "0" * 32})


def test_enqueue_at_and_in__carry_message_id(queue: MessageQueue) -> None:
    at = queue.enqueue_at(datetime.now(UTC) + timedelta(hours=1), effect_job, "a")
    later = queue.enqueue_in(timedelta(hours=1), effect_job, "b")

    for job in (at, later):
        stored = Job.fetch(job.id, connection=queue.connection)
        assert stored.meta == {"message_id": job.id, "consumer": QUEUE_NAME}
        assert job.id in ScheduledJobRegistry(queue=queue).get_job_ids()


def test_enqueue_many__carries_message_ids(queue: MessageQueue) -> None:
    jobs = queue.enqueue_many(
        [Queue.prepare_data(effect_job, ("a",)), Queue.prepare_data(effect_job, ("b",))]
    )

    assert [job.meta["message_id"] for job in jobs] == [job.id for job in jobs]
    assert all(is_message_id(job.id) for job in jobs)


@pytest.mark.django_db
def test_on_db_commit__deferred_enqueue_gets_message_id(
    queue: MessageQueue, redis_conn: Redis, django_capture_on_commit_callbacks
) -> None:
    deferred = django_rq.get_queue(QUEUE_NAME, connection=redis_conn, commit_mode="on_db_commit")

    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            assert deferred.enqueue(effect_job, "a") is None
            assert deferred.count == 0

    [job] = deferred.jobs
    assert job.meta == {"message_id": job.id, "consumer": QUEUE_NAME}


@pytest.mark.django_db
def test_scheduled_job__runs_with_its_message_id(queue: MessageQueue, effects, seen) -> None:
    job = queue.enqueue_at(datetime.now(UTC) - timedelta(seconds=1), effect_job, "a")

    run_worker(queue, with_scheduler=True)

    assert seen() == [{"job_id": job.id, "message_id": job.id, "consumer": QUEUE_NAME}]
    assert InboxEntry.objects.filter(consumer=QUEUE_NAME, message_id=job.id).exists()


@pytest.mark.django_db
def test_retry__keeps_message_id_and_runs_effect_once(queue: MessageQueue, effects, seen) -> None:
    arm_crash(queue.connection, BEFORE_COMMIT, times=2)

    job = queue.enqueue(effect_job, "a", retry=Retry(max=2))
    run_worker(queue)

    deliveries = seen()
    assert len(deliveries) == 3
    assert {d["message_id"] for d in deliveries} == {job.id}
    assert {d["consumer"] for d in deliveries} == {QUEUE_NAME}
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert effects.count() == 1
    assert InboxEntry.objects.filter(message_id=job.id).count() == 1


@pytest.mark.django_db
def test_failed_registry_requeue__keeps_message_id_and_consumer(
    queue: MessageQueue, effects, seen
) -> None:
    arm_crash(queue.connection, BEFORE_COMMIT)
    job = queue.enqueue(effect_job, "a", meta={"consumer": "original-consumer"})
    run_worker(queue)
    registry = FailedJobRegistry(queue=queue)
    assert job.id in registry.get_job_ids()

    registry.requeue(job.id)
    run_worker(queue)

    deliveries = seen()
    assert len(deliveries) == 2
    assert all(
        d == {"job_id": job.id, "message_id": job.id, "consumer": "original-consumer"}
        for d in deliveries
    )
    assert list(InboxEntry.objects.values_list("consumer", "message_id")) == [
        ("original-consumer", job.id)
    ]
    assert effects.count() == 1


@pytest.mark.django_db
def test_handler_consumer_argument__overrides_queue_name(queue: MessageQueue, effects) -> None:
    job = queue.enqueue(explicit_consumer_job, "a")

    run_worker(queue)

    assert InboxEntry.objects.get(message_id=job.id).consumer == "explicit-consumer"
