"""`POST /webhooks/provider`: what it accepts, what it refuses, and that a refusal writes nothing.

Transactional: a stored event enqueues its job after the commit.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import stripe
from django.test import Client

from inbox.models import InboxEntry
from payments.engine.queues import payments_queue
from payments.models import OperationEvent, ProviderEvent, StepClaim
from tests.webhooks.conftest import OLD_SECRET, SECRET, event_about, signed

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/webhooks/provider"


def intent(pi_id: str = "pi_test_1", status: str = "succeeded") -> dict:
    return {
        "id": pi_id,
        "object": "payment_intent",
        "amount": 2500,
        "currency": "eur",
        "status": status,
        "metadata": {"operation_key": "nobody", "step": "charge"},
    }


def post(body: bytes, header: str | None) -> object:
    headers = {"Stripe-Signature": header} if header is not None else {}
    return Client().post(URL, data=body, content_type="application/json", headers=headers)


def nothing_written() -> bool:
    return (
        ProviderEvent.objects.count() == 0
        and InboxEntry.objects.count() == 0
        and OperationEvent.objects.count() == 0
        and StepClaim.objects.count() == 0
        and len(payments_queue()) == 0
    )


@pytest.fixture(autouse=True)
def _setup(hook_settings, redis_conn):
    """The secret configured, the test Redis flushed (the queue must start empty)."""


def test_a_valid_event__is_stored_acknowledged_and_its_job_enqueued():
    body, header = signed(event_about(intent(), "payment_intent.succeeded", "evt_ok"))

    response = post(body, header)

    assert response.status_code == 200
    assert response.json() == {"received": True, "duplicate": False}
    row = ProviderEvent.objects.get()
    assert (row.id, row.type, row.object_id, row.handled_at) == (
        "evt_ok",
        "payment_intent.succeeded",
        "pi_test_1",
        None,
    )
    assert row.payload == json.loads(body)
    (job,) = payments_queue().jobs
    assert job.func_name == "payments.webhooks.jobs.handle_provider_event"
    assert job.args == ("evt_ok",)


def test_a_duplicate_delivery__is_200_and_stored_once():
    body, header = signed(event_about(intent(), "payment_intent.succeeded", "evt_dup"))
    assert post(body, header).status_code == 200

    again = post(*signed(json.loads(body)))

    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert ProviderEvent.objects.count() == 1


def test_an_old_secret__is_accepted_during_a_rotation(hook_settings):
    hook_settings.PAYMENTS = {
        **hook_settings.PAYMENTS,
        "PROVIDER_WEBHOOK_SECRETS": [SECRET, OLD_SECRET],
    }
    body, header = signed(event_about(intent(), "payment_intent.succeeded"), secret=OLD_SECRET)
    assert post(body, header).status_code == 200


def test_a_header_made_by_the_stripe_sdk__is_accepted():
    body = json.dumps(event_about(intent(), "payment_intent.succeeded", "evt_sdk"))
    header = stripe.WebhookSignature.generate_signature_header(body, SECRET)
    assert post(body.encode(), header).status_code == 200


# --- refused: 400, nothing written, a WARNING without the payload -------------------------


def assert_refused(response, caplog, status: int = 400) -> None:
    assert response.status_code == status
    assert nothing_written()
    warnings = [r for r in caplog.records if r.name == "payments.webhooks"]
    assert warnings and all(r.levelno == logging.WARNING for r in warnings)
    text = caplog.text
    assert "pi_test_1" not in text and "2500" not in text and SECRET not in text


@pytest.mark.parametrize(
    "header",
    [None, "", "t=abc,v1=00", "v1=" + "0" * 64, "t=1,t=2,v1=" + "0" * 64],
    ids=["missing", "empty", "malformed", "no-timestamp", "two-timestamps"],
)
def test_a_missing_or_malformed_signature__is_400(header, caplog):
    body, _ = signed(event_about(intent(), "payment_intent.succeeded"))
    assert_refused(post(body, header), caplog)


def test_a_bad_signature__is_400(caplog):
    body, _ = signed(event_about(intent(), "payment_intent.succeeded"))
    _, other = signed(body, secret="whsec_not_ours")
    assert_refused(post(body, other), caplog)


def test_a_tampered_body__is_400(caplog):
    body, header = signed(event_about(intent(), "payment_intent.succeeded"))
    assert_refused(post(body.replace(b"2500", b"2501"), header), caplog)


def test_a_replayed_old_delivery__is_400(caplog):
    """Signed correctly, but 301 s ago: outside the 300 s tolerance."""
    body, header = signed(event_about(intent(), "payment_intent.succeeded"), at=time.time() - 301)
    assert_refused(post(body, header), caplog)
    assert "more than 300 s" in caplog.text


def test_a_timestamp_far_in_the_future__is_400(caplog):
    body, header = signed(event_about(intent(), "payment_intent.succeeded"), at=time.time() + 900)
    assert_refused(post(body, header), caplog)


def test_the_tolerance_is_a_setting(hook_settings):
    hook_settings.PAYMENTS = {**hook_settings.PAYMENTS, "PROVIDER_WEBHOOK_TOLERANCE": 1000}
    body, header = signed(event_about(intent(), "payment_intent.succeeded"), at=time.time() - 900)
    assert post(body, header).status_code == 200


def test_no_secret_configured__refuses_everything(hook_settings, caplog):
    hook_settings.PAYMENTS = {**hook_settings.PAYMENTS, "PROVIDER_WEBHOOK_SECRETS": []}
    body, header = signed(event_about(intent(), "payment_intent.succeeded"))
    assert_refused(post(body, header), caplog)
    assert "PAYMENT_PROVIDER_WEBHOOK_SECRET" in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"\xff\xfe garbage",
        b"[1, 2, 3]",
        json.dumps({"id": "evt_1", "object": "charge"}).encode(),
        json.dumps({"id": "evt_1", "object": "event", "type": "payment_intent.succeeded"}).encode(),
        json.dumps(
            event_about({"id": "pi_1", "object": "refund"}, "payment_intent.succeeded")
        ).encode(),
        json.dumps(
            event_about({**intent(), "amount": "lots"}, "payment_intent.succeeded")
        ).encode(),
        b"[" * 100_000,
    ],
    ids=[
        "not-json",
        "not-utf8",
        "a-list",
        "not-an-event",
        "no-data",
        "wrong-object",
        "bad-amount",
        "deep-nesting",
    ],
)
def test_a_body_that_is_not_an_event__is_400(body, caplog):
    """Signed correctly (the provider's own key could sign garbage): still nothing written."""
    assert_refused(post(*signed(body)), caplog)


def test_an_unknown_event_type__is_acknowledged_and_nothing_written(caplog):
    """Stripe's practice: answer 2xx to what you do not handle (else it retries for days)."""
    body, header = signed(event_about({"id": "cus_1", "object": "customer"}, "customer.created"))

    response = post(body, header)

    assert response.status_code == 200
    assert response.json() == {"received": True, "ignored": True}
    assert nothing_written()


def test_a_body_too_large__is_413(caplog):
    body, header = signed(b" " * (600 * 1024))
    assert_refused(post(body, header), caplog, status=413)


def test_only_post():
    assert Client().get(URL).status_code == 405
    assert nothing_written()


@pytest.mark.parametrize("value", [[""], ["has space"], [1], "a,,b ", ["a,b"]])
def test_webhook_settings__are_validated(settings, value):
    from django.core.exceptions import ImproperlyConfigured

    from payments.conf import payments_settings

    settings.PAYMENTS = {"PROVIDER_WEBHOOK_SECRETS": value}
    if value == "a,,b ":  # a comma-separated string, as the environment gives it
        assert payments_settings().provider_webhook_secrets == ("a", "b")
        return
    with pytest.raises(ImproperlyConfigured, match="PROVIDER_WEBHOOK_SECRETS"):
        payments_settings()
