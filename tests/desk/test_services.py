"""The desk's services against real PostgreSQL and the real HTTP fake provider.

These run inside one test transaction (no worker runs here): enqueues happen
on commit, so `django_capture_on_commit_callbacks` shows what would be sent.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

import pytest
from django.core.exceptions import PermissionDenied
from django.db import transaction

from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.desk.services import DeskError, ReasonRequired
from payments.engine import fence, systems
from payments.engine.signals import operation_state_changed
from payments.engine.writes import fence_writes
from payments.models import (
    ClaimState,
    KeyScope,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)
from payments.shop.models import OrderStatus
from tests.support import builders
from tests.support.builders import order_of
from tests.support.provider import successes

pytestmark = pytest.mark.django_db

OLD = timedelta(minutes=20)  # older than the grace period (RECONCILE_GRACE, 15 min)
#: Older than the provider keeps idempotency keys: no replay, only lookups count.
PAST_RETENTION = timedelta(days=2)


def operator_events(op: Operation, user) -> list[OperationEvent]:
    return list(OperationEvent.objects.filter(operation=op, actor=f"operator:{user.username}"))


def enqueues(callbacks: list) -> list:
    """The on-commit callbacks but the state-change announcements (the metrics' counters)."""
    return [c for c in callbacks if getattr(c, "func", None) != operation_state_changed.send]


# --- query_provider ---------------------------------------------------------------


def test_query_provider__settles_a_lost_success_and_resumes(
    provider, operator, django_capture_on_commit_callbacks
):
    op, claim, reference = builders.uncertain(charged=True)

    with django_capture_on_commit_callbacks() as callbacks:
        report = desk.query_provider([op.pk], user=operator)

    [row] = report.rows
    assert (row.outcome, row.state_before, row.state_after) == ("done", "uncertain", "retrying")
    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE
    assert claim.provider_reference == reference
    assert len(enqueues(callbacks)) == 1  # the operation is enqueued again on commit
    assert successes(provider, op) == 1  # the replay used the same key
    reasons = [e.reason for e in operator_events(op, operator)]
    assert "queried the provider: done" in reasons


def test_query_provider__lost_decline_fails_the_operation_and_its_order(provider, operator):
    op, claim, _ = builders.uncertain(charged=True, pm="pm_card_chargeDeclined")

    report = desk.query_provider([op.pk], user=operator)

    assert report.rows[0].outcome == "failed"
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert order_of(op).status == OrderStatus.PAYMENT_FAILED
    assert successes(provider, op) == 0


def test_query_provider__operation_without_unsettled_steps_is_reported_not_audited(
    provider, operator
):
    """Nothing waited, nothing was sent: no audit row (an operator's fifteen presses on a
    succeeded checkout wrote fifteen "nothing to settle" rows)."""
    op, _ = builders.succeeded()

    report = desk.query_provider([op.pk], user=operator)

    assert [(r.outcome, r.state_after) for r in report.rows] == [("nothing_to_settle", "succeeded")]
    assert operator_events(op, operator) == []


def test_query_provider__refuses_an_empty_selection_and_a_user_without_permission(
    provider, operator, viewer
):
    op, _, _ = builders.uncertain(charged=True)
    with pytest.raises(DeskError):
        desk.query_provider([], user=operator)
    with pytest.raises(PermissionDenied):
        desk.query_provider([op.pk], user=viewer)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN


# --- resume -----------------------------------------------------------------------


def test_resume__failed_after_charge__same_key_fresh_attempts_order_reopened(
    provider, operator, django_capture_on_commit_callbacks
):
    op, claim = builders.failed_after_charge()
    assert order_of(op).status == OrderStatus.PAYMENT_FAILED

    with django_capture_on_commit_callbacks() as callbacks:
        resumed = desk.resume(op, user=operator, reason="invoice bug fixed in release 42")

    op.refresh_from_db()
    assert resumed.key == op.key == "chk-1"
    assert op.state == OperationState.RETRYING
    assert op.attempts == 0
    assert op.next_attempt_at is not None
    assert order_of(op).status == OrderStatus.PROCESSING  # no second checkout can start now
    assert len(enqueues(callbacks)) == 1
    [event] = operator_events(op, operator)
    assert (event.from_state, event.to_state) == ("failed", "retrying")
    assert event.reason == "resumed: invoice bug fixed in release 42"


@pytest.mark.parametrize(
    "build, refusal",
    [
        (lambda: builders.uncertain(charged=True)[0], "uncertain"),
        (lambda: builders.succeeded()[0], "succeeded"),
        (lambda: builders.declined()[0], "refused"),
        (lambda: builders.new_checkout(), "will run"),
    ],
    ids=["uncertain_step", "succeeded", "declined", "pending"],
)
def test_resume__refused_when_the_state_forbids_it(provider, operator, build, refusal):
    op = build()
    state = op.state

    with pytest.raises(DeskError, match=refusal):
        desk.resume(op, user=operator, reason="try again")

    op.refresh_from_db()
    assert op.state == state
    assert operator_events(op, operator) == []


def test_resume__refused_while_a_worker_holds_the_lease(provider, operator):
    op = builders.new_checkout()
    assert fence.acquire_lease(op.pk, owner="worker-2/7", seconds=60).acquired

    with pytest.raises(DeskError, match="a worker runs it now"):
        desk.resume(op, user=operator, reason="stuck?")


def test_resume__refused_when_the_order_has_a_newer_operation(provider, operator):
    op, _ = builders.failed_after_charge()
    # The API refuses a new checkout while an earlier charge of the order is done...
    with pytest.raises(CheckoutNotAllowed):
        request_checkout(
            order_id=op.params["order_id"],
            key="chk-1-api",
            payment_method="pm_card_visa",
            actor="api",
        )
    # ...and the desk still refuses to resume beside a newer operation from any other path.
    with transaction.atomic():
        fence.create_operation_in_tx(
            key="chk-1-api",
            kind="checkout",
            entity_type="order",
            entity_id=op.params["order_id"],
            params={**op.params, "payment_method": "pm_x"},
            actor="test",
        )

    with pytest.raises(DeskError, match="has another operation \\(chk-1-api, pending\\)"):
        desk.resume(op, user=operator, reason="again")

    op.refresh_from_db()
    assert op.state == OperationState.FAILED


def test_resume__needs_a_reason_and_the_permission(provider, operator, viewer):
    op, _ = builders.failed_after_charge()

    with pytest.raises(ReasonRequired):
        desk.resume(op, user=operator, reason="   ")
    with pytest.raises(PermissionDenied):
        desk.resume(op, user=viewer, reason="because")

    op.refresh_from_db()
    assert op.state == OperationState.FAILED


# --- mark_step_succeeded ------------------------------------------------------------


def test_mark_step_succeeded__checks_the_reference_records_it_and_resumes(
    provider, operator, django_capture_on_commit_callbacks
):
    op, claim, reference = builders.uncertain(charged=True)

    with django_capture_on_commit_callbacks() as callbacks:
        settled = desk.mark_step_succeeded(
            op, "charge", reference=reference, user=operator, reason="seen in the dashboard"
        )

    assert settled.state == ClaimState.DONE
    assert settled.provider_reference == reference
    assert settled.result["settled_by"] == "operator:alice"
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert len(enqueues(callbacks)) == 1
    events = operator_events(op, operator)
    # The operator takes the claim over (its worker never released it: in doubt), then settles.
    assert [(e.step, e.to_state) for e in events] == [
        ("charge", "uncertain"),
        ("charge", "done"),
        ("", "retrying"),
    ]
    assert all("seen in the dashboard" in e.reason for e in events)
    assert successes(provider, op) == 1


def test_mark_step_succeeded__failed_operation_reopens_its_order(provider, operator):
    op, claim, reference = builders.uncertain(charged=True)
    builders.move(op, OperationState.FAILED, reason="gave up")

    desk.mark_step_succeeded(op, "charge", reference=reference, user=operator, reason="paid")

    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert order_of(op).status == OrderStatus.PROCESSING


def test_mark_step_succeeded__refuses_a_reference_unknown_to_the_provider(provider, operator):
    op, claim, _ = builders.uncertain(charged=False)

    with pytest.raises(DeskError, match="has no charge pi_doesnotexist"):
        desk.mark_step_succeeded(
            op, "charge", reference="pi_doesnotexist", user=operator, reason="typo"
        )

    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN


def test_mark_step_succeeded__refuses_a_charge_of_another_operation(provider, operator):
    other, _ = builders.succeeded(key="other")
    other_ref = other.claims.get(step="charge").provider_reference
    # Unrecorded here, so that only the provider's metadata can tell it is not ours.
    with fence_writes():  # hand-made state, as the test says
        other.claims.filter(step="charge").update(provider_reference="")
    op, claim, _ = builders.uncertain(key="mine", charged=False)

    with pytest.raises(DeskError, match="belongs to another operation"):
        desk.mark_step_succeeded(op, "charge", reference=other_ref, user=operator, reason="x")


def test_mark_step_succeeded__refuses_a_reference_another_claim_carries(provider, operator):
    other, _ = builders.succeeded(key="other")
    other_ref = other.claims.get(step="charge").provider_reference
    op, claim, _ = builders.uncertain(key="mine", charged=True)

    with pytest.raises(DeskError, match="already settles other/charge"):
        desk.mark_step_succeeded(op, "charge", reference=other_ref, user=operator, reason="x")


def test_mark_step_succeeded__refuses_a_declined_charge(provider, operator):
    op, claim, reference = builders.uncertain(charged=True, pm="pm_card_chargeDeclined")

    with pytest.raises(DeskError, match="its status is requires_payment_method"):
        desk.mark_step_succeeded(op, "charge", reference=reference, user=operator, reason="x")


def test_mark_step_succeeded__needs_reference_reason_and_an_unsettled_step(provider, operator):
    op, claim, reference = builders.uncertain(charged=True)
    with pytest.raises(DeskError, match="reference is required"):
        desk.mark_step_succeeded(op, "charge", reference=" ", user=operator, reason="x")
    with pytest.raises(ReasonRequired):
        desk.mark_step_succeeded(op, "charge", reference=reference, user=operator, reason="")
    with pytest.raises(DeskError, match="not a step with a provider look-up"):
        desk.mark_step_succeeded(op, "invoice", reference=reference, user=operator, reason="x")
    done, _ = builders.succeeded(key="done")
    with pytest.raises(DeskError, match="succeeded"):
        desk.mark_step_succeeded(done, "charge", reference=reference, user=operator, reason="x")


# --- mark_step_failed ---------------------------------------------------------------


def test_mark_step_failed__nothing_at_the_provider__fails_operation_and_order(provider, operator):
    op, claim, _ = builders.uncertain(charged=False, age=PAST_RETENTION)

    settled = desk.mark_step_failed(
        op, "charge", user=operator, reason="provider support: none"
    ).claim

    assert settled.state == ClaimState.FAILED
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert order_of(op).status == OrderStatus.PAYMENT_FAILED  # the handler's on_failure ran
    events = operator_events(op, operator)
    assert [(e.step, e.to_state) for e in events] == [
        ("charge", "uncertain"),
        ("charge", "failed"),
        ("", "failed"),
    ]
    assert all("provider support: none" in e.reason for e in events)


def test_mark_step_failed__refused_when_the_provider_shows_a_success(provider, operator):
    op, claim, reference = builders.uncertain(charged=True, age=OLD)

    marked = desk.mark_step_failed(op, "charge", user=operator, reason="I think it failed")
    assert marked.found_succeeded and re.search(f"succeeded \\({reference}\\)", marked.detail), (
        marked
    )

    claim.refresh_from_db()
    op.refresh_from_db()
    # The same-key replay recorded the success; the operation resumes to pay the order.
    assert (claim.state, op.state) == (ClaimState.DONE, OperationState.RETRYING)
    assert successes(provider, op) == 1


def test_mark_step_failed__refused_within_the_grace_after_the_last_request(provider, operator):
    op, claim, _ = builders.uncertain(charged=False)  # just now: a request may still run
    builders.move(op, OperationState.FAILED, reason="gave up")  # failed: no replay any more

    with pytest.raises(DeskError, match="less than 15 min ago: it may still be executed"):
        desk.mark_step_failed(op, "charge", user=operator, reason="nothing there")
    claim.refresh_from_db()
    assert claim.provider_view["status"] == "not_found"  # what the provider showed, kept


def test_mark_step_failed__replays_with_the_same_key_while_the_provider_keeps_it(
    provider, operator
):
    """The request never reached the provider: the same-key replay is the evidence (it runs now,
    as the operation intended), so "mark failed" is refused and the operation resumes."""
    op, claim, _ = builders.uncertain(charged=False, age=OLD)

    marked = desk.mark_step_failed(op, "charge", user=operator, reason="nothing there")
    assert marked.found_succeeded, marked
    assert "recorded as done and the operation resumes" in marked.detail

    claim.refresh_from_db()
    op.refresh_from_db()
    assert claim.state == ClaimState.DONE
    assert op.state == OperationState.RETRYING
    assert successes(provider, op) == 1


def test_mark_failed_then_new_attempt__never_charges_an_order_twice_while_search_lags(
    provider, operator, senior
):
    """The desk's double charge: an uncertain charge that succeeded, the provider's search
    lagging; "mark failed" accepted it and "start a new attempt" charged the order again."""
    provider.state.configure(search_lag=3600)  # the search does not show the charge yet
    op, claim, reference = builders.uncertain(charged=True, age=OLD)

    marked = desk.mark_step_failed(op, "charge", user=operator, reason="not in the search")
    assert marked.found_succeeded and re.search(f"succeeded \\({reference}\\)", marked.detail), (
        marked
    )
    with pytest.raises(DeskError):
        desk.start_new_attempt(op, user=senior, reason="customer asked to retry")

    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert not Operation.objects.filter(retry_of=op).exists()
    assert successes(provider, op) == 1


def test_start_new_attempt__refused_when_a_claim_failed_without_the_provider_shows_success(
    provider, senior
):
    """A claim recorded failed without a provider answer is asked again before a new key."""
    op, claim, reference = builders.uncertain(charged=True, age=PAST_RETENTION)
    with fence_writes():  # hand-made state: settled failed with no provider evidence (a bug)
        StepClaim.objects.filter(pk=claim.pk).update(state=ClaimState.FAILED)
    builders.move(op, OperationState.FAILED, reason="gave up")
    builders.order_of(op).__class__.objects.filter(pk=op.params["order_id"]).update(
        status=OrderStatus.PAYMENT_FAILED
    )

    with pytest.raises(DeskError, match=f"succeeded \\({reference}\\)"):
        desk.start_new_attempt(op, user=senior, reason="new card")

    assert not Operation.objects.filter(retry_of=op).exists()
    assert successes(provider, op) == 1


def test_mark_step_failed__refused_when_the_provider_cannot_be_asked(provider, operator, settings):
    op, claim, _ = builders.uncertain(charged=False, age=OLD)
    provider.stop()

    with pytest.raises(DeskError, match="could not check step charge"):
        desk.mark_step_failed(op, "charge", user=operator, reason="provider down anyway")

    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN


def test_mark_step_failed__a_found_decline_is_recorded_with_its_reference(provider, operator):
    op, claim, reference = builders.uncertain(charged=True, pm="pm_card_chargeDeclined")

    settled = desk.mark_step_failed(
        op, "charge", user=operator, reason="declined per provider"
    ).claim

    assert (settled.state, settled.provider_reference) == (ClaimState.FAILED, reference)


# --- start_new_attempt --------------------------------------------------------------


def test_start_new_attempt__new_key_linked_order_processing_audited(
    provider, senior, django_capture_on_commit_callbacks
):
    op, _ = builders.declined()

    with django_capture_on_commit_callbacks() as callbacks:
        new = desk.start_new_attempt(
            op, user=senior, reason="customer called, new card ok", payment_method="pm_card_visa"
        )

    assert (new.key, new.scope) == ("chk-1 attempt 2", KeyScope.DERIVED)
    assert new.retry_of_id == op.pk
    assert new.state == OperationState.PENDING
    assert new.params["order_id"] == op.params["order_id"]
    assert order_of(op).status == OrderStatus.PROCESSING
    assert len(enqueues(callbacks)) == 1
    assert f"new attempt {new.key} started" in operator_events(op, senior)[0].reason
    assert any("new attempt of chk-1" in e.reason for e in operator_events(new, senior))


def test_start_new_attempt__only_once(provider, senior):
    op, _ = builders.declined()
    desk.start_new_attempt(op, user=senior, reason="first", payment_method="pm_card_visa")

    with pytest.raises(DeskError, match="a new attempt exists already: chk-1 attempt 2"):
        desk.start_new_attempt(op, user=senior, reason="second", payment_method="pm_card_visa")

    assert Operation.objects.filter(retry_of=op).count() == 1


@pytest.mark.parametrize(
    "build, refusal",
    [
        (lambda: builders.uncertain(charged=False)[0], "only a failed operation"),
        (
            lambda: builders.failed_after_charge()[0],
            "step charge is done: it may have taken effect",
        ),
        (lambda: builders.succeeded()[0], "only a failed operation"),
    ],
    ids=["uncertain", "failed_but_charged", "succeeded"],
)
def test_start_new_attempt__refused_when_a_step_may_have_charged(provider, senior, build, refusal):
    op = build()

    with pytest.raises(DeskError, match=refusal):
        desk.start_new_attempt(op, user=senior, reason="try a new key")

    assert not Operation.objects.filter(retry_of=op).exists()


def test_start_new_attempt__refused_with_an_uncertain_claim_on_a_failed_operation(provider, senior):
    op, claim, _ = builders.uncertain(charged=False)
    builders.move(op, OperationState.FAILED, reason="gave up")

    with pytest.raises(DeskError, match="step charge is uncertain"):
        desk.start_new_attempt(op, user=senior, reason="x")


def test_start_new_attempt__needs_its_own_permission(provider, operator):
    op, _ = builders.declined()

    with pytest.raises(PermissionDenied):
        desk.start_new_attempt(op, user=operator, reason="x")


def test_next_attempt_key__counts_up_from_the_first_attempt_in_the_derived_scope(provider, senior):
    op, _ = builders.declined()
    assert desk.next_attempt_key(op) == "chk-1 attempt 2"
    second = desk.start_new_attempt(
        op, user=senior, reason="new card", payment_method="pm_card_visa"
    )
    assert desk.next_attempt_key(second) == "chk-1 attempt 3"
    # A client may use the same string as its own key: another scope, no collision.
    order = create_order(amount=100, currency="eur", email="c@example.com")
    client_op, created = request_checkout(
        order_id=order.pk, key=second.key, payment_method="pm_card_visa", actor="api"
    )
    assert created and client_op.pk != second.pk


def test_available_actions__explain_what_the_state_refuses(provider):
    op, _, _ = builders.uncertain(charged=True)

    actions = desk.available_actions(op)

    assert actions.settleable_steps == ["charge"]
    assert "uncertain" in actions.refused["resume"]
    assert "only a failed operation" in actions.refused["new_attempt"]


def test_mark_step_failed__a_system_without_reads__records_the_operators_reading_not_a_read(
    provider, operator, settings, monkeypatch
):
    """Nothing was read (the system offers no look-up): the step is failed on the operator's
    reading of the system's report, and says so; no "not found" is made up."""
    declared = dataclasses.replace(systems.system_named("provider"), reads=())
    monkeypatch.setitem(systems._declared, "provider", declared)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_KEY_RETENTION": 4 * 3600}
    op, claim, _ = builders.uncertain(key="blind-mark", charged=False, age=timedelta(hours=5))

    settled = desk.mark_step_failed(op, "charge", user=operator, reason="Adyen report: none").claim

    assert settled.state == ClaimState.FAILED
    assert settled.result == {
        "status": "marked_failed",
        "evidence": "the operator's reading of the provider's report",
    }
    assert "offers no look-up: the operator's reading of its report" in settled.error
    claim.refresh_from_db()
    assert (claim.provider_view or {}).get("status") != "not_found"
