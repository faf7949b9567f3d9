"""Requeueing a job from RQ's failed registry never charges twice: it runs through the fence.

Transactional: a real worker runs in this process and its claims must commit.
"""

from __future__ import annotations

import pytest
from django.urls import reverse
from rq.job import Job
from rq.registry import FailedJobRegistry

from payments.desk import services as desk
from payments.models import OperationState
from payments.shop.models import Invoice
from tests.support import flows
from tests.support.provider import successes
from tests.support.users import RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def test_requeue_failed_job_after_the_operation_succeeded__charges_nothing(
    provider, queue, monkeypatch
):
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    failed = FailedJobRegistry(queue=queue)
    assert failed.get_job_ids() == [op.job_id]
    old_job_id = op.job_id
    operator = make_user("alice", *VIEW, RECONCILE)
    desk.resume(op, user=operator, reason="invoice bug fixed")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    creates = provider.state.stats()["create_requests"]

    failed.requeue(old_job_id)  # someone requeues the stale failed job
    run_worker(queue)

    assert Job.fetch(old_job_id, connection=queue.connection).return_value() == "skipped:succeeded"
    assert provider.state.stats()["create_requests"] == creates  # no call at all
    assert successes(provider, op) == 1
    assert Invoice.objects.count() == 1


def test_requeue_failed_job_while_uncertain__skips_then_settles_once(provider, queue, admin_client):
    op = flows.uncertain_after_read_timeout(provider, queue)
    assert op.state == OperationState.UNCERTAIN
    # An earlier delivery of this operation that RQ gave up on (an abandoned job
    # with no retries left lands here, as the started registry's cleanup does).
    job = Job.fetch(op.job_id, connection=queue.connection)
    FailedJobRegistry(queue=queue).add(job, exc_string="AbandonedJobError: worker died")
    creates = provider.state.stats()["create_requests"]

    # django-rq's own requeue button, as an operator would press it.
    url = reverse("django_rq:requeue_job", args=[0, job.id])
    assert admin_client.post(url).status_code == 302
    run_worker(queue)

    assert Job.fetch(job.id, connection=queue.connection).return_value() == "skipped:uncertain"
    assert provider.state.stats()["create_requests"] == creates
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN

    desk.query_provider([op.pk], user=make_user("alice", *VIEW, RECONCILE))
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert successes(provider, op) == 1
