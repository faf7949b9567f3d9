"""The fake provider's events: Stripe-signed webhooks (checked by the official SDK), retries,
faults, and the `GET /v1/events` list the catch-up reads.
"""

from __future__ import annotations

import time

import pytest
import requests
import stripe

from devtools.fake_provider.server import FakeProviderServer
from tests.support.provider import make_client
from tests.webhooks.conftest import SECRET


def charge(server: FakeProviderServer, step: str, pm: str = "pm_card_visa", fault: str = ""):
    if fault:
        server.state.enqueue_faults(fault)
    client = make_client(server)
    try:
        return client.create_payment_intent(
            amount=2500,
            currency="eur",
            payment_method=pm,
            metadata={"operation_key": f"op-{step}", "step": "charge"},
            idempotency_key=f"key-{step}",
        )
    finally:
        client.close()


# --- signatures, as the official Stripe SDK checks them --------------------------------


def test_sdk_construct_event__accepts_the_fakes_signed_events(hooked, receiver):
    intent = charge(hooked, "sdk")
    (delivery,) = receiver.wait_for(1)

    event = stripe.Webhook.construct_event(
        delivery.body, delivery.headers["Stripe-Signature"], SECRET
    )

    assert event.type == "payment_intent.succeeded"
    assert event.data.object.id == intent.id and event.data.object.status == "succeeded"
    assert event.data.object.metadata["operation_key"] == "op-sdk"
    assert delivery.headers["Content-Type"].startswith("application/json")


def test_sdk_construct_event__rejects_a_tampered_event_and_a_wrong_secret(hooked, receiver):
    charge(hooked, "tamper")
    (delivery,) = receiver.wait_for(1)
    header = delivery.headers["Stripe-Signature"]
    tampered = delivery.body.replace(b'"amount":2500', b'"amount":1')
    assert tampered != delivery.body

    with pytest.raises(stripe.SignatureVerificationError):
        stripe.Webhook.construct_event(tampered, header, SECRET)
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.Webhook.construct_event(delivery.body, header, "whsec_someone_else")


def test_decline_and_refund__emit_their_events(hooked, receiver):
    with pytest.raises(Exception):  # noqa: B017 (the client's CardDeclined)
        charge(hooked, "declined", pm="pm_card_chargeDeclined")
    paid = charge(hooked, "paid")
    client = make_client(hooked)
    refund = client.create_refund(
        payment_intent=paid.id, amount=500, metadata={"step": "refund"}, idempotency_key="r-1"
    )
    client.close()

    deliveries = receiver.wait_for(4)

    events = hooked.state.events()
    assert [e["type"] for e in events] == [
        "payment_intent.payment_failed",
        "payment_intent.succeeded",
        "refund.created",
        "charge.refunded",
    ]
    assert {d.event["id"] for d in deliveries} == {e["id"] for e in events}
    assert events[2]["data"]["object"]["id"] == refund.id
    charge_obj = events[3]["data"]["object"]
    assert (charge_obj["object"], charge_obj["amount_refunded"]) == ("charge", 500)
    assert [r["id"] for r in charge_obj["refunds"]["data"]] == [refund.id]


def test_an_idempotent_replay__emits_no_second_event(hooked, receiver):
    charge(hooked, "replay")
    charge(hooked, "replay")

    assert hooked.webhooks.wait_idle()
    assert [e["type"] for e in hooked.state.events()] == ["payment_intent.succeeded"]
    assert len(receiver.deliveries) == 1


def test_an_event_is_sent_while_the_charges_own_answer_is_dropped(hooked, receiver):
    from payments.provider.errors import UncertainProviderError

    with pytest.raises(UncertainProviderError):
        charge(hooked, "dropped", fault="drop_after_accept")

    (delivery,) = receiver.wait_for(1)
    assert delivery.event["type"] == "payment_intent.succeeded"
    assert delivery.event["data"]["object"]["metadata"]["operation_key"] == "op-dropped"


# --- delivery: retries, faults ----------------------------------------------------------


def test_retried_with_backoff_until_a_2xx__each_attempt_signed_afresh(hooked, receiver):
    receiver.statuses.extend([500, 503])
    charge(hooked, "retry")

    deliveries = receiver.wait_for(3)

    assert hooked.webhooks.wait_idle()
    assert len({d.event["id"] for d in deliveries}) == 1
    for d in deliveries:  # every attempt verifies on its own
        stripe.Webhook.construct_event(d.body, d.headers["Stripe-Signature"], SECRET)
    stats = hooked.webhooks.stats()
    assert (stats["attempts"], stats["failed_attempts"], stats["delivered"]) == (3, 2, 1)


def test_gives_up_after_max_attempts(hooked, receiver):
    hooked.webhooks.configure(max_attempts=2)
    receiver.statuses.extend([500] * 5)
    charge(hooked, "give-up")

    receiver.wait_for(2)
    assert hooked.webhooks.wait_idle()
    assert hooked.webhooks.stats()["gave_up"] == 1
    assert len(receiver.deliveries) == 2


def test_faults__duplicate_reorder_and_delay(hooked, receiver):
    hooked.webhooks.enqueue_faults("duplicate")
    first = charge(hooked, "dup")
    dup = receiver.wait_for(2)
    assert [d.event["data"]["object"]["id"] for d in dup] == [first.id, first.id]
    assert dup[0].event["id"] == dup[1].event["id"]

    hooked.webhooks.enqueue_faults("reorder")
    older = charge(hooked, "older")
    newer = charge(hooked, "newer")
    got = receiver.wait_for(4)
    assert [d.event["data"]["object"]["id"] for d in got[2:]] == [newer.id, older.id]

    hooked.webhooks.configure(delay=0.5)
    hooked.webhooks.enqueue_faults("delay")
    started = time.monotonic()
    charge(hooked, "late")
    receiver.wait_for(5)
    assert time.monotonic() - started >= 0.45


def test_control_api__webhook_faults_and_stats(hooked, receiver):
    answer = requests.post(
        f"{hooked.url}/_fake/webhooks", json={"fault": "duplicate", "count": 2}, timeout=5
    )
    assert answer.status_code == 200 and answer.json()["faults_queued"] == ["duplicate"] * 2
    bad = requests.post(f"{hooked.url}/_fake/webhooks", json={"fault": "explode"}, timeout=5)
    assert bad.status_code == 400
    charge(hooked, "ctl")
    receiver.wait_for(2)
    assert hooked.webhooks.wait_idle()
    stats = requests.get(f"{hooked.url}/_fake/webhooks", timeout=5).json()
    assert (stats["events"], stats["duplicated"], stats["delivered"]) == (1, 1, 2)


def test_without_a_webhook_url__events_are_only_listed(fake_provider):
    charge(fake_provider, "quiet")
    assert fake_provider.webhooks is None
    assert requests.get(f"{fake_provider.url}/_fake/webhooks", timeout=5).status_code == 404
    assert len(fake_provider.state.events()) == 1


def test_webhook_url_needs_a_secret():
    with pytest.raises(ValueError, match="both"):
        FakeProviderServer(webhook_url="http://127.0.0.1:1/hooks")


# --- the list ----------------------------------------------------------------------------


def test_list_events__paginated_newest_first_with_created_filter(fake_provider):
    for n in range(5):
        charge(fake_provider, f"list-{n}")
    client = make_client(fake_provider)

    listed = list(client.list_events(limit=2))
    recent = list(client.list_events(created_gte=int(time.time()) + 3600))

    ids = [e["id"] for e in fake_provider.state.events()]
    assert [e.id for e in listed] == ids[::-1]
    assert {e.type for e in listed} == {"payment_intent.succeeded"}
    assert recent == []
    page = requests.get(
        f"{fake_provider.url}/v1/events",
        params={"limit": 2},
        headers={"Authorization": "Bearer sk_test_x"},
        timeout=5,
    ).json()
    assert page["has_more"] is True and len(page["data"]) == 2
    client.close()


def test_list_events__with_the_official_sdk(fake_provider):
    charge(fake_provider, "sdk-list")
    sdk = stripe.StripeClient(
        "sk_test_sdk", base_addresses={"api": fake_provider.url}, max_network_retries=0
    )
    events = list(sdk.v1.events.list({"limit": 1}).auto_paging_iter())
    assert [e.type for e in events] == ["payment_intent.succeeded"]


def test_sdk_construct_event__accepts_the_manual_capture_events_as_delivered(hooked, receiver):
    client = make_client(hooked)
    try:
        held = client.create_payment_intent(
            amount=2500,
            currency="eur",
            payment_method="pm_card_visa",
            metadata={"operation_key": "op-held", "step": "charge"},
            idempotency_key="key-held",
            capture_method="manual",
        )
        client.capture_payment_intent(held.id, idempotency_key="key-capture", amount_to_capture=900)
    finally:
        client.close()
    deliveries = receiver.wait_for(2)

    events = [
        stripe.Webhook.construct_event(d.body, d.headers["Stripe-Signature"], SECRET)
        for d in deliveries
    ]

    by_type = {event.type: event.data.object for event in events}
    authorised = by_type["payment_intent.amount_capturable_updated"]
    captured = by_type["payment_intent.succeeded"]
    assert (authorised.id, authorised.status, authorised.amount_capturable) == (
        held.id,
        "requires_capture",
        2500,
    )
    assert (captured.id, captured.amount_received, captured.amount_capturable) == (
        held.id,
        900,
        0,
    )
