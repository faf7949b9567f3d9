"""The official Stripe Python SDK works against the fake provider unchanged.

If the SDK can talk to the fake, the fake speaks enough real Stripe for our
own client's assumptions to be worth something. Network retries are off, so
every SDK call is exactly one HTTP request and the fake's counts stay exact.
"""

from __future__ import annotations

import pytest
import stripe

from devtools.fake_provider.server import FakeProviderServer

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
