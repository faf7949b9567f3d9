"""Adyen's official Python library (Adyen==16.0.0) works against the fake Adyen unchanged.

The library's Checkout services are pointed at the fake by their `baseUrl`, the way its
README documents ("Customizing Base URL": "replace the baseUrl with your own URL");
nothing private is patched. Its exceptions are the ones a real Adyen answer raises
(`Adyen/client.py` `_raise_http_error`), and its HMAC validator
(`Adyen.util.is_valid_hmac_notification`) checks the fake's notification signatures: the
fake signs with its own code, so the two are independent implementations of Adyen's rule.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import Adyen  # type: ignore[import-untyped]  # the library ships no type information
import pytest
import requests
from Adyen.util import is_valid_hmac_notification  # type: ignore[import-untyped]
from django.core.management import CommandError, call_command

from devtools.fake_provider.adyen.contract import KEY_RETENTION_MINIMUM
from devtools.fake_provider.adyen.notifications import signing_string
from devtools.fake_provider.adyen.server import FakeAdyenServer

API_KEY = "AQEfake_test_key"
MERCHANT = "ShopECOM"
HMAC_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"


class Receiver:
    """A notification endpoint: records each POSTed body, answers as scripted."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        #: (status, body) answers for the next POSTs; then 200 "[accepted]".
        self.script: deque[tuple[int, str]] = deque()
        self.cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length))
                with receiver.cond:
                    receiver.bodies.append(body)
                    status, text = receiver.script.popleft() if receiver.script else (200, "")
                    receiver.cond.notify_all()
                payload = (text or "[accepted]").encode() if status == 200 else text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/adyen/notifications"
        serve = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        serve.start()

    def items(self, event: str | None = None) -> list[dict[str, Any]]:
        with self.cond:
            rows = [b["notificationItems"][0]["NotificationRequestItem"] for b in self.bodies]
        return [r for r in rows if event in (None, r["eventCode"])]

    def wait_for(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.bodies) >= count, timeout), self.bodies
            return list(self.bodies)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    endpoint = Receiver()
    yield endpoint
    endpoint.httpd.shutdown()
    endpoint.httpd.server_close()


@pytest.fixture
def fake(receiver: Receiver) -> Iterator[FakeAdyenServer]:
    server = FakeAdyenServer(
        api_key=API_KEY,
        merchant_accounts=[MERCHANT],
        slow_delay=1.0,
        notification_url=receiver.url,
        hmac_key=HMAC_KEY,
        notification_options={"retry_delays": [0.05], "timeout": 2.0},
    ).start()
    yield server
    server.stop()


def library_checkout(base_url: str, api_key: str = API_KEY) -> Any:
    """The library's Checkout service, its base URL set as its README documents."""
    adyen = Adyen.Adyen(xapikey=api_key, platform="test", http_force="requests", http_timeout=5)
    adyen.checkout.payments_api.baseUrl = base_url
    adyen.checkout.modifications_api.baseUrl = base_url
    return adyen.checkout


@pytest.fixture
def checkout(fake: FakeAdyenServer) -> Any:
    return library_checkout(fake.checkout_url)


def payment(reference: str = "order-42", value: int = 2500, **method: str) -> dict[str, Any]:
    return {
        "merchantAccount": MERCHANT,
        "amount": {"value": value, "currency": "EUR"},
        "reference": reference,
        "paymentMethod": {"type": "scheme", "holderName": "John Smith", **method},
        "returnUrl": "https://shop.example/return",
    }


def manual(body: dict[str, Any]) -> dict[str, Any]:
    return body | {"additionalData": {"manualCapture": "true"}}


def modification(value: int | None = None, reference: str = "mod-1") -> dict[str, Any]:
    body: dict[str, Any] = {"merchantAccount": MERCHANT, "reference": reference}
    if value is not None:
        body["amount"] = {"value": value, "currency": "EUR"}
    return body


# --- payments ----------------------------------------------------------------------------


def test_payment__authorised_with_psp_reference_and_a_signed_notification(checkout, receiver):
    result = checkout.payments_api.payments(payment(), idempotency_key="order-42:charge")

    answer = result.message
    assert result.status_code == 200 and answer["resultCode"] == "Authorised"
    assert len(answer["pspReference"]) == 16 and result.psp == answer["pspReference"]
    assert answer["merchantReference"] == "order-42"
    body = receiver.wait_for(1)[0]
    item = body["notificationItems"][0]["NotificationRequestItem"]
    assert (item["eventCode"], item["success"], item["pspReference"]) == (
        "AUTHORISATION",
        "true",
        answer["pspReference"],
    )
    assert body["live"] == "false" and item["merchantAccountCode"] == MERCHANT
    assert is_valid_hmac_notification(body, HMAC_KEY)


def test_notification__library_validator_refuses_a_changed_item_or_another_key(checkout, receiver):
    checkout.payments_api.payments(payment())
    body = receiver.wait_for(1)[0]

    tampered = json.loads(json.dumps(body))
    tampered["notificationItems"][0]["NotificationRequestItem"]["amount"]["value"] = 1
    assert is_valid_hmac_notification(body, HMAC_KEY)
    assert not is_valid_hmac_notification(tampered, HMAC_KEY)
    assert not is_valid_hmac_notification(body, "00" * 32)


def test_notification__reference_with_colons_and_slashes_signs_as_the_library_checks(
    checkout, receiver
):
    checkout.payments_api.payments(payment(reference="a:b\\c/d"))

    body = receiver.wait_for(1)[0]
    item = body["notificationItems"][0]["NotificationRequestItem"]
    assert signing_string(item).count(":") == 8  # the reference's colon is not escaped
    assert is_valid_hmac_notification(body, HMAC_KEY)


@pytest.mark.parametrize(
    ("method", "extra", "reason", "code"),
    [
        ({"holderName": "DECLINED"}, {}, "Refused", "2"),
        ({"holderName": "NOT_ENOUGH_BALANCE"}, {}, "Not enough balance", "12"),
        ({}, {"RequestedTestAcquirerResponseCode": 6}, "Expired Card", "6"),
    ],
)
def test_payment__test_refusals_answer_refused_with_reason(
    checkout, receiver, fake, method, extra, reason, code
):
    body = payment(**method)
    if extra:
        body["additionalData"] = extra
    answer = checkout.payments_api.payments(body).message

    assert (answer["resultCode"], answer["refusalReason"], answer["refusalReasonCode"]) == (
        "Refused",
        reason,
        code,
    )
    item = receiver.wait_for(1)[0]["notificationItems"][0]["NotificationRequestItem"]
    assert (item["eventCode"], item["success"], item["reason"]) == (
        "AUTHORISATION",
        "false",
        reason,
    )
    assert fake.state.authorised_count() == 0


# --- modifications: received now, the outcome in a notification -------------------------


def test_capture_then_refunds__received_with_their_own_psp_outcome_notified(checkout, receiver):
    paid = checkout.payments_api.payments(manual(payment())).message["pspReference"]
    mods = checkout.modifications_api

    captured = mods.capture_authorised_payment(modification(2500, "cap-1"), paid)
    refunded = mods.refund_captured_payment(modification(1000, "ref-1"), paid)
    too_much = mods.refund_captured_payment(modification(2000, "ref-2"), paid)

    for result in (captured, refunded, too_much):
        assert result.status_code == 201 and result.message["status"] == "received"
        assert result.message["paymentPspReference"] == paid
        assert result.message["pspReference"] != paid
    receiver.wait_for(4)
    outcomes = [
        (i["eventCode"], i["success"], i["originalReference"]) for i in receiver.items()[1:]
    ]
    assert outcomes == [
        ("CAPTURE", "true", paid),
        ("REFUND", "true", paid),
        ("REFUND", "false", paid),
    ]
    assert receiver.items("REFUND")[1]["pspReference"] == too_much.message["pspReference"]
    assert all(is_valid_hmac_notification(b, HMAC_KEY) for b in receiver.bodies)


def test_cancel__of_an_authorisation_succeeds_of_a_captured_payment_fails(checkout, receiver):
    held = checkout.payments_api.payments(manual(payment("held"))).message["pspReference"]
    taken = checkout.payments_api.payments(payment("taken")).message["pspReference"]
    mods = checkout.modifications_api

    first = mods.cancel_authorised_payment_by_psp_reference(modification(), held)
    second = mods.cancel_authorised_payment_by_psp_reference(modification(), taken)

    assert (first.status_code, second.status_code) == (201, 201)
    receiver.wait_for(4)
    cancellations = receiver.items("CANCELLATION")
    assert [(c["originalReference"], c["success"]) for c in cancellations] == [
        (held, "true"),
        (taken, "false"),
    ]
    assert cancellations[1]["reason"] == "Payment already captured"


def test_modification__unknown_psp_reference_is_422_167(checkout):
    with pytest.raises(Adyen.AdyenAPIUnprocessableEntity) as info:
        checkout.modifications_api.capture_authorised_payment(modification(100), "NOSUCHPAYMENT000")
    assert (info.value.status_code, info.value.error_code) == (422, "167")


# --- idempotency ---------------------------------------------------------------------------


def test_same_key_same_body__replays_the_stored_answer_once_executed(checkout, fake, receiver):
    first = checkout.payments_api.payments(payment(), idempotency_key="k-replay")
    again = checkout.payments_api.payments(payment(), idempotency_key="k-replay")

    assert again.message == first.message
    assert fake.state.authorised_count() == 1 and fake.state.stats()["replays"] == 1
    receiver.wait_for(1)
    assert len(receiver.items("AUTHORISATION")) == 1


def test_same_key__header_echoed_and_matched_case_insensitively(fake):
    url = fake.checkout_url + "/payments"
    first = requests.post(
        url, json=payment(), headers={"X-API-Key": API_KEY, "Idempotency-Key": "k-case"}, timeout=5
    )
    again = requests.post(
        url, json=payment(), headers={"x-api-key": API_KEY, "idempotency-key": "k-case"}, timeout=5
    )

    assert first.headers["idempotency-key"] == "k-case"
    assert again.json() == first.json() and fake.state.authorised_count() == 1


@pytest.mark.parametrize("status", [409, 422])
def test_same_key_in_flight__answered_704_transient_then_replayed(checkout, fake, status):
    fake.state.configure(in_flight_status=status)
    fake.state.enqueue_faults("slow")
    answers: list[Any] = []
    first = threading.Thread(
        target=lambda: answers.append(
            checkout.payments_api.payments(payment(), idempotency_key="k-busy")
        )
    )
    first.start()
    assert fake.state.wait_for_in_flight(1)

    with pytest.raises(Adyen.AdyenError) as info:
        checkout.payments_api.payments(payment(), idempotency_key="k-busy")
    first.join(timeout=5)

    error = info.value
    assert (error.status_code, error.error_code) == (status, "704")
    assert error.message["message"] == "request already processed or in progress"
    assert error.headers["transient-error"] == "true"
    replayed = checkout.payments_api.payments(payment(), idempotency_key="k-busy")
    assert replayed.message == answers[0].message and fake.state.authorised_count() == 1


def test_same_key_other_body__replays_the_first_answer_by_default_and_counts_it(checkout, fake):
    first = checkout.payments_api.payments(payment(value=2500), idempotency_key="k-other")
    other = checkout.payments_api.payments(payment(value=9900), idempotency_key="k-other")

    assert other.message == first.message and other.message["amount"]["value"] == 2500
    stats = fake.state.stats()
    assert stats["key_reuse_other_body"] == 1 and fake.state.authorised_count() == 1


def test_same_key_other_body__refused_704_when_configured_to_reject(checkout, fake):
    fake.state.configure(key_reuse="reject")
    checkout.payments_api.payments(payment(value=2500), idempotency_key="k-strict")

    with pytest.raises(Adyen.AdyenError) as info:
        checkout.payments_api.payments(payment(value=9900), idempotency_key="k-strict")
    assert (info.value.status_code, info.value.error_code) == (409, "704")
    assert fake.state.authorised_count() == 1


def test_key_retention__default_is_adyens_7_day_minimum_then_the_key_is_new_again(checkout, fake):
    assert fake.state.config.key_retention == KEY_RETENTION_MINIMUM == 7 * 86400
    first = checkout.payments_api.payments(payment(), idempotency_key="k-old").message

    fake.state.age(KEY_RETENTION_MINIMUM - 60)
    inside = checkout.payments_api.payments(payment(), idempotency_key="k-old").message
    fake.state.age(120)
    past = checkout.payments_api.payments(payment(), idempotency_key="k-old").message

    assert inside == first
    assert past["pspReference"] != first["pspReference"]  # executed again: a second charge
    assert fake.state.authorised_count(reference="order-42") == 2


# --- faults --------------------------------------------------------------------------------


def test_dropped_answer__then_same_key_replay_learns_the_one_payment(checkout, fake, receiver):
    fake.state.enqueue_faults("drop_after_accept")

    with pytest.raises(requests.ConnectionError):
        checkout.payments_api.payments(payment(), idempotency_key="k-drop")
    replayed = checkout.payments_api.payments(payment(), idempotency_key="k-drop").message

    charged = fake.state.payments()
    assert [p.psp for p in charged] == [replayed["pspReference"]]
    receiver.wait_for(1)
    assert [i["pspReference"] for i in receiver.items()] == [replayed["pspReference"]]


def test_fail_before__500_nothing_executed_the_retry_executes(checkout, fake):
    fake.state.enqueue_faults("fail_before")

    with pytest.raises(Adyen.AdyenAPICommunicationError) as info:
        checkout.payments_api.payments(payment(), idempotency_key="k-before")
    assert info.value.status_code == 500 and fake.state.payments() == []
    checkout.payments_api.payments(payment(), idempotency_key="k-before")
    assert fake.state.authorised_count() == 1


def test_fail_after__500_but_executed_the_replay_answers_the_payment(checkout, fake):
    fake.state.enqueue_faults("fail_after")

    with pytest.raises(Adyen.AdyenAPICommunicationError):
        checkout.payments_api.payments(payment(), idempotency_key="k-after")
    replayed = checkout.payments_api.payments(payment(), idempotency_key="k-after").message

    assert replayed["resultCode"] == "Authorised"
    assert [p.psp for p in fake.state.payments()] == [replayed["pspReference"]]


def test_key_store_unavailable__503_703_transient_nothing_executed(checkout, fake):
    fake.state.enqueue_faults("key_store_unavailable")

    with pytest.raises(Adyen.AdyenError) as info:
        checkout.payments_api.payments(payment(), idempotency_key="k-store")

    assert (info.value.status_code, info.value.error_code) == (503, "703")
    assert info.value.headers["transient-error"] == "true" and fake.state.payments() == []


def test_slow_modification__the_client_times_out_the_refund_happened_once(fake, receiver):
    slow = library_checkout(fake.checkout_url)
    paid = slow.payments_api.payments(payment()).message["pspReference"]
    slow.client.http_timeout = 0.3
    slow.client.http_init = False  # the library builds its HTTP client again with the timeout
    fake.state.enqueue_faults("slow")

    with pytest.raises(requests.Timeout):
        slow.modifications_api.refund_captured_payment(modification(500), paid, idempotency_key="r")
    assert fake.state.wait_idle()
    slow.modifications_api.refund_captured_payment(modification(500), paid, idempotency_key="r")

    receiver.wait_for(2)
    assert [i["success"] for i in receiver.items("REFUND")] == ["true"]


# --- authentication, validation, no lookup -------------------------------------------------


def test_auth__missing_or_wrong_api_key_is_401_000(fake):
    with pytest.raises(Adyen.AdyenAPIAuthenticationError) as info:
        library_checkout(fake.checkout_url, api_key="AQE_wrong").payments_api.payments(payment())
    assert (info.value.status_code, info.value.error_code) == (401, "000")
    answer = requests.post(fake.checkout_url + "/payments", json=payment(), timeout=5)
    assert answer.status_code == 401 and answer.json()["errorType"] == "security"


def test_auth__merchant_account_the_key_may_not_use_is_403_901(checkout, fake):
    with pytest.raises(Adyen.AdyenAPIInvalidPermission) as info:
        checkout.payments_api.payments(payment() | {"merchantAccount": "OtherECOM"})
    assert (info.value.status_code, info.value.error_code) == (403, "901")
    assert fake.state.payments() == []


@pytest.mark.parametrize(
    ("drop", "code"),
    [("reference", "130"), ("amount", "100"), ("returnUrl", "14_030")],
)
def test_validation__missing_required_field_is_422_and_not_stored_under_the_key(
    checkout, fake, drop, code
):
    body = payment()
    del body[drop]
    with pytest.raises(Adyen.AdyenAPIUnprocessableEntity) as info:
        checkout.payments_api.payments(body, idempotency_key="k-invalid")
    assert info.value.error_code == code

    checkout.payments_api.payments(payment(), idempotency_key="k-invalid")
    assert fake.state.authorised_count() == 1


def test_no_lookup__there_is_no_api_to_read_a_payment(checkout, fake):
    psp = checkout.payments_api.payments(payment()).message["pspReference"]
    headers = {"X-API-Key": API_KEY}

    for path in (f"/payments/{psp}", "/payments?reference=order-42", f"/payments/{psp}/captures"):
        answer = requests.get(fake.checkout_url + path, headers=headers, timeout=5)
        assert answer.status_code == 404, path
    other_version = requests.post(
        fake.url + "/v71/payments", json=payment(), headers=headers, timeout=5
    )
    assert other_version.status_code == 404


# --- notifications: [accepted], retries -----------------------------------------------------


def test_notification__retried_until_the_body_says_accepted(checkout, fake, receiver):
    receiver.script.extend([(200, "OK"), (500, "oops")])

    checkout.payments_api.payments(payment())

    bodies = receiver.wait_for(3)
    assert bodies[0] == bodies[1] == bodies[2]  # the same item, signed once
    assert fake.notifications.wait_idle()
    stats = fake.notifications.stats()
    assert (stats["attempts"], stats["failed_attempts"], stats["accepted"]) == (3, 2, 1)


def test_notification__any_2xx_accepts_when_configured_as_adyen_does_since_2024(
    checkout, fake, receiver
):
    fake.notifications.configure(accept="2xx")
    receiver.script.append((204, ""))

    checkout.payments_api.payments(payment())

    receiver.wait_for(1)
    assert fake.notifications.wait_idle()
    assert fake.notifications.stats()["attempts"] == 1


def test_notification__given_up_after_max_attempts_the_next_one_goes_out(checkout, fake, receiver):
    fake.notifications.configure(max_attempts=2)
    receiver.script.extend([(503, ""), (503, "")])

    checkout.payments_api.payments(payment("first"))
    checkout.payments_api.payments(payment("second"))

    receiver.wait_for(3)
    assert fake.notifications.wait_idle()
    references = [i["merchantReference"] for i in receiver.items()]
    assert references == ["first", "first", "second"]  # one queue, in order
    assert fake.notifications.stats()["gave_up"] == 1


def test_notification__duplicate_fault_sends_the_item_twice(checkout, fake, receiver):
    fake.notifications.enqueue_faults("duplicate")

    psp = checkout.payments_api.payments(payment()).message["pspReference"]

    receiver.wait_for(2)
    assert [i["pspReference"] for i in receiver.items()] == [psp, psp]


# --- control API and the management command ---------------------------------------------


def test_control__faults_config_stats_timeline_reset(checkout, fake):
    control = fake.url + "/_fake"
    assert requests.get(control + "/health", timeout=5).json() == {
        "status": "ok",
        "contract": "adyen",
    }
    queued = requests.post(control + "/faults", json={"mode": "fail_before"}, timeout=5)
    config = requests.post(control + "/config", json={"capture": "manual"}, timeout=5)
    assert queued.json() == {"queued": 1} and config.json()["capture"] == "manual"
    with pytest.raises(Adyen.AdyenAPICommunicationError):
        checkout.payments_api.payments(payment())
    psp = checkout.payments_api.payments(payment()).message["pspReference"]
    checkout.modifications_api.capture_authorised_payment(modification(2500), psp)

    timeline = requests.get(control + "/timeline", timeout=5).json()["data"]
    stats = requests.get(control + "/stats", timeout=5).json()
    assert [(t["eventCode"], t["success"]) for t in timeline] == [
        ("AUTHORISATION", True),
        ("CAPTURE", True),
    ]
    assert stats["faults_injected"] == {"fail_before": 1} and stats["payments"] == 1
    bad = requests.post(control + "/faults", json={"mode": "rate_limit"}, timeout=5)
    assert bad.status_code == 400
    requests.post(control + "/reset", timeout=5)
    assert fake.state.payments() == [] and fake.state.stats()["idempotency_keys"] == 0


def test_command__refuses_options_of_the_other_contract():
    with pytest.raises(CommandError, match="--tls"):
        call_command("run_fake_provider", "--contract", "adyen", "--port", "0", "--tls")
    with pytest.raises(CommandError, match="--hmac-key"):
        call_command("run_fake_provider", "--port", "0", "--hmac-key", HMAC_KEY)
    with pytest.raises(CommandError, match="go together"):
        call_command(
            "run_fake_provider", "--contract", "adyen", "--port", "0", "--hmac-key", HMAC_KEY
        )


def test_command__serves_the_adyen_contract_to_the_library_until_sigterm():
    process = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "run_fake_provider",
            "--contract",
            "adyen",
            "--port",
            "0",
            "--api-key",
            API_KEY,
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = process.stdout.readline().split("listening on ", 1)[1].strip()
        base_url = process.stdout.readline().split(": ", 1)[1].strip()
        assert base_url == url + "/v72"
        assert requests.get(url + "/_fake/health", timeout=2).json()["contract"] == "adyen"
        answer = library_checkout(base_url).payments_api.payments(payment())
        assert answer.message["resultCode"] == "Authorised"
        stats = requests.get(url + "/_fake/stats", timeout=2).json()
        assert stats["config"]["key_retention"] == KEY_RETENTION_MINIMUM
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
