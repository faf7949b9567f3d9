"""Provider events settle claims behind the inbox: in seconds, once, never backwards.

Transactional, over real HTTP: claims commit before their calls, workers run
in this process (`run_worker`), and the live-server tests send the fake's
webhooks to this app's own endpoint.
"""

from __future__ import annotations

import copy
import logging
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

from inbox.models import InboxEntry
from payments.checkout.charge import PaymentIntentCharge
from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE
from payments.engine import fence, recovery, steps
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationEvent, OperationState, ProviderEvent
from payments.refunds.handler import request_refund
from payments.shop.models import CreditNote, Order, OrderStatus
from payments.webhooks.handling import CONSUMER, handle_event
from tests.support.builders import charge_effect
from tests.support.flows import order_and_checkout
from tests.support.provider import make_client
from tests.support.users import VIEW, client_for, make_user
from tests.support.workers import run_worker
from tests.webhooks.conftest import signed

pytestmark = pytest.mark.django_db(transaction=True)

ACTOR = "provider-events:test"


def deliver(event: dict) -> None:
    """Post one event to the endpoint, signed as the fake signs it."""
    body, header = signed(event)
    response = Client().post(
        "/webhooks/provider", data=body, content_type="application/json",
        HTTP_STRIPE_SIGNATURE=header,
    )  # fmt: skip
    assert response.status_code == 200, response.content


def uncertain_checkout(provider, queue, *, pm: str = "pm_card_visa") -> tuple[Order, Operation]:
    """Charged (or declined) at the provider, the answer dropped: the operation is uncertain."""
    order, op = order_and_checkout(pm=pm)
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return order, op


def only_event(provider, event_type: str) -> dict:
    (event,) = provider.state.events(type=event_type)
    return event


@pytest.fixture
def no_reconciler(monkeypatch):
    """Fail the test if anything asks the provider to look a claim up or runs the reconciler."""

    def refuse(*args, **kwargs):
        raise AssertionError("the reconciler (or a lookup) ran")

    monkeypatch.setattr(recovery, "reconcile", refuse)
    monkeypatch.setattr(steps, "_settle_from_lookup", refuse)
    monkeypatch.setattr(PaymentIntentCharge, "find", refuse)


# --- the real path: a webhook to the live server -----------------------------------------


def test_an_event_settles_an_uncertain_charge_in_seconds__without_the_reconciler(
    live_provider, queue, no_reconciler
):
    order, op = order_and_checkout()
    live_provider.state.enqueue_faults("drop_after_accept", 1)
    started = time.monotonic()

    deadline = started + 10
    while time.monotonic() < deadline:
        run_worker(queue)  # the charge, then the event's job, then the resumed operation
        op.refresh_from_db()
        if op.state == OperationState.SUCCEEDED:
            break
        time.sleep(0.05)
    settled_after = time.monotonic() - started

    assert op.state == OperationState.SUCCEEDED, op.last_error
    assert settled_after < 5
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert live_provider.state.succeeded_count() == 1
    (intent,) = live_provider.state.intents()
    claim = op.claims.get(step=CHARGE)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, intent["id"])
    event = ProviderEvent.objects.get()
    assert (event.outcome, event.operation_id) == ("done", op.pk)
    assert event.handled_at is not None
    assert InboxEntry.objects.filter(consumer=CONSUMER, message_id=event.id).exists()
    reasons = list(op.events.values_list("reason", flat=True))
    assert any(f"provider event {event.id}" in r for r in reasons)


def test_out_of_order_and_duplicated_webhooks__settle_each_charge_once(
    live_provider, queue, no_reconciler
):
    first_order, first = order_and_checkout(key="first")
    second_order, second = order_and_checkout(key="second")
    live_provider.state.enqueue_faults("drop_after_accept", 2)
    live_provider.webhooks.enqueue_faults("reorder")  # the first event arrives last
    live_provider.webhooks.enqueue_faults("duplicate")  # the second one twice

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        run_worker(queue)
        states = {op.refresh_from_db() or op.state for op in (first, second)}
        if states == {OperationState.SUCCEEDED}:
            break
        time.sleep(0.05)

    assert {first.state, second.state} == {OperationState.SUCCEEDED}
    assert live_provider.state.succeeded_count() == 2
    assert live_provider.webhooks.wait_idle()
    stats = live_provider.webhooks.stats()
    assert (stats["reordered"], stats["duplicated"], stats["delivered"]) == (1, 1, 3)
    assert ProviderEvent.objects.count() == 2
    assert InboxEntry.objects.filter(consumer=CONSUMER).count() == 2


# --- duplicates, order, contradictions (events posted to the endpoint) --------------------


def test_a_duplicate_event__is_skipped_and_changes_nothing(provider_with_secret, queue, caplog):
    order, op = uncertain_checkout(provider_with_secret, queue)
    event = only_event(provider_with_secret, "payment_intent.succeeded")
    deliver(event)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    audit_rows = OperationEvent.objects.count()

    deliver(event)  # the provider delivers it again: acknowledged, already handled
    caplog.set_level(logging.INFO, logger="inbox")
    outcome = handle_event(event["id"], actor=ACTOR)  # and a redelivered job
    run_worker(queue)

    assert outcome == "duplicate"
    assert f"Skipping message {event['id']} for {CONSUMER}" in caplog.messages
    assert OperationEvent.objects.count() == audit_rows
    assert ProviderEvent.objects.get().outcome == "done"
    assert provider_with_secret.state.succeeded_count() == 1
    InboxEntry.objects.all().delete()  # past INBOX_RETENTION: the stored event still knows
    assert handle_event(event["id"], actor=ACTOR) == "duplicate"
    assert OperationEvent.objects.count() == audit_rows


def test_a_decline_snapshot_of_a_succeeded_intent__is_read_as_the_provider_shows_it(
    provider_with_secret, queue
):
    """An older (or forged) snapshot says "declined" for an intent that succeeded: the intent
    is retrieved first, and it succeeded. Nothing changes, and no reversal is recorded."""
    order, op = uncertain_checkout(provider_with_secret, queue)
    succeeded = only_event(provider_with_secret, "payment_intent.succeeded")
    deliver(succeeded)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    earlier = copy.deepcopy(succeeded)  # the same intent, "declined"
    earlier.update(id="evt_earlier_decline", type="payment_intent.payment_failed")
    earlier["created"] -= 5
    earlier["data"]["object"].update(status="requires_payment_method")
    audit_rows = OperationEvent.objects.count()

    deliver(earlier)
    run_worker(queue)

    assert ProviderEvent.objects.get(pk="evt_earlier_decline").outcome == "already_settled"
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert op.claims.get(step=CHARGE).state == ClaimState.DONE
    assert OperationEvent.objects.count() == audit_rows


def test_a_decline_event__fails_an_uncertain_charge(provider_with_secret, queue):
    order, op = uncertain_checkout(provider_with_secret, queue, pm="pm_card_chargeDeclined")

    deliver(only_event(provider_with_secret, "payment_intent.payment_failed"))
    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert order.status == OrderStatus.PAYMENT_FAILED
    claim = op.claims.get(step=CHARGE)
    assert claim.state == ClaimState.FAILED and claim.error == "refused: card_declined"


def test_a_forged_success_for_a_declined_charge__changes_nothing(provider_with_secret, queue):
    """Hole: a signed payment_intent.succeeded for a declined intent moved the failed checkout
    to needs_review. The intent is retrieved first: it is declined, so nothing moves."""
    order, op = order_and_checkout(pm="pm_card_chargeDeclined")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    declined = only_event(provider_with_secret, "payment_intent.payment_failed")
    forged = copy.deepcopy(declined)
    forged.update(id="evt_forged_success", type="payment_intent.succeeded")
    forged["data"]["object"].update(status="succeeded", last_payment_error=None)

    deliver(forged)
    run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert order.status == OrderStatus.PAYMENT_FAILED
    assert op.claims.get(step=CHARGE).state == ClaimState.FAILED
    assert ProviderEvent.objects.get(pk="evt_forged_success").outcome == "already_settled"


def test_a_success_for_a_step_recorded_failed__goes_to_review_with_an_alert(
    provider_with_secret, queue, caplog
):
    """A real contradiction: the provider holds a success for a step recorded failed (a bug
    made the record). The event, checked against the retrieved intent, parks it for review."""
    order, op = order_and_checkout()
    provider_with_secret.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    with fence_writes():  # hand-made state: the bug this test is about
        op.claims.filter(step=CHARGE).update(state=ClaimState.FAILED)
        Operation.objects.filter(pk=op.pk).update(state=OperationState.FAILED)

    deliver(only_event(provider_with_secret, "payment_intent.succeeded"))
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW
    assert "succeeded for a step recorded failed" in op.last_error
    assert op.claims.get(step=CHARGE).state == ClaimState.FAILED  # no claim changed
    alerts = [r for r in caplog.records if r.name == "payments.alerts"]
    assert alerts and alerts[0].levelno == logging.ERROR
    event_id = only_event(provider_with_secret, "payment_intent.succeeded")["id"]
    assert ProviderEvent.objects.get(pk=event_id).outcome == "needs_review"


def test_a_forged_success_naming_no_real_intent__settles_nothing(
    provider_with_secret, queue, caplog
):
    """Hole: with the signing secret leaked, a payment_intent.succeeded naming an intent the
    provider never made, with an in-flight charge's metadata, settled that uncertain charge as
    done with the made-up reference. Retrieved by id, it does not exist: nothing moves."""
    order, op = uncertain_checkout(provider_with_secret, queue, pm="pm_card_chargeDeclined")
    real = only_event(provider_with_secret, "payment_intent.payment_failed")
    forged = copy.deepcopy(real)
    forged.update(id="evt_forged", type="payment_intent.succeeded")
    forged["data"]["object"].update(id="pi_made_up", status="succeeded", last_payment_error=None)

    deliver(forged)
    run_worker(queue)

    assert ProviderEvent.objects.get(pk="evt_forged").outcome == "unknown_object"
    claim = op.claims.get(step=CHARGE)
    assert claim.state == ClaimState.UNCERTAIN and claim.provider_reference != "pi_made_up"
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    assert order.status == OrderStatus.PROCESSING
    assert "pi_made_up" in caplog.text  # an alert names it


def test_a_second_success_for_a_done_step__is_alerted_and_changes_no_claim(
    provider_with_secret, queue, caplog
):
    """A second real intent carrying a done step's metadata (made outside the fence): its
    event is a double charge alert; the done claim keeps its reference."""
    order, op = order_and_checkout()
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    claim = op.claims.get(step=CHARGE)
    client = make_client(provider_with_secret)
    second = client.create_payment_intent(
        amount=claim.request["amount"],
        currency=claim.request["currency"],
        payment_method="pm_card_visa",
        metadata=claim.request["metadata"],
        idempotency_key="outside-the-fence",
    )
    client.close()
    event = next(
        e
        for e in provider_with_secret.state.events(type="payment_intent.succeeded")
        if e["data"]["object"]["id"] == second.id
    )

    deliver(event)
    run_worker(queue)

    assert ProviderEvent.objects.get(pk=event["id"]).outcome == "alerted"
    assert op.claims.get(step=CHARGE).provider_reference == claim.provider_reference
    assert "double charge" in caplog.text
    assert any(r.name == "payments.alerts" for r in caplog.records)


def test_a_success_no_claim_fences__is_an_unfenced_charge_alert(provider_with_secret, caplog):
    client = make_client(provider_with_secret)
    client.create_payment_intent(
        amount=700,
        currency="eur",
        payment_method="pm_card_visa",
        metadata={"note": "made outside the fence"},
        idempotency_key="outside-1",
    )
    client.close()
    event = only_event(provider_with_secret, "payment_intent.succeeded")
    deliver(event)

    assert handle_event(event["id"], actor=ACTOR) == "unfenced"

    alerts = [r for r in caplog.records if r.name == "payments.alerts"]
    assert alerts and alerts[0].levelno == logging.ERROR
    assert "unfenced charge" in alerts[0].getMessage()


# --- a live owner is left alone; a gone one is not ----------------------------------------


def claimed_by_a_live_worker(provider, *, lease: int) -> tuple[Operation, dict]:
    """A worker claimed the charge and called the provider; its answer is not recorded yet."""
    order, op = order_and_checkout()
    effect = charge_effect(op)
    claim = fence.claim_step(
        op, CHARGE, owner="worker-alive", lease_seconds=lease, request=effect.build_request()
    ).claim
    effect.perform(claim.request, claim.idempotency_key)  # charged at the provider
    event = only_event(provider, "payment_intent.succeeded")
    deliver(event)
    return op, event


def test_a_claim_with_a_live_owner__is_left_alone_until_it_lets_go(provider_with_secret, queue):
    op, event = claimed_by_a_live_worker(provider_with_secret, lease=60)

    assert handle_event(event["id"], actor=ACTOR) == "busy"

    claim = op.claims.get(step=CHARGE)
    assert (claim.state, claim.claimed_by) == (ClaimState.CLAIMED, "worker-alive")
    assert not InboxEntry.objects.filter(consumer=CONSUMER).exists()  # rolled back: comes again
    row = ProviderEvent.objects.get()
    assert (row.handled_at, row.outcome) == (None, "busy")

    fence.release_claim(claim, actor="worker-alive", reason="connection reset")  # it let go
    assert handle_event(event["id"], actor=ACTOR) == "done"
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert provider_with_secret.state.succeeded_count() == 1


def test_a_claim_whose_owner_is_gone__is_settled(provider_with_secret, queue):
    op, event = claimed_by_a_live_worker(provider_with_secret, lease=1)
    time.sleep(1.2)  # the owner's lease ran out (it died mid-call)

    assert handle_event(event["id"], actor=ACTOR) == "done"

    claim = op.claims.get(step=CHARGE)
    assert claim.state == ClaimState.DONE
    assert op.events.filter(step=CHARGE, to_state=ClaimState.UNCERTAIN).exists()  # taken over
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED


# --- refunds ----------------------------------------------------------------------------


def test_refund_events__settle_an_uncertain_refund(provider_with_secret, queue):
    order, checkout_op = order_and_checkout()
    run_worker(queue)
    refund, _ = request_refund(order_id=order.pk, key="refund-1", amount=500, actor="t")
    provider_with_secret.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    refund.refresh_from_db()
    assert refund.state == OperationState.UNCERTAIN

    deliver(only_event(provider_with_secret, "refund.created"))
    deliver(only_event(provider_with_secret, "charge.refunded"))
    run_worker(queue)

    refund.refresh_from_db()
    assert refund.state == OperationState.SUCCEEDED
    assert CreditNote.objects.get().amount == 500
    # Whichever of the two runs first settles the claim (events go to the front of the
    # queue, the last one queued first); the other finds it settled.
    outcomes = dict(ProviderEvent.objects.values_list("type", "outcome"))
    assert sorted(outcomes.values()) == ["already_settled", "done"]
    assert len(provider_with_secret.state.refunds()) == 1


# --- catch-up ---------------------------------------------------------------------------


def test_sync_provider_events__catches_up_a_missed_event(
    provider_with_secret, queue, caplog, no_reconciler
):
    """The endpoint was down: the event is only listed at the provider."""
    order, op = uncertain_checkout(provider_with_secret, queue)
    assert ProviderEvent.objects.count() == 0
    out = StringIO()

    call_command("sync_provider_events", "--since", "1h", stdout=out)
    run_worker(queue)

    assert "1 listed, 1 missed and now stored" in out.getvalue()
    assert "1 done" in out.getvalue()
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert ProviderEvent.objects.get().outcome == "done"

    caplog.set_level(logging.INFO, logger="inbox")
    again = StringIO()
    call_command("sync_provider_events", "--since", "1h", stdout=again)
    assert "0 missed and now stored" in again.getvalue() and "1 duplicate" in again.getvalue()
    assert any(m.startswith("Skipping message evt_") for m in caplog.messages)
    assert provider_with_secret.state.succeeded_count() == 1


def test_sync_provider_events__handles_a_stored_event_whose_job_was_lost(
    provider_with_secret, queue, redis_conn
):
    order, op = uncertain_checkout(provider_with_secret, queue)
    deliver(only_event(provider_with_secret, "payment_intent.succeeded"))
    redis_conn.flushdb()  # the job is lost with Redis

    call_command("sync_provider_events", stdout=StringIO())
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED


def test_sync_provider_events__refuses_a_bad_window():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="duration"):
        call_command("sync_provider_events", "--since", "24")


# --- the desk -----------------------------------------------------------------------------


def test_the_operation_page__lists_the_events_that_touched_it(provider_with_secret, queue):
    order, op = uncertain_checkout(provider_with_secret, queue)
    event = only_event(provider_with_secret, "payment_intent.succeeded")
    deliver(event)
    run_worker(queue)

    page = client_for(make_user("viewer", *VIEW)).get(f"/admin/payments/operation/{op.pk}/change/")

    assert page.status_code == 200
    html = page.content.decode()
    assert "Provider events" in html
    assert event["id"] in html and "payment_intent.succeeded" in html


# --- an order's attempts share its PaymentIntent --------------------------------------


def test_the_first_attempts_late_decline__never_fails_the_next_attempt(
    provider_with_secret, queue, settings
):
    """Review: attempt 1's decline event, handled after attempt 2 (a good card) had been
    claimed but not yet sent (a 429), failed attempt 2 on the intent's leftover
    requires_payment_method; the good card was never tried."""
    settings.PAYMENTS = {**settings.PAYMENTS, "RETRY_BACKOFF": [120, 120]}
    order, first = order_and_checkout(pm="pm_card_chargeDeclined")
    run_worker(queue)
    [decline] = provider_with_secret.state.events(type="payment_intent.payment_failed")
    provider_with_secret.state.enqueue_faults("rate_limit", 1)
    second, _ = request_checkout(
        order_id=order.pk, key="attempt-2", payment_method="pm_card_visa", actor="api"
    )
    run_worker(queue)
    claim = second.claims.get(step=CHARGE)
    assert claim.request["payment_intent"] == first.claims.get(step=CHARGE).provider_reference
    assert claim.state == ClaimState.CLAIMED  # released after the 429, waiting for its retry

    deliver(decline)
    run_worker(queue)

    claim.refresh_from_db()
    assert claim.state == ClaimState.CLAIMED
    assert ProviderEvent.objects.get(pk=decline["id"]).outcome == "pending"
    order.refresh_from_db()
    assert order.status == OrderStatus.PROCESSING


def test_an_event_settling_a_charge__its_rows_carry_the_retrieve_it_was_decided_by(
    provider_with_secret, queue
):
    """The event's object is retrieved by id before it settles anything: that GET, its
    status and request id, are on the first row the event's job writes (taking the claim
    over), as a worker's call is on its own."""
    order, op = uncertain_checkout(provider_with_secret, queue)
    event = only_event(provider_with_secret, "payment_intent.succeeded")

    deliver(event)
    run_worker(queue)  # the event's job, then the resumed operation

    (settled,) = op.events.filter(step=CHARGE, to_state=ClaimState.DONE)
    assert event["id"] in settled.reason
    by_the_event = op.events.filter(actor=settled.actor).exclude(requests=None)
    (retrieve,) = [sent for row in by_the_event for sent in row.requests]
    intent_id = event["data"]["object"]["id"]
    assert (retrieve["method"], retrieve["path"], retrieve["status"]) == (
        "GET", f"/v1/payment_intents/{intent_id}", 200,
    )  # fmt: skip
    assert retrieve["request_id"].startswith("req_")


def test_sync_provider_events__no_handler_calls_the_provider__reads_nothing_exit_0(
    monkeypatch, settings
):
    """An outsider's catch: a project whose handlers call no payment provider (docs/
    install.md) got "sync failed: ... could not connect" from every scheduled run."""
    from payments.engine import handlers, systems

    monkeypatch.setattr(
        handlers,
        "_HANDLERS",
        {
            kind: spec
            for kind, spec in handlers._HANDLERS.items()
            if systems.DEFAULT_SYSTEM
            not in {systems.system_of(e).name for e in spec.effects.values()}
        },
    )
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": "http://127.0.0.1:9"}
    out = StringIO()

    call_command("sync_provider_events", "--since", "1h", stdout=out)

    assert "No registered handler calls the provider: no events to read." in out.getvalue()
