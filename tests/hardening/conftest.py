"""Fixtures of the hardening tests: queue staff with and without the RQ permissions, and
jobs in RQ's registries as django-rq's pages show them."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django_rq.settings import get_queues_map
from redis import Redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry

from tests.support.users import VIEW, client_for, make_user

MANAGE_QUEUES = "payments.manage_queues"


@pytest.fixture
def rq_queue(redis_conn: Redis) -> Queue:
    """The payments queue in the test Redis, without django-rq's on-commit enqueue."""
    return Queue("payments", connection=redis_conn)


@pytest.fixture
def queue_index() -> int:
    return get_queues_map()["payments"]


def failed_job(
    queue: Queue,
    job_id: str | None = None,
    *,
    operation_id: int = 0,
    func: str = "payments.engine.jobs.run_operation",
) -> Job:
    """A job in the failed registry, as a worker leaves one (not run unless requeued): of
    `func` for the operation `operation_id` (0: none)."""
    job = Job.create(
        func,
        args=(operation_id,),
        id=job_id or uuid.uuid4().hex,
        connection=queue.connection,
        origin=queue.name,
    )
    job.set_status(JobStatus.FAILED, pipeline=None)
    job.save()
    FailedJobRegistry(queue=queue).add(job, exc_string="RuntimeError: boom")
    return job


def queued_job(queue: Queue, job_id: str | None = None) -> Job:
    job = Job.create(
        "payments.engine.jobs.run_operation",
        args=(0,),
        id=job_id or uuid.uuid4().hex,
        connection=queue.connection,
        origin=queue.name,
    )
    queue.enqueue_job(job)
    return job


def failed_ids(queue: Queue) -> list[str]:
    return FailedJobRegistry(queue=queue).get_job_ids()


@pytest.fixture
def bare_staff(db) -> User:
    """Staff without a single payments permission (403 on the operations list)."""
    return make_user("bea")


@pytest.fixture
def viewer(db) -> User:
    """Staff who may see operations, but not manage the queues."""
    return make_user("vera", *VIEW)


@pytest.fixture
def queue_manager(db) -> User:
    return make_user("quinn", *VIEW, MANAGE_QUEUES)


@pytest.fixture
def bare_staff_client(bare_staff: User) -> Client:
    return client_for(bare_staff)


@pytest.fixture
def viewer_client(viewer: User) -> Client:
    return client_for(viewer)


@pytest.fixture
def manager_client(queue_manager: User) -> Client:
    return client_for(queue_manager)
