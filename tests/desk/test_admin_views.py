"""The operators' admin: pages, permissions, confirmations and what each POST does.

Inside one test transaction (no worker runs): real PostgreSQL, real Redis for
the RQ numbers and links, the real HTTP fake provider behind the desk.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import django_rq
import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.urls import reverse
from django.utils import timezone

from payments.admin import BADGE_COLOURS
from payments.desk import services as desk
from payments.engine import fence
from payments.engine.jobs import run_operation
from payments.engine.writes import fence_writes
from payments.models import (
    ClaimState,
    FenceAuditRun,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)
from payments.shop.models import OrderStatus
from tests.support import builders
from tests.support.builders import order_of
from tests.support.users import client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/payments/operation/"


def change_url(op: Operation) -> str:
    return reverse("admin:payments_operation_change", args=[op.pk])


def desk_url(op: Operation, action: str, step: str = "") -> str:
    if step:
        return reverse("admin:payments_operation_desk_step", args=[op.pk, step, action])
    return reverse("admin:payments_operation_desk", args=[op.pk, action])


def age_state(op: Operation, minutes: int) -> None:
    """Pretend the operation entered its current state `minutes` ago."""
    with fence_writes():  # hand-made state, as the test says
        OperationEvent.objects.filter(operation=op, step="", to_state=op.state).update(
            created_at=timezone.now() - timedelta(minutes=minutes)
        )


def log_messages(op: Operation, user) -> list[str]:
    entries = LogEntry.objects.filter(object_id=str(op.pk), user=user, action_flag=CHANGE)
    return [e.change_message for e in entries.order_by("pk")]


def auto_queue():
    """The payments queue, enqueueing at once (the test transaction never commits)."""
    return django_rq.get_queue("payments", commit_mode="auto")


# --- badges (STYLE 11: every state is mapped) ----------------------------------------


def test_badges__every_operation_and_claim_state_has_a_colour():
    states = {s.value for s in OperationState} | {s.value for s in ClaimState}
    assert states <= set(BADGE_COLOURS)
    assert set(BADGE_COLOURS) <= states  # and nothing stale


# --- the list ------------------------------------------------------------------------


def test_changelist__shows_badges_and_the_age_of_uncertain_operations(provider, viewer):
    op, _, _ = builders.uncertain(key="lost-answer", charged=True)
    age_state(op, 7)
    builders.succeeded(key="all-good")

    page = client_for(viewer).get(CHANGELIST).content.decode()

    assert "lost-answer" in page and "all-good" in page
    assert 'class="state-badge state-uncertain"' in page
    assert 'class="state-badge state-succeeded"' in page
    assert "7\xa0minutes" in page
    assert "buyer@example.com" not in page


def test_changelist__filters_by_state_and_kind(provider, viewer):
    builders.uncertain(key="lost-answer", charged=False)
    builders.succeeded(key="all-good")
    client = client_for(viewer)

    uncertain = client.get(CHANGELIST, {"state__exact": "uncertain"}).content.decode()
    by_kind = client.get(CHANGELIST, {"kind": "checkout"}).content.decode()

    assert "lost-answer" in uncertain and "all-good" not in uncertain
    assert "lost-answer" in by_kind and "all-good" in by_kind


@pytest.mark.parametrize("field", ["provider_reference", "idempotency_key", "order_id"])
def test_changelist__search_by_reference_idempotency_key_and_order_id(provider, viewer, field):
    op, claim = builders.succeeded(key="find-me")
    builders.succeeded(key="not-me")
    term = str(op.entity_id) if field == "order_id" else getattr(claim, field)

    page = client_for(viewer).get(CHANGELIST, {"q": term}).content.decode()

    assert "find-me" in page and "not-me" not in page


def test_changelist__needs_view_permission(provider, db, client):
    nobody = make_user("nobody")  # staff without any permission
    assert client_for(nobody).get(CHANGELIST).status_code == 403
    assert client.get(CHANGELIST).status_code == 302  # anonymous: to the login page


# --- the operation page ----------------------------------------------------------------


def test_operation_page__steps_audit_trail_and_rq_job_link(provider, operator, queue):
    op, claim, _ = builders.uncertain(charged=True)
    job_id = uuid.uuid4().hex
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(job_id=job_id)
    auto_queue().enqueue(run_operation, op.pk, job_id=job_id)

    page = client_for(operator).get(change_url(op)).content.decode()

    assert claim.idempotency_key in page
    assert "Audit trail" in page and "worker-1/4242" in page and "ReadTimeout" in page
    assert reverse("django_rq:job_detail", args=[0, job_id]) in page
    assert "Query the provider now" in page
    assert desk_url(op, "mark_succeeded", "charge") in page
    assert "Resume with the same key is unavailable" in page  # with the reason why
    # alice may not start new attempts: the button is shown off, naming the permission
    assert (
        "Start a new attempt is unavailable: it needs the permission payments.start_new_attempt"
        in page
    )
    assert desk_url(op, "new_attempt") not in page


def test_operation_page__viewer_sees_no_buttons_and_nothing_is_editable(provider, viewer):
    op, _, _ = builders.uncertain(charged=True)
    client = client_for(viewer)

    page = client.get(change_url(op)).content.decode()

    assert "Operator actions" not in page
    assert 'name="_save"' not in page
    assert client.post(change_url(op), {"state": "succeeded"}).status_code == 403
    assert client.get(reverse("admin:payments_operation_add")).status_code == 403
    assert client.get(reverse("admin:payments_operation_delete", args=[op.pk])).status_code == 403
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN


def test_operation_page__superuser_cannot_edit_either(provider, admin_client):
    op, _, _ = builders.uncertain(charged=True)
    assert admin_client.post(change_url(op), {"state": "succeeded"}).status_code == 403
    # Claims and events have no admin of their own: only the operation page shows them.
    assert admin_client.get("/admin/payments/stepclaim/").status_code == 404
    assert admin_client.get("/admin/payments/operationevent/").status_code == 404


# --- desk actions: confirmation pages and permissions ---------------------------------


@pytest.mark.parametrize(
    "action, step, reason_field",
    [
        ("query_provider", "", False),
        ("resume", "", True),
        ("mark_succeeded", "charge", True),
        ("mark_failed", "charge", True),
        ("new_attempt", "", True),
    ],
)
def test_desk_action__get_shows_what_will_happen(provider, senior, action, step, reason_field):
    op, claim, _ = builders.uncertain(charged=True)

    response = client_for(senior).get(desk_url(op, action, step))

    page = response.content.decode()
    # Nobody asked the provider in this state yet: mark failed is refused (409), shown alike;
    # an uncertain operation is settled, not resumed, and only a failed one gets a new
    # attempt: those pages are refused by the state, 409 as well (they answered 200).
    refused = action in ("mark_failed", "resume", "new_attempt")
    assert response.status_code == (409 if refused else 200)
    assert bool(response.context["refused"]) is refused
    assert "What will happen" in page
    assert claim.idempotency_key in page  # the steps of the operation are listed
    assert ('name="reason"' in page) is reason_field
    assert ('name="reference"' in page) is (action == "mark_succeeded")
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize(
    "action, step",
    [
        ("query_provider", ""),
        ("resume", ""),
        ("mark_succeeded", "charge"),
        ("mark_failed", "charge"),
        ("new_attempt", ""),
    ],
)
def test_desk_action__without_permission_is_403(provider, viewer, operator, action, step):
    op, claim, ref = builders.uncertain(charged=True)
    data = {"reason": "because", "reference": ref}

    for method in ("get", "post"):
        response = getattr(client_for(viewer), method)(desk_url(op, action, step), data)
        assert response.status_code == 403
    if action == "new_attempt":  # alice may reconcile, not start new attempts
        assert client_for(operator).post(desk_url(op, action), data).status_code == 403

    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN
    assert Operation.objects.count() == 1


def test_desk_action__unknown_action_or_operation_is_404(provider, operator):
    op, _, _ = builders.uncertain(charged=True)
    client = client_for(operator)
    assert client.get(desk_url(op, "delete_everything")).status_code == 404
    assert client.get(desk_url(op, "resume", "charge")).status_code == 404
    assert (
        client.get(reverse("admin:payments_operation_desk", args=[999999, "resume"])).status_code
        == 404
    )


# --- desk actions: what a POST does --------------------------------------------------


def test_desk_action__query_provider_on_a_retrying_operation_says_it_only_reads(provider, operator):
    op, claim, _ = builders.uncertain(charged=False)
    builders.move(op, OperationState.RETRYING, reason="resumed")
    client = client_for(operator)

    page = client.get(desk_url(op, "query_provider")).content.decode()
    assert "a worker may still run it" in page
    assert "Nothing is replayed and nothing is settled" in page

    response = client.post(desk_url(op, "query_provider"))
    assert response.status_code == 302
    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN  # read only: the worker settles it
    assert provider.state.stats()["create_requests"] == 0


def test_desk_action__query_provider_settles_logs_and_redirects(provider, operator):
    op, claim, reference = builders.uncertain(charged=True)
    client = client_for(operator)

    response = client.post(desk_url(op, "query_provider"))

    assert response.status_code == 302 and response.url == change_url(op)
    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert log_messages(op, operator) == [
        "Queried the provider: the provider shows the step succeeded; it is recorded done; "
        "now retrying (the operation runs its next steps)."
    ]
    page = client.get(response.url).content.decode()
    assert "the step succeeded; it is recorded done; now retrying" in page
    assert "messagelist" in page and '<li class="success">Queried' in page
    assert 'class="state-badge state-retrying"' in page
    assert "operator:alice" in page


def test_desk_action__resume(provider, operator):
    op, _ = builders.failed_after_charge()

    response = client_for(operator).post(desk_url(op, "resume"), {"reason": "bug fixed"})

    assert response.status_code == 302
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert log_messages(op, operator) == ["Resumed with the same key: bug fixed"]


def test_desk_action__mark_step_succeeded(provider, operator):
    op, claim, reference = builders.uncertain(charged=True)

    client_for(operator).post(
        desk_url(op, "mark_succeeded", "charge"), {"reference": reference, "reason": "dashboard"}
    )

    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert log_messages(op, operator) == [
        f"Marked step charge succeeded with {reference}: dashboard"
    ]


# The look-up's time is the database's now(), which one test transaction keeps at its start,
# before the move to needs review: committed transactions give each its own time.
@pytest.mark.django_db(transaction=True)
def test_desk_action__mark_step_failed(provider, operator):
    op, claim, _ = builders.uncertain(charged=False, age=timedelta(days=2))  # past key retention
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")
    desk.query_provider([op.pk], user=operator)  # mark failed waits for a look-up in the state

    client_for(operator).post(desk_url(op, "mark_failed", "charge"), {"reason": "none at provider"})

    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert order_of(op).status == OrderStatus.PAYMENT_FAILED
    assert log_messages(op, operator) == ["Marked step charge failed: none at provider"]


@pytest.mark.django_db(transaction=True)
def test_desk_action__mark_failed_that_the_provider_shows_succeeded__done_and_said_so(
    provider, operator
):
    """The provider shows the charge succeeded: the step is recorded done and the operation
    resumes. The action completed, otherwise than asked: the desk goes back to the
    operation with a warning and logs it, instead of a form error (409) on the confirmation
    page for something that had already happened."""
    op, claim, reference = builders.uncertain(charged=True, age=timedelta(days=2))
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")
    # A look-up in this state that found nothing yet (as the reconciler records one during
    # a lagging search) lets the button be pressed; the desk's own read then finds it.
    fence.note_provider_view(claim, None, source="reconciler")

    response = client_for(operator).post(
        desk_url(op, "mark_failed", "charge"), {"reason": "looks failed"}, follow=True
    )

    assert response.status_code == 200 and response.redirect_chain[-1][1] == 302
    shown = [(m.level_tag, str(m)) for m in response.context["messages"]]
    assert [level for level, _ in shown] == ["warning"], shown
    assert shown[0][1].startswith("Not marked failed: the provider shows step charge"), shown
    assert f"succeeded ({reference})" in shown[0][1], shown
    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE
    assert log_messages(op, operator)[0].startswith("Not marked failed: the provider shows")


def test_desk_action__start_new_attempt(provider, senior):
    op, _ = builders.declined()

    client_for(senior).post(
        desk_url(op, "new_attempt"),
        {"reason": "new card authorised", "payment_method": "pm_card_visa"},
    )

    new = Operation.objects.get(retry_of=op)
    assert (new.key, new.scope) == ("chk-1 attempt 2", "derived")
    assert log_messages(op, senior) == [f"Started a new attempt {new.key}: new card authorised"]


def test_desk_action__refusal_is_shown_and_changes_nothing(provider, operator):
    op, claim, _ = builders.uncertain(charged=True)
    client = client_for(operator)

    response = client.post(desk_url(op, "resume"), {"reason": "just go"}, follow=True)

    page = response.content.decode()
    assert "Nothing was changed" in page and "step charge is uncertain" in page
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    assert log_messages(op, operator) == []


def test_desk_action__blank_reason_is_asked_again(provider, operator):
    op, _ = builders.failed_after_charge()

    response = client_for(operator).post(desk_url(op, "resume"), {"reason": "   "})

    assert response.status_code == 200
    assert "This field is required." in response.content.decode()
    op.refresh_from_db()
    assert op.state == OperationState.FAILED


# --- the changelist bulk action ------------------------------------------------------


def test_bulk_query_provider__confirms_then_settles_each_operation(provider, operator):
    first, _, _ = builders.uncertain(key="a", charged=True)
    second, _, _ = builders.uncertain(key="b", charged=True, pm="pm_card_chargeDeclined")
    client = client_for(operator)
    selection = {"action": "query_selected", "_selected_action": [first.pk, second.pk]}

    confirm = client.post(CHANGELIST, selection)

    assert confirm.status_code == 200
    assert "Yes, query their systems" in confirm.content.decode()
    assert StepClaim.objects.filter(state=ClaimState.UNCERTAIN).count() == 2

    done = client.post(CHANGELIST, {**selection, "post": "yes"}, follow=True)

    assert "2 settled, 0 still waiting, 0 not read" in done.content.decode()
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.state, second.state) == (OperationState.RETRYING, OperationState.FAILED)
    assert log_messages(first, operator) == ["Queried the provider: done"]
    assert log_messages(second, operator) == ["Queried the provider: failed"]


def test_bulk_query_provider__not_offered_without_permission(provider, viewer):
    op, _, _ = builders.uncertain(charged=True)
    client = client_for(viewer)

    assert "query_selected" not in client.get(CHANGELIST).content.decode()
    client.post(
        CHANGELIST, {"action": "query_selected", "_selected_action": [op.pk], "post": "yes"}
    )

    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN


# --- Needs attention -------------------------------------------------------------------


def test_needs_attention__counts_oldest_ages_failed_jobs_and_last_audit(provider, viewer, queue):
    old, _, _ = builders.uncertain(key="old-unknown", charged=False)
    builders.uncertain(key="new-unknown", charged=False)
    review = builders.move(
        builders.new_checkout(key="review-me"),
        OperationState.NEEDS_REVIEW,
        reason="idempotency conflict",
    )
    builders.succeeded(key="fine")
    age_state(old, 42)
    age_state(review, 3 * 60)
    q = auto_queue()
    q.enqueue(run_operation, "not-an-id")  # a malformed job fails for good
    run_worker(q)
    FenceAuditRun.objects.create(
        started_at=timezone.now(),
        finished_at=timezone.now(),
        window_start=timezone.now() - timedelta(days=1),
        exit_code=1,
        summary={"clean": False, "unfenced": ["pi_x"], "provider_successes": 3},
    )

    response = client_for(viewer).get(reverse("admin:payments_operation_needs_attention"))

    page = response.content.decode()
    ctx = response.context
    counts = {row["state"]: row["count"] for row in ctx["states"]}
    assert counts == {
        "pending": 0,
        "running": 0,
        "retrying": 0,
        "failed": 0,
        "uncertain": 2,
        "needs_review": 1,
    }  # fmt: skip  (no "succeeded" figure: nothing to do there; the chart counts it)
    cases = [row["operation"].key for row in ctx["cases"].rows]
    assert cases == ["review-me", "old-unknown", "new-unknown"]  # oldest in its state first
    assert (
        ctx["cases"].rows[0]["age"] == "3\xa0hours" and "€19.99" in ctx["cases"].rows[0]["amount"]
    )
    assert {item["label"]: item["total"] for item in ctx["legend"]} == {
        "succeeded": 1, "declined or failed": 0, "uncertain": 2, "needs review": 1,
    }  # fmt: skip
    assert '<svg class="desk-chart"' in page
    assert ctx["oldest_uncertain"]["operation"].key == "old-unknown"
    assert ctx["oldest_uncertain"]["age"] == "42\xa0minutes"
    assert ctx["oldest_needs_review"]["age"] == "3\xa0hours"
    assert ctx["failed_jobs"]["count"] == 1
    assert reverse("django_rq:failed_jobs", args=[0]) in page
    assert "problems found (exit 1)" in page
    unfenced = page.split('id="audit-unfenced"', 1)[1].split("</table>", 1)[0]
    assert '<code class="desk-ref">pi_x</code>' in unfenced  # a table row, not a dict


def test_needs_attention__says_when_no_audit_ran(provider, viewer, queue):
    page = client_for(viewer).get(reverse("admin:payments_operation_needs_attention"))
    assert "No audit run yet" in page.content.decode()
    assert page.context["oldest_uncertain"] is None


def test_needs_attention__needs_view_permission(db):
    nobody = make_user("nobody")
    url = reverse("admin:payments_operation_needs_attention")
    assert client_for(nobody).get(url).status_code == 403


def test_needs_attention__linked_from_the_index_and_the_operations_list(viewer):
    url = reverse("admin:payments_operation_needs_attention")
    client = client_for(viewer)
    assert url in client.get(reverse("admin:index")).content.decode()
    assert url in client.get(CHANGELIST).content.decode()


# --- orders and invoices -----------------------------------------------------------------


def test_orders_and_invoices__read_only_and_no_email_in_the_list(provider, viewer):
    op, _ = builders.succeeded()
    order = order_of(op)
    client = client_for(viewer)

    listing = client.get(reverse("admin:shop_order_changelist")).content.decode()
    page = client.get(reverse("admin:shop_order_change", args=[order.pk])).content.decode()

    assert "buyer@example.com" not in listing
    assert "buyer@example.com" in page and op.key in page
    assert client.get(reverse("admin:shop_order_add")).status_code == 403
    assert client.get(reverse("admin:shop_invoice_changelist")).status_code == 200
    assert client.get(reverse("admin:shop_invoice_add")).status_code == 403


def test_desk_action__query_provider_on_a_succeeded_operation__refused_and_nothing_written(
    provider, operator
):
    """An operator's try: 15 presses of "Query the provider now" on a succeeded checkout
    wrote 15 audit rows "nothing to settle" and 15 desk-log lines. Nothing waits there."""
    op, _ = builders.succeeded(key="asked-after-done")
    client = client_for(operator)
    rows = OperationEvent.objects.filter(operation=op).count()

    page = client.get(desk_url(op, "query_provider")).content.decode()
    response = client.post(desk_url(op, "query_provider"))

    assert "no step of it waits to be settled" in page
    assert response.status_code == 409
    assert OperationEvent.objects.filter(operation=op).count() == rows
    assert log_messages(op, operator) == []


def test_desk_action__query_provider_on_an_operation_a_worker_holds__a_warning_and_no_row(
    provider, operator
):
    """It answered "not queried" in green, and wrote an audit row for a query never made."""
    op, _, _ = builders.uncertain(key="asked-while-held", charged=False)
    builders.move(op, OperationState.RETRYING, reason="resumed")
    assert fence.acquire_lease(op.pk, owner=builders.WORKER, seconds=300).acquired  # running
    client = client_for(operator)
    rows = OperationEvent.objects.filter(operation=op).count()

    response = client.post(desk_url(op, "query_provider"), follow=True)

    page = response.content.decode()
    assert "not queried" in page
    assert '<li class="warning">Queried' in page
    assert OperationEvent.objects.filter(operation=op).count() == rows
