"""django-rq's failed jobs lead to the operation each job delivers, on the desk.

An operator on RQ's failed-jobs page (or on one failed job's page) sees a
`run_operation` job and its operation id; the page links that operation's
desk page. The pages are django-rq's own views over the real payments queue,
with a job a real worker failed in real Redis.

Transactional: a real worker runs the job in this process (its claims must commit).
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from rq.registry import FailedJobRegistry

from payments.engine.queues import queue_index
from tests.support import flows
from tests.support.users import VIEW, client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def test_failed_jobs_page__links_each_job_to_its_operation(provider, queue, monkeypatch):
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    assert FailedJobRegistry(queue=queue).get_job_ids() == [op.job_id]
    client = client_for(make_user("vera", *VIEW))

    page = client.get(reverse("django_rq:failed_jobs", args=[queue_index()])).content.decode()

    assert f'href="/admin/payments/operation/{op.pk}/change/"' in page
    assert op.key in page


def test_failed_job_page__links_its_operation(provider, queue, monkeypatch):
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    client = client_for(make_user("vera", *VIEW))

    url = reverse("django_rq:job_detail", args=[queue_index(), op.job_id])
    page = client.get(url).content.decode()

    assert f'href="/admin/payments/operation/{op.pk}/change/"' in page


def test_failed_jobs_page__names_the_operation_unlinked_for_who_may_not_view_it(
    provider, queue, monkeypatch
):
    """A queue manager without payments.view_operation: the desk page would refuse them."""
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    client = client_for(make_user("quinn", "payments.manage_queues"))

    page = client.get(reverse("django_rq:failed_jobs", args=[queue_index()])).content.decode()

    assert op.key in page
    assert f"/admin/payments/operation/{op.pk}/change/" not in page


def test_failed_jobs_page__reads_the_operations_of_a_page_in_one_query(
    provider, queue, monkeypatch
):
    client = client_for(make_user("vera", *VIEW))
    url = reverse("django_rq:failed_jobs", args=[queue_index()])

    def operation_reads() -> int:
        with CaptureQueriesContext(connection) as sent:
            assert client.get(url).status_code == 200
        return sum('FROM "payments_operation"' in query["sql"] for query in sent)

    flows.failed_by_invoice_bug(monkeypatch, queue, key="chk-1")
    one = operation_reads()
    flows.failed_by_invoice_bug(monkeypatch, queue, key="chk-2")

    assert len(FailedJobRegistry(queue=queue)) == 2
    assert operation_reads() == one == 1
