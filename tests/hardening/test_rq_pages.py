"""django-rq's pages under /admin/rq/: behind permissions, no open redirect, no 500.

Issue 14: any staff user could delete payment jobs there (django-rq checks only
`is_staff`), `next_url` and `Referer` redirected anywhere, and an unknown queue
index was a 500. Real Redis (the test database), real PostgreSQL.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.urls import reverse
from rq.job import Job
from rq.registry import FailedJobRegistry

from payments.models import OperationState
from payments.testing import run_jobs
from tests.hardening.conftest import failed_ids, failed_job, queued_job
from tests.support import builders
from tests.support.users import client_for, make_user

pytestmark = pytest.mark.django_db

EVIL = "https://evil.example/phish"


def rq(name: str, *args: object) -> str:
    return reverse(f"django_rq:{name}", args=args)


def job_exists(queue, job_id: str) -> bool:
    return Job.exists(job_id, connection=queue.connection)


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


# --- the permission -----------------------------------------------------------------


def test_manage_queues__is_a_permission_of_the_payments_app():
    permission = Permission.objects.get(
        content_type__app_label="payments", codename="manage_queues"
    )
    assert permission.content_type.model == "operation"
    user = make_user("quentin", "payments.manage_queues")
    assert user.has_perm("payments.manage_queues")


# --- reading ------------------------------------------------------------------------

READ_PAGES = [
    ("home", ()),
    ("jobs", ("Q",)),
    ("queue_details", ("Q",)),
    ("finished_jobs", ("Q",)),
    ("failed_jobs", ("Q",)),
    ("started_jobs", ("Q",)),
    ("deferred_jobs", ("Q",)),
    ("scheduled_jobs", ("Q",)),
    ("workers", ("Q",)),
    ("job_detail", ("Q", "JOB")),
]


@pytest.mark.parametrize(("name", "args"), READ_PAGES, ids=[n for n, _ in READ_PAGES])
def test_read_pages__staff_without_view_permission_gets_403_and_a_viewer_reads(
    name, args, rq_queue, queue_index, bare_staff_client, viewer_client
):
    job = failed_job(rq_queue)
    url = rq(name, *[{"Q": queue_index, "JOB": job.id}[a] for a in args])
    assert bare_staff_client.get(url).status_code == 403
    assert viewer_client.get(url).status_code == 200


def test_read_pages__anonymous_is_sent_to_the_admin_login_and_staff_need_a_permission(
    client, bare_staff_client, queue_index
):
    url = rq("failed_jobs", queue_index)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))
    assert bare_staff_client.get(url).status_code == 403


# --- changing: only with payments.manage_queues --------------------------------------

CHANGES = [
    ("delete_job", True, {}),
    ("requeue_job", True, {}),
    ("enqueue_job", True, {}),
    ("stop_job", True, {}),
    ("clear", False, {}),
    ("requeue_all", False, {}),
    ("delete_failed_jobs", False, {}),
    ("actions", False, {"action": "delete"}),
    ("actions", False, {"action": "requeue"}),
    ("actions", False, {"action": "stop"}),
    ("confirm_action", False, {"action": "delete"}),
]


@pytest.mark.parametrize(
    ("name", "with_job", "data"),
    CHANGES,
    ids=[f"{n}-{d.get('action', '')}" for n, _, d in CHANGES],
)
def test_changes__refused_to_staff_without_manage_queues(
    name, with_job, data, rq_queue, queue_index, bare_staff_client, viewer_client
):
    job = failed_job(rq_queue)
    waiting = queued_job(rq_queue)
    url = rq(name, queue_index, job.id) if with_job else rq(name, queue_index)
    body = {**data, "job_ids": [job.id], "_selected_action": [job.id]}
    for client in (bare_staff_client, viewer_client):
        assert client.post(url, body).status_code == 403
        if name != "stop_job":  # POST only
            assert client.get(url).status_code == 403
    assert failed_ids(rq_queue) == [job.id]  # the failed job stays where it was
    assert job_exists(rq_queue, job.id)
    assert rq_queue.get_job_ids() == [waiting.id]


def test_manager__deletes_a_failed_job_of_a_finished_operation(
    rq_queue, queue_index, manager_client
):
    op = builders.move(builders.new_checkout("chk-done"), OperationState.FAILED, reason="gave up")
    job = failed_job(rq_queue, op.job_id)
    stray = failed_job(rq_queue)  # no operation at all

    assert manager_client.post(rq("delete_job", queue_index, job.id)).status_code == 302
    response = manager_client.post(
        rq("actions", queue_index), {"action": "delete", "job_ids": [stray.id]}
    )
    assert response.status_code == 302

    assert failed_ids(rq_queue) == []
    assert not job_exists(rq_queue, job.id) and not job_exists(rq_queue, stray.id)


# --- a job whose operation is unfinished is never deleted ------------------------------


@pytest.mark.parametrize("who", ["manager", "superuser"])
def test_deleting_the_job_of_an_unfinished_operation__is_refused_whoever_asks(
    who, rq_queue, queue_index, queue_manager, admin_user
):
    client = client_for(queue_manager if who == "manager" else admin_user)
    op = builders.new_checkout("chk-pending")
    op.refresh_from_db()  # the job id was recorded by an update
    assert op.job_id and op.state == OperationState.PENDING
    failed = failed_job(rq_queue, op.job_id)
    finished = builders.move(builders.new_checkout("chk-other"), OperationState.FAILED)
    other = failed_job(rq_queue, finished.job_id)

    response = client.post(rq("delete_job", queue_index, failed.id))
    assert response.status_code == 302
    assert response["Location"] == rq("job_detail", queue_index, failed.id)
    assert any("chk-pending" in m and "Nothing was deleted" in m for m in messages_of(response))
    # In bulk: the whole action is refused, the finished operation's job stays too.
    for name, data in (("actions", {"action": "delete"}), ("delete_failed_jobs", {})):
        response = client.post(rq(name, queue_index), {**data, "job_ids": [other.id, failed.id]})
        assert response.status_code == 302
        assert any("chk-pending" in m for m in messages_of(response))

    assert sorted(failed_ids(rq_queue)) == sorted([failed.id, other.id])
    assert job_exists(rq_queue, failed.id)


def test_emptying_a_queue_holding_an_unfinished_operations_job__is_refused(
    rq_queue, queue_index, admin_client
):
    op = builders.new_checkout("chk-queued")
    op.refresh_from_db()
    assert op.job_id
    job = queued_job(rq_queue, op.job_id)

    response = admin_client.post(rq("clear", queue_index))

    assert response.status_code == 302
    assert rq_queue.get_job_ids() == [job.id]
    assert job_exists(rq_queue, job.id)


def test_emptying_a_queue_of_stray_jobs__is_allowed(rq_queue, queue_index, manager_client):
    queued_job(rq_queue)
    assert manager_client.post(rq("clear", queue_index)).status_code == 302
    assert rq_queue.get_job_ids() == []


# --- open redirects -------------------------------------------------------------------

OFF_SITE = [
    EVIL,
    "//evil.example/phish",
    "/\\evil.example/phish",
    "http://testserver//evil.example/phish",
    "javascript:alert(1)",
]


def is_off_site(location: str) -> bool:
    return "evil.example" in location or location.startswith("javascript")


@pytest.mark.parametrize("target", OFF_SITE)
def test_actions__next_url_off_site_is_not_followed(target, rq_queue, queue_index, admin_client):
    job = failed_job(rq_queue)
    response = admin_client.post(
        rq("actions", queue_index),
        {"action": "requeue", "job_ids": [job.id], "next_url": target},
    )
    assert response.status_code == 302
    assert not is_off_site(response["Location"])
    assert response["Location"] == rq("jobs", queue_index)


@pytest.mark.parametrize("target", OFF_SITE)
def test_confirm_action__referer_off_site_is_not_followed(
    target, rq_queue, queue_index, admin_client
):
    job = failed_job(rq_queue)
    url = rq("confirm_action", queue_index)
    response = admin_client.get(url, HTTP_REFERER=target)
    assert response.status_code == 302
    assert not is_off_site(response["Location"])
    # The confirmation page carries the target on to the actions view: not off site either.
    page = admin_client.post(
        url, {"action": "delete", "_selected_action": [job.id]}, HTTP_REFERER=target
    )
    assert page.status_code == 200
    assert "evil.example" not in page.content.decode()


def test_redirects__a_same_host_target_is_kept_as_a_relative_url(
    rq_queue, queue_index, admin_client
):
    job = failed_job(rq_queue)
    failed_page = rq("failed_jobs", queue_index)
    response = admin_client.post(
        rq("actions", queue_index),
        {"action": "requeue", "job_ids": [job.id], "next_url": f"http://testserver{failed_page}"},
    )
    assert response["Location"] == failed_page
    response = admin_client.get(
        rq("confirm_action", queue_index), HTTP_REFERER=f"http://testserver{failed_page}?page=2"
    )
    assert response["Location"] == f"{failed_page}?page=2"


# --- 404, not 500 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/admin/rq/queues/99/",
        "/admin/rq/queues/99/failed/",
        "/admin/rq/workers/99/",
        "/admin/rq/schedulers/99/",
        "/admin/rq/queues/99/some-job/",
    ],
)
def test_unknown_queue_index__is_404(path, admin_client, redis_conn):
    assert admin_client.get(path).status_code == 404


def test_unknown_job_or_worker__is_404(admin_client, queue_index, redis_conn):
    for name in ("delete_job", "requeue_job", "enqueue_job"):
        assert admin_client.get(rq(name, queue_index, "no-such-job")).status_code == 404
        assert admin_client.post(rq(name, queue_index, "no-such-job")).status_code == 404
    assert admin_client.get(rq("worker_details", queue_index, "rq:worker:gone")).status_code == 404
    assert admin_client.get(rq("worker_details", queue_index, "not-a-key")).status_code == 404


# --- the second entrance and the token views ------------------------------------------


def test_django_rqs_admin_integration__serves_nothing(rq_queue, queue_index, bare_staff_client):
    job = failed_job(rq_queue)
    base = "/admin/django_rq/dashboard/"
    assert bare_staff_client.get(base).status_code == 404
    response = bare_staff_client.post(f"{base}queues/{queue_index}/{job.id}/delete/")
    assert response.status_code == 404
    assert failed_ids(rq_queue) == [job.id]


def test_stats_json__staff_without_permission_and_non_ascii_tokens_get_401(
    client, bare_staff_client, viewer_client, settings, redis_conn
):
    settings.RQ_API_TOKEN = "rq-token-" + "x" * 24
    assert bare_staff_client.get("/admin/rq/stats.json").status_code == 401
    assert client.get("/admin/rq/stats.json/%C3%A9t%C3%A9/").status_code == 401
    assert (
        client.get("/admin/rq/stats.json", HTTP_AUTHORIZATION="Bearer \xe9t\xe9").status_code == 401
    )
    assert (
        client.get("/admin/rq/metrics/", HTTP_AUTHORIZATION="Bearer \xe9t\xe9").status_code == 401
    )
    assert viewer_client.get("/admin/rq/stats.json").status_code == 200
    response = client.get(
        "/admin/rq/stats.json", HTTP_AUTHORIZATION=f"Bearer {settings.RQ_API_TOKEN}"
    )
    assert response.status_code == 200
    assert "queues" in response.json()


# --- what a viewer sees ---------------------------------------------------------------


def test_queue_pages__a_viewer_sees_empty_queue_off_naming_the_permission(
    rq_queue, queue_index, viewer_client, manager_client
):
    queued_job(rq_queue)
    url = rq("jobs", queue_index)

    seen = viewer_client.get(url).content.decode()
    managed = manager_client.get(url).content.decode()

    assert f'href="{rq("clear", queue_index)}"' not in seen
    assert "Empty Queue (needs payments.manage_queues)" in seen
    assert f'href="{rq("clear", queue_index)}"' in managed


def test_changes__the_403_names_the_missing_permission(rq_queue, queue_index, viewer_client):
    response = viewer_client.get(rq("clear", queue_index))
    assert response.status_code == 403
    assert "payments.manage_queues" in response.content.decode()


def test_job_and_list_pages__a_viewer_sees_every_change_off_naming_the_permission(
    rq_queue, queue_index, viewer_client, manager_client
):
    """A reader of the queues (payments.view_operation only) clicking Delete, Requeue or a
    bulk action's Go at 3 a.m. got a 403 page: on the job's page and the failed jobs' list
    those controls are shown off, each naming the permission; a queue manager's work."""
    job = failed_job(rq_queue)
    page = rq("job_detail", queue_index, job.id)
    listed = rq("failed_jobs", queue_index)

    seen = viewer_client.get(page).content.decode()
    seen_list = viewer_client.get(listed).content.decode()
    managed = manager_client.get(page).content.decode()
    managed_list = manager_client.get(listed).content.decode()

    delete = rq("delete_job", queue_index, job.id)
    assert f'href="{delete}"' not in seen and f'href="{delete}"' in managed
    assert "Delete (needs payments.manage_queues)" in seen
    assert 'value="Requeue (needs payments.manage_queues)"' in seen
    assert 'value="Requeue"' in managed
    go = '<button type="submit" class="button" title="Execute selected action"'
    assert go not in seen_list and go in managed_list
    assert "Go (needs payments.manage_queues)" in seen_list


# --- a requeue that cannot do anything says so ------------------------------------------


def _failed_delivery(
    queue, op, func: str = "payments.engine.jobs.run_operation", job_id: str = ""
) -> Job:
    """`op`'s job in the failed registry, as a worker leaves it after its last attempt
    (`job_id`: another id than the operation's current delivery's)."""
    return failed_job(queue, job_id or op.job_id, operation_id=op.pk, func=func)


@pytest.mark.django_db(transaction=True)  # the job runs on a worker, which commits
def test_requeueing_a_failed_operations_job__says_it_changes_nothing_and_where_to_act(
    rq_queue, queue_index, manager_client
):
    """In an operator's incident walk, requeueing a failed checkout's job "succeeded" and
    the operation stayed failed, with no word why. The requeue goes ahead (the job runs
    and is skipped: run here); beside django-rq's message, a warning names the operation,
    links its page and says what to do there."""
    op = builders.move(builders.new_checkout("chk-gave-up"), OperationState.FAILED)
    job = _failed_delivery(rq_queue, op)

    response = manager_client.post(rq("requeue_job", queue_index, job.id))

    assert response.status_code == 302
    said = messages_of(response)
    warning = next(m for m in said if "chk-gave-up" in m)
    assert "no worker will run again" in warning and "new attempt" in warning
    assert f'href="{reverse("admin:payments_operation_change", args=[op.pk])}"' in warning
    assert "(failed)" in warning
    run_jobs(rq_queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert Job.fetch(job.id, connection=rq_queue.connection).return_value() == "skipped:failed"


def test_requeueing_in_bulk__warns_of_the_finished_operations_only(
    rq_queue, queue_index, manager_client
):
    runnable = builders.new_checkout("chk-waiting")
    runnable.refresh_from_db()  # the job id was recorded by an update
    waiting = _failed_delivery(rq_queue, runnable)
    done = builders.move(builders.new_checkout("chk-settled"), OperationState.FAILED)
    finished = _failed_delivery(rq_queue, done)
    paid = builders.move(builders.new_checkout("chk-paid"), OperationState.SUCCEEDED)
    also_finished = _failed_delivery(rq_queue, paid)

    alone = manager_client.post(
        rq("actions", queue_index), {"action": "requeue", "job_ids": [waiting.id]}
    )
    assert not any("no worker will run again" in m for m in messages_of(alone))

    rq_queue.remove(waiting.id)  # failed again, as before the first requeue
    FailedJobRegistry(queue=rq_queue).add(Job.fetch(waiting.id, rq_queue.connection))
    every = manager_client.post(rq("requeue_all", queue_index))

    assert every.status_code == 302
    warnings = [m for m in messages_of(every) if "no worker will run again" in m]
    assert len(warnings) == 1
    assert warnings[0].startswith("2 requeued jobs deliver operations no worker will run again")
    assert "chk-settled</a> (failed)" in warnings[0] and "chk-paid</a> (succeeded)" in warnings[0]
    assert "failed: a new attempt" in warnings[0] and "succeeded: nothing" in warnings[0]
    assert "chk-waiting" not in warnings[0]
    assert sorted(rq_queue.get_job_ids()) == sorted([waiting.id, finished.id, also_finished.id])


def test_requeueing_a_failed_messages_job__no_warning__it_may_still_deliver(
    rq_queue, queue_index, manager_client
):
    """A message's job (the inbox's `deliver_message`) requeued may take its failed
    operation to succeeded (docs/design.md's table): nothing to warn of."""
    op = builders.move(builders.new_checkout("chk-message"), OperationState.FAILED)
    job = _failed_delivery(rq_queue, op, "payments.engine.jobs.deliver_message")

    response = manager_client.post(rq("requeue_job", queue_index, job.id))

    assert response.status_code == 302
    assert not any("no worker will run again" in m for m in messages_of(response))
    assert rq_queue.get_job_ids() == [job.id]


def test_requeueing_a_stale_job_and_an_unreadable_one__warns_by_the_operation_carried(
    rq_queue, queue_index, queue_manager
):
    """A job the sweeper sent again has a new id, so the operation's `job_id` no longer
    names the old failed one; requeued, the old one runs the same operation. It is
    matched by the operation it carries. A job whose payload cannot be read is left to
    django-rq, never a 500. A manager who may not view operations gets their keys, not
    links to pages they would be refused."""
    queue_manager.user_permissions.remove(
        Permission.objects.get(content_type__app_label="payments", codename="view_operation")
    )
    op = builders.move(builders.new_checkout("chk-stale"), OperationState.FAILED)
    stale = _failed_delivery(rq_queue, op, job_id="an-earlier-delivery")
    assert op.job_id != stale.id
    unreadable = failed_job(rq_queue)
    rq_queue.connection.hset(unreadable.key, "data", b"not a pickle")

    response = client_for(queue_manager).post(
        rq("actions", queue_index), {"action": "requeue", "job_ids": [unreadable.id, stale.id]}
    )

    assert response.status_code == 302
    warning = next(m for m in messages_of(response) if "no worker will run again" in m)
    assert warning.startswith("One of the requeued jobs delivers chk-stale (failed)")
    assert "href=" not in warning
