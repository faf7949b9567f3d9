"""The Adyen client against the fake Adyen over HTTP: each row of the error table.

No database: the client knows none. Each answer is the fake's, as Adyen documents it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from devtools.fake_provider.adyen.server import FakeAdyenServer
from payments.adyen.client import CAPTURES, AdyenClient, AdyenError
from payments.engine.outcomes import Outcome
from tests.support.adyen import API_KEY, MERCHANT

BODY = {
    "amount": {"value": 1000, "currency": "EUR"},
    "reference": "fence:1:charge",
    "paymentMethod": {"type": "scheme", "holderName": "John Smith"},
    "returnUrl": "https://shop.invalid/return",
}


@pytest.fixture
def fake() -> Any:
    server = FakeAdyenServer(api_key=API_KEY, merchant_accounts=[MERCHANT], slow_delay=1.0).start()
    yield server
    server.stop()


def client(url: str, *, api_key: str = API_KEY, merchant: str = MERCHANT, read: float = 2.0):
    return AdyenClient(
        url=url, api_key=api_key, merchant_account=merchant, connect_timeout=0.5, read_timeout=read
    )


def refused(call: Any) -> AdyenError:
    with pytest.raises(AdyenError) as info:
        call()
    return info.value


def test_pay__authorised__200_with_its_psp_reference(fake):
    answer = client(fake.checkout_url).pay(BODY, idempotency_key="k-1")

    assert (answer.status, answer.body["resultCode"]) == (200, "Authorised")
    assert len(answer.body["pspReference"]) == 16


def test_modification__received_201__not_its_outcome(fake):
    adyen = client(fake.checkout_url)
    manual = {**BODY, "additionalData": {"manualCapture": "true"}}
    psp = adyen.pay(manual, idempotency_key="k-2").body["pspReference"]

    answer = adyen.modify(
        CAPTURES, psp, {"amount": {"value": 1000, "currency": "EUR"}}, idempotency_key="k-3"
    )

    assert (answer.status, answer.body["status"]) == (201, "received")
    assert answer.body["paymentPspReference"] == psp


@pytest.mark.parametrize(
    ("make", "status"),
    [
        pytest.param(lambda url: client(url, api_key="wrong"), 401, id="401-api-key"),
        pytest.param(lambda url: client(url, merchant="Other"), 403, id="403-merchant-account"),
    ],
)
def test_refused_before_anything_executed__permanent(fake, make, status):
    error = refused(lambda: make(fake.checkout_url).pay(BODY, idempotency_key="k-4"))

    assert (error.outcome, error.http_status) == (Outcome.PERMANENT, status)
    assert fake.state.stats()["payments"] == 0


def test_validation_422__permanent(fake):
    body = {k: v for k, v in BODY.items() if k != "returnUrl"}

    error = refused(lambda: client(fake.checkout_url).pay(body, idempotency_key="k-5"))

    assert (error.outcome, error.http_status, error.code) == (Outcome.PERMANENT, 422, "14_030")


def test_same_key_in_flight_704__transient_and_in_flight(fake):
    fake.state.enqueue_faults("slow")
    adyen = client(fake.checkout_url)
    first = threading.Thread(target=lambda: adyen.pay(BODY, idempotency_key="k-busy"))
    first.start()
    assert fake.state.wait_for_in_flight(1)

    error = refused(lambda: adyen.pay(BODY, idempotency_key="k-busy"))
    first.join(timeout=5)

    assert (error.outcome, error.code, error.in_flight) == (Outcome.TRANSIENT, "704", True)
    assert fake.state.authorised_count() == 1


def test_key_store_unavailable_503__transient(fake):
    fake.state.enqueue_faults("key_store_unavailable")

    error = refused(lambda: client(fake.checkout_url).pay(BODY, idempotency_key="k-6"))

    assert (error.outcome, error.http_status, error.in_flight) == (Outcome.TRANSIENT, 503, False)
    assert fake.state.stats()["payments"] == 0


def test_500_after_executing__uncertain__the_same_key_then_replays_the_real_answer(fake):
    fake.state.enqueue_faults("fail_after")
    adyen = client(fake.checkout_url)

    error = refused(lambda: adyen.pay(BODY, idempotency_key="k-7"))
    replayed = adyen.pay(BODY, idempotency_key="k-7")

    assert (error.outcome, error.http_status) == (Outcome.UNCERTAIN, 500)
    assert replayed.body["resultCode"] == "Authorised"
    assert fake.state.authorised_count() == 1


def test_read_timeout_after_send__uncertain(fake):
    fake.state.enqueue_faults("slow")

    error = refused(lambda: client(fake.checkout_url, read=0.2).pay(BODY, idempotency_key="k-8"))

    assert error.outcome == Outcome.UNCERTAIN


def test_answer_dropped_after_executing__uncertain(fake):
    fake.state.enqueue_faults("drop_after_accept")

    error = refused(lambda: client(fake.checkout_url).pay(BODY, idempotency_key="k-9"))

    assert error.outcome == Outcome.UNCERTAIN
    assert fake.state.authorised_count() == 1


def test_nothing_listening__transient_nothing_sent():
    error = refused(lambda: client("http://127.0.0.1:9/v72").pay(BODY, idempotency_key="k-10"))

    assert error.outcome == Outcome.TRANSIENT
