"""The official Stripe Python SDK works against the fake provider unchanged.

If the SDK can talk to the fake, the fake speaks enough real Stripe for our
own client's assumptions to be worth something. Network retries are off, so
every SDK call is exactly one HTTP request and the fake's counts stay exact.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import stripe

from devtools.fake_provider.server import FakeProviderServer
from devtools.fake_provider.webhooks import sign
from tests.support.provider import FakeClock

API_KEY = "sk_test_sdk"


@pytest.fixture
def sdk(fake_provider: FakeProviderServer) -> stripe.StripeClient:
    """A StripeClient pointed at the fake, with no retries and short timeouts."""
    return stripe.StripeClient(
        API_KEY,
        base_addresses={"api": fake_provider.url},
        max_network_retries=0,
        http_client=stripe.RequestsClient(timeout=5),
    )


def charge_params(step: str, payment_method: str = "pm_card_visa") -> dict:
    return {
        "amount": 2500,
        "currency": "eur",
        "confirm": True,
        "payment_method": payment_method,
        "metadata": {"step": step, "order": "42"},
    }


def test_create__with_idempotency_key_replays(sdk, fake_provider):
    options = {"idempotency_key": "checkout:order:42:charge"}
    created = sdk.v1.payment_intents.create(charge_params("charge"), options)
    again = sdk.v1.payment_intents.create(charge_params("charge"), options)
    assert created.id.startswith("pi_") and created.status == "succeeded"
    assert (created.amount, created.currency, created.metadata["step"]) == (2500, "eur", "charge")
    assert again.id == created.id
    assert again.last_response.headers["Idempotent-Replayed"] == "true"
    assert fake_provider.state.succeeded_count() == 1


def test_retrieve__with_expand_params(sdk):
    created = sdk.v1.payment_intents.create(charge_params("retrieve"))
    fetched = sdk.v1.payment_intents.retrieve(created.id, {"expand": ["payment_method"]})
    assert (fetched.id, fetched.status) == (created.id, "succeeded")
    with pytest.raises(stripe.InvalidRequestError) as info:
        sdk.v1.payment_intents.retrieve("pi_missing")
    assert info.value.code == "resource_missing" and info.value.http_status == 404


def test_every_answer__the_sdk_reads_its_request_id(sdk):
    created = sdk.v1.payment_intents.create(charge_params("request-id"))
    fetched = sdk.v1.payment_intents.retrieve(created.id)
    listed = sdk.v1.payment_intents.list({"limit": 1})
    with pytest.raises(stripe.InvalidRequestError) as info:
        sdk.v1.payment_intents.retrieve("pi_missing")

    ids = [r.last_response.request_id for r in (created, fetched, listed)]
    ids.append(info.value.request_id)
    assert all(re.fullmatch(r"req_[A-Za-z0-9]{14}", i or "") for i in ids), ids
    assert len(set(ids)) == 4  # one per answer, as Stripe's
    assert created.last_response.code == 200 and info.value.http_status == 404


def test_search__by_metadata(sdk):
    wanted = sdk.v1.payment_intents.create(charge_params("search-me"))
    sdk.v1.payment_intents.create(charge_params("other"))
    found = sdk.v1.payment_intents.search({"query": "metadata['step']:'search-me'"})
    assert [pi.id for pi in found.auto_paging_iter()] == [wanted.id]


def test_list__auto_paging_walks_every_page(sdk):
    ids = {sdk.v1.payment_intents.create(charge_params(f"list-{n}")).id for n in range(5)}
    page = sdk.v1.payment_intents.list({"limit": 2})
    assert page.has_more is True and len(page.data) == 2
    assert {pi.id for pi in page.auto_paging_iter()} == ids


def test_decline__raises_card_error(sdk, fake_provider):
    with pytest.raises(stripe.CardError) as info:
        sdk.v1.payment_intents.create(
            charge_params("decline", payment_method="pm_card_chargeDeclined"),
            {"idempotency_key": "decline-1"},
        )
    error = info.value
    assert (error.code, error.http_status) == ("card_declined", 402)
    assert error.error.decline_code == "generic_decline"
    assert error.error.payment_intent.id == fake_provider.state.intents()[0]["id"]


def test_key_reuse_with_other_params__raises_idempotency_error(sdk):
    options = {"idempotency_key": "reuse-1"}
    sdk.v1.payment_intents.create(charge_params("reuse"), options)
    with pytest.raises(stripe.IdempotencyError):
        sdk.v1.payment_intents.create({**charge_params("reuse"), "amount": 9999}, options)


def test_wrong_key__raises_authentication_error(fake_provider):
    fake_provider.state.configure(api_key="sk_test_right")
    client = stripe.StripeClient(
        "sk_test_wrong", base_addresses={"api": fake_provider.url}, max_network_retries=0
    )
    with pytest.raises(stripe.AuthenticationError):
        client.v1.payment_intents.list()


def test_global_api__create_and_retrieve(fake_provider, monkeypatch):
    # The module-level API reads globals; monkeypatch restores them afterwards.
    monkeypatch.setattr(stripe, "api_key", API_KEY)
    monkeypatch.setattr(stripe, "api_base", fake_provider.url)
    monkeypatch.setattr(stripe, "max_network_retries", 0)
    created = stripe.PaymentIntent.create(**charge_params("global"), idempotency_key="global-1")
    assert stripe.PaymentIntent.retrieve(created.id).status == "succeeded"
    assert fake_provider.state.succeeded_count() == 1


# --- refunds ---------------------------------------------------------------------------


@pytest.fixture
def global_api(fake_provider, monkeypatch) -> FakeProviderServer:
    """The module-level API pointed at the fake; monkeypatch restores the globals."""
    monkeypatch.setattr(stripe, "api_key", API_KEY)
    monkeypatch.setattr(stripe, "api_base", fake_provider.url)
    monkeypatch.setattr(stripe, "max_network_retries", 0)
    return fake_provider


def test_refund__global_create_replay_retrieve_and_list(global_api):
    pi = stripe.PaymentIntent.create(**charge_params("refund"), idempotency_key="refund-pi")
    part = stripe.Refund.create(
        payment_intent=pi.id,
        amount=1000,
        reason="requested_by_customer",
        metadata={"step": "refund-1"},
        idempotency_key="refund-1",
    )
    assert part.id.startswith("re_") and part.object == "refund"
    assert (part.amount, part.currency, part.status) == (1000, "eur", "succeeded")
    assert (part.payment_intent, part.reason, part.metadata["step"]) == (
        pi.id,
        "requested_by_customer",
        "refund-1",
    )
    again = stripe.Refund.create(
        payment_intent=pi.id,
        amount=1000,
        reason="requested_by_customer",
        metadata={"step": "refund-1"},
        idempotency_key="refund-1",
    )
    assert again.id == part.id
    assert again.last_response.headers["Idempotent-Replayed"] == "true"
    rest = stripe.Refund.create(payment_intent=pi.id, idempotency_key="refund-2")
    assert rest.amount == 1500 and rest.reason is None
    fetched = stripe.Refund.retrieve(rest.id)
    assert (fetched.id, fetched.amount, fetched.status) == (rest.id, 1500, "succeeded")
    listed = stripe.Refund.list(payment_intent=pi.id, limit=1)
    assert listed.has_more is True and len(listed.data) == 1
    assert {r.id for r in listed.auto_paging_iter()} == {part.id, rest.id}
    assert len(global_api.state.refunds(payment_intent=pi.id)) == 2


def test_refund__refusals_raise_invalid_request_with_stripe_codes(sdk):
    pi = sdk.v1.payment_intents.create(charge_params("refusals"))
    with pytest.raises(stripe.InvalidRequestError) as too_much:
        sdk.v1.refunds.create({"payment_intent": pi.id, "amount": 2501})
    assert (too_much.value.code, too_much.value.param) == ("amount_too_large", "amount")
    assert too_much.value.http_status == 400
    sdk.v1.refunds.create({"payment_intent": pi.id})
    with pytest.raises(stripe.InvalidRequestError) as twice:
        sdk.v1.refunds.create({"payment_intent": pi.id})
    assert twice.value.code == "charge_already_refunded"
    with pytest.raises(stripe.CardError) as declined:
        sdk.v1.payment_intents.create(charge_params("declined", "pm_card_chargeDeclined"))
    declined_id = declined.value.error.payment_intent.id
    with pytest.raises(stripe.InvalidRequestError) as unpaid:
        sdk.v1.refunds.create({"payment_intent": declined_id})
    assert unpaid.value.code == "payment_intent_unexpected_state"
    assert "does not have a successful charge to refund" in unpaid.value.user_message


def test_refund__retrieve_missing_and_key_conflict(sdk):
    with pytest.raises(stripe.InvalidRequestError) as missing:
        sdk.v1.refunds.retrieve("re_missing")
    assert (missing.value.code, missing.value.http_status) == ("resource_missing", 404)
    pi = sdk.v1.payment_intents.create(charge_params("refund-conflict"))
    options = {"idempotency_key": "refund-reuse"}
    sdk.v1.refunds.create({"payment_intent": pi.id, "amount": 100}, options)
    with pytest.raises(stripe.IdempotencyError):
        sdk.v1.refunds.create({"payment_intent": pi.id, "amount": 200}, options)


# --- confirm, cancel, created windows, refund failures ------------------------------------


def test_confirm__declined_intent_succeeds_with_a_good_card(global_api):
    with pytest.raises(stripe.CardError) as declined:
        stripe.PaymentIntent.create(**charge_params("confirm", "pm_card_chargeDeclined"))
    pi_id = declined.value.error.payment_intent.id
    failed = stripe.PaymentIntent.retrieve(pi_id)
    assert failed.status == "requires_payment_method" and failed.payment_method is None
    assert failed.last_payment_error.payment_method.id == "pm_card_chargeDeclined"
    confirmed = stripe.PaymentIntent.confirm(
        pi_id, payment_method="pm_card_visa", idempotency_key="confirm-1"
    )
    assert (confirmed.id, confirmed.status, confirmed.amount_received) == (pi_id, "succeeded", 2500)
    again = stripe.PaymentIntent.confirm(
        pi_id, payment_method="pm_card_visa", idempotency_key="confirm-1"
    )
    assert again.last_response.headers["Idempotent-Replayed"] == "true"
    assert global_api.state.succeeded_count() == 1


def test_confirm__succeeded_intent_raises_unexpected_state_with_the_intent(global_api):
    pi = stripe.PaymentIntent.create(**charge_params("confirm-twice"))
    with pytest.raises(stripe.InvalidRequestError) as info:
        stripe.PaymentIntent.confirm(pi.id, payment_method="pm_card_visa")
    error = info.value
    assert (error.http_status, error.code) == (400, "payment_intent_unexpected_state")
    assert error.error.payment_intent.id == pi.id
    assert error.error.payment_intent.status == "succeeded"
    assert "has a status of succeeded" in error.user_message


def test_cancel__then_confirm_raises_unexpected_state(global_api):
    pi = stripe.PaymentIntent.create(**{**charge_params("cancel"), "confirm": False})
    assert pi.status == "requires_confirmation"
    canceled = stripe.PaymentIntent.cancel(pi.id, cancellation_reason="requested_by_customer")
    assert (canceled.status, canceled.cancellation_reason) == ("canceled", "requested_by_customer")
    assert isinstance(canceled.canceled_at, int)
    with pytest.raises(stripe.InvalidRequestError) as confirm:
        stripe.PaymentIntent.confirm(pi.id)
    assert confirm.value.code == "payment_intent_unexpected_state"
    assert confirm.value.error.payment_intent.status == "canceled"
    succeeded = stripe.PaymentIntent.create(**charge_params("cancel-paid"))
    with pytest.raises(stripe.InvalidRequestError) as cancel:
        stripe.PaymentIntent.cancel(succeeded.id)
    assert cancel.value.code == "payment_intent_unexpected_state"
    assert cancel.value.error.payment_intent.id == succeeded.id


def test_cancel__with_the_client_api(sdk):
    pi = sdk.v1.payment_intents.create({**charge_params("client-cancel"), "confirm": False})
    canceled = sdk.v1.payment_intents.cancel(pi.id, {"cancellation_reason": "abandoned"})
    assert canceled.status == "canceled"
    confirmed = sdk.v1.payment_intents.create({**charge_params("client-confirm"), "confirm": False})
    assert sdk.v1.payment_intents.confirm(confirmed.id).status == "succeeded"


def test_list__created_window_with_auto_paging():
    clock = FakeClock()
    with FakeProviderServer(clock=clock) as server:
        client = stripe.StripeClient(
            API_KEY, base_addresses={"api": server.url}, max_network_retries=0
        )
        start = int(clock.now)
        ids = []
        for n in range(5):
            ids.append(client.v1.payment_intents.create(charge_params(f"window-{n}")).id)
            clock.advance(10)
        window = client.v1.payment_intents.list(
            {"created": {"gte": start + 10, "lte": start + 30}, "limit": 1}
        )
        assert window.has_more is True
        assert [pi.id for pi in window.auto_paging_iter()] == ids[1:4][::-1]


def test_refund_list__created_window_with_auto_paging():
    """The audit lists a window's refunds in one listing: `created[gte|lte]` as at Stripe."""
    clock = FakeClock()
    with FakeProviderServer(clock=clock) as server:
        client = stripe.StripeClient(
            API_KEY, base_addresses={"api": server.url}, max_network_retries=0
        )
        start = int(clock.now)
        ids = []
        for n in range(5):
            pi = client.v1.payment_intents.create(charge_params(f"refund-window-{n}"))
            ids.append(client.v1.refunds.create({"payment_intent": pi.id, "amount": 100}).id)
            clock.advance(10)
        window = client.v1.refunds.list(
            {"created": {"gte": start + 10, "lte": start + 30}, "limit": 1}
        )
        assert window.has_more is True
        assert [r.id for r in window.auto_paging_iter()] == ids[1:4][::-1]


def test_list__created_window_with_the_global_api(global_api):
    pi = stripe.PaymentIntent.create(**charge_params("global-window"))
    listed = stripe.PaymentIntent.list(created={"lte": pi.created, "gte": pi.created}, limit=1)
    assert [p.id for p in listed.auto_paging_iter()] == [pi.id]
    later = stripe.PaymentIntent.list(created={"gt": pi.created})
    assert list(later.auto_paging_iter()) == []


def test_refund__failed_after_success_is_retrieved_failed_with_its_reason(global_api):
    pi = stripe.PaymentIntent.create(**charge_params("refund-fails"))
    made = stripe.Refund.create(payment_intent=pi.id, amount=1000)
    assert (made.status, made.failure_reason) == ("succeeded", None)
    global_api.state.fail_refund(made.id)
    fetched = stripe.Refund.retrieve(made.id)
    assert (fetched.status, fetched.failure_reason) == ("failed", "lost_or_stolen_card")
    assert fetched.failure_balance_transaction.startswith("txn_")
    # The amount is back on the charge.
    assert stripe.Refund.create(payment_intent=pi.id).amount == 2500


def test_refund_failed_event__signed_as_the_fake_sends_it_passes_construct_event(global_api):
    pi = stripe.PaymentIntent.create(**charge_params("refund-failed-event"))
    made = stripe.Refund.create(payment_intent=pi.id)
    global_api.state.fail_refund(made.id, reason="expired_or_canceled_card")
    [raw] = global_api.state.events(type="refund.failed")
    # The webhook sender's own encoding and signature.
    payload = json.dumps(raw, separators=(",", ":")).encode()
    header = sign(payload, "whsec_sdk", int(time.time()))
    event = stripe.Webhook.construct_event(payload, header, "whsec_sdk")
    assert (event.type, event.data.object.id) == ("refund.failed", made.id)
    assert event.data.object.failure_reason == "expired_or_canceled_card"


# --- manual capture: authorise now, capture (or release) later ---------------------------


def hold_params(step: str) -> dict:
    return {**charge_params(step), "capture_method": "manual"}


def test_manual_capture__create_holds_the_amount_uncaptured(sdk, fake_provider):
    held = sdk.v1.payment_intents.create(hold_params("hold"))
    assert (held.status, held.capture_method) == ("requires_capture", "manual")
    assert (held.amount_capturable, held.amount_received) == (2500, 0)
    assert fake_provider.state.succeeded_count() == 0
    paid = sdk.v1.payment_intents.create(charge_params("automatic"))
    assert (paid.capture_method, paid.amount_capturable, paid.amount_received) == (
        "automatic",
        0,
        2500,
    )


def test_manual_capture__unknown_capture_method_is_refused(sdk):
    with pytest.raises(stripe.InvalidRequestError) as info:
        sdk.v1.payment_intents.create({**charge_params("odd"), "capture_method": "later"})
    assert (info.value.http_status, info.value.param) == (400, "capture_method")


def test_manual_capture__full_capture_succeeds_and_replays_under_its_key(sdk, fake_provider):
    held = sdk.v1.payment_intents.create(hold_params("capture-full"))
    options = {"idempotency_key": "capture-1"}
    captured = sdk.v1.payment_intents.capture(held.id, {"metadata": {"shipped": "yes"}}, options)
    assert (captured.id, captured.status) == (held.id, "succeeded")
    assert (captured.amount_received, captured.amount_capturable) == (2500, 0)
    # Stripe merges a metadata update into the intent's metadata.
    assert captured.metadata.to_dict() == {"step": "capture-full", "order": "42", "shipped": "yes"}
    again = sdk.v1.payment_intents.capture(held.id, {"metadata": {"shipped": "yes"}}, options)
    assert again.id == held.id
    assert again.last_response.headers["Idempotent-Replayed"] == "true"
    with pytest.raises(stripe.IdempotencyError):
        sdk.v1.payment_intents.capture(held.id, {"amount_to_capture": 100}, options)
    assert fake_provider.state.succeeded_count() == 1


def test_manual_capture__partial_capture_receives_that_amount_and_releases_the_rest(global_api):
    held = stripe.PaymentIntent.create(**hold_params("capture-part"))
    captured = stripe.PaymentIntent.capture(held.id, amount_to_capture=1000)
    assert captured.status == "succeeded"
    assert (captured.amount, captured.amount_received, captured.amount_capturable) == (
        2500,
        1000,
        0,
    )
    assert stripe.PaymentIntent.retrieve(held.id).amount_received == 1000


def test_manual_capture__of_a_non_capturable_intent_raises_unexpected_state(global_api):
    paid = stripe.PaymentIntent.create(**charge_params("capture-paid"))
    with pytest.raises(stripe.InvalidRequestError) as info:
        stripe.PaymentIntent.capture(paid.id)
    error = info.value
    assert (error.http_status, error.code) == (400, "payment_intent_unexpected_state")
    assert (error.error.payment_intent.id, error.error.payment_intent.status) == (
        paid.id,
        "succeeded",
    )
    held = stripe.PaymentIntent.create(**hold_params("capture-twice"))
    stripe.PaymentIntent.capture(held.id)
    with pytest.raises(stripe.InvalidRequestError) as twice:
        stripe.PaymentIntent.capture(held.id)
    assert twice.value.code == "payment_intent_unexpected_state"
    with pytest.raises(stripe.InvalidRequestError) as missing:
        stripe.PaymentIntent.capture("pi_missing")
    assert (missing.value.http_status, missing.value.code) == (404, "resource_missing")


def test_manual_capture__more_than_the_capturable_amount_is_refused(global_api):
    held = stripe.PaymentIntent.create(**hold_params("capture-too-much"))
    with pytest.raises(stripe.InvalidRequestError) as info:
        stripe.PaymentIntent.capture(held.id, amount_to_capture=2501)
    error = info.value
    assert (error.http_status, error.code, error.param) == (
        400,
        "amount_too_large",
        "amount_to_capture",
    )
    still = stripe.PaymentIntent.retrieve(held.id)
    assert (still.status, still.amount_capturable) == ("requires_capture", 2500)


def test_manual_capture__cancel_releases_the_hold(global_api):
    held = stripe.PaymentIntent.create(**hold_params("release"))
    canceled = stripe.PaymentIntent.cancel(held.id, cancellation_reason="abandoned")
    assert (canceled.status, canceled.amount_capturable, canceled.amount_received) == (
        "canceled",
        0,
        0,
    )
    with pytest.raises(stripe.InvalidRequestError) as info:
        stripe.PaymentIntent.capture(held.id)
    assert info.value.error.payment_intent.status == "canceled"
    assert [e["type"] for e in global_api.state.events()] == [
        "payment_intent.amount_capturable_updated",
        "payment_intent.canceled",
    ]


def test_manual_capture__refunds_reach_only_the_captured_amount(global_api):
    held = stripe.PaymentIntent.create(**hold_params("refund-held"))
    with pytest.raises(stripe.InvalidRequestError) as uncaptured:
        stripe.Refund.create(payment_intent=held.id)
    assert uncaptured.value.code == "payment_intent_unexpected_state"
    stripe.PaymentIntent.capture(held.id, amount_to_capture=1000)
    with pytest.raises(stripe.InvalidRequestError) as too_much:
        stripe.Refund.create(payment_intent=held.id, amount=1001)
    assert (too_much.value.code, too_much.value.param) == ("amount_too_large", "amount")
    assert stripe.Refund.create(payment_intent=held.id).amount == 1000


def test_manual_capture__events_signed_as_the_fake_sends_them_pass_construct_event(global_api):
    held = stripe.PaymentIntent.create(**hold_params("capture-events"))
    stripe.PaymentIntent.capture(held.id, amount_to_capture=2000)
    [authorised] = global_api.state.events(type="payment_intent.amount_capturable_updated")
    [succeeded] = global_api.state.events(type="payment_intent.succeeded")
    events = []
    for raw in (authorised, succeeded):
        payload = json.dumps(raw, separators=(",", ":")).encode()
        header = sign(payload, "whsec_sdk", int(time.time()))
        events.append(stripe.Webhook.construct_event(payload, header, "whsec_sdk"))
    first, second = (event.data.object for event in events)
    assert (first.id, first.status, first.amount_capturable) == (
        held.id,
        "requires_capture",
        2500,
    )
    assert (second.id, second.status, second.amount_received) == (held.id, "succeeded", 2000)
