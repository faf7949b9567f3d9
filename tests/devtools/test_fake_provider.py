"""The fake provider keeps the provider contract of DESIGN.md, checked on the wire.

These tests speak plain HTTP with `requests` (not our client), so they pin
what any Stripe-style client would see: status codes, bodies and headers.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from django.core.management import CommandError, call_command

from devtools.fake_provider.server import FakeProviderServer, parse_search_query
from tests.support.provider import FakeClock

AUTH = {"Authorization": "Bearer sk_test_contract"}
CHARGE = {
    "amount": "1500",
    "currency": "eur",
    "confirm": "true",
    "payment_method": "pm_card_visa",
    "metadata[step]": "checkout:order:1:charge",
}


def post(
    server: FakeProviderServer, key: str | None = "key-1", timeout: float = 2, **changes: Any
) -> requests.Response:
    headers = {**AUTH, **({"Idempotency-Key": key} if key else {})}
    form = {k: v for k, v in (CHARGE | changes).items() if v is not None}
    return requests.post(
        server.url + "/v1/payment_intents", data=form, headers=headers, timeout=timeout
    )


def get(server: FakeProviderServer, path: str, **params: Any) -> requests.Response:
    return requests.get(server.url + path, params=params, headers=AUTH, timeout=2)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def clocked(clock: FakeClock) -> Iterator[FakeProviderServer]:
    """A fake provider on a hand-driven clock, for retention, lag and ordering."""
    with FakeProviderServer(clock=clock, search_lag=30, key_retention=3600) as server:
        yield server


# --- create and replay ---------------------------------------------------------------


def test_create__succeeds_with_intent_shape_and_request_id(fake_provider):
    response = post(fake_provider)
    assert response.status_code == 200
    assert response.headers["Request-Id"].startswith("req_")
    assert response.raw.version == 11  # HTTP/1.1, keep-alive
    body = response.json()
    assert body["id"].startswith("pi_") and body["object"] == "payment_intent"
    assert (body["amount"], body["currency"], body["status"]) == (1500, "eur", "succeeded")
    assert body["metadata"] == {"step": "checkout:order:1:charge"}
    assert isinstance(body["created"], int) and body["livemode"] is False
    assert body["client_secret"].startswith(body["id"] + "_secret_")
    assert body["payment_method"] == "pm_card_visa"
    assert "Idempotent-Replayed" not in response.headers


def test_create__keep_alive_session_serves_many_requests(fake_provider):
    with requests.Session() as session:
        for n in range(3):
            response = session.post(
                fake_provider.url + "/v1/payment_intents",
                data=CHARGE,
                headers={**AUTH, "Idempotency-Key": f"k{n}"},
                timeout=2,
            )
            assert response.status_code == 200
    assert fake_provider.state.succeeded_count() == 3


def test_create__ignores_other_stripe_params(fake_provider):
    response = post(
        fake_provider, description="Order 1", receipt_email="a@example.com", **{"expand[]": "x"}
    )
    assert response.status_code == 200
    assert "receipt_email" not in response.json()


def test_create__without_confirm_requires_confirmation(fake_provider):
    assert post(fake_provider, confirm=None).json()["status"] == "requires_confirmation"


def test_replay__same_key_same_params_returns_stored_answer(fake_provider):
    first = post(fake_provider)
    again = post(fake_provider)
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert fake_provider.state.succeeded_count() == 1


def test_replay__same_key_other_params_is_idempotency_error(fake_provider):
    post(fake_provider)
    response = post(fake_provider, amount="1600")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "idempotency_error"
    assert len(fake_provider.state.intents()) == 1


def test_in_flight__same_key_gets_409_then_replay(fake_provider):
    fake_provider.state.configure(slow_delay=0.3)
    fake_provider.state.enqueue_faults("slow")
    answers: list[requests.Response] = []
    first = threading.Thread(target=lambda: answers.append(post(fake_provider)))
    first.start()
    assert fake_provider.state.wait_for_in_flight(1, timeout=2)
    concurrent = post(fake_provider)
    first.join(timeout=3)
    assert concurrent.status_code == 409
    assert concurrent.json()["error"]["code"] == "idempotency_key_in_use"
    assert answers[0].status_code == 200
    replay = post(fake_provider)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == answers[0].json()["id"]
    assert fake_provider.state.succeeded_count() == 1


def test_retention__key_forgotten_after_key_retention(clocked, clock):
    first = post(clocked).json()
    clock.advance(3599)
    assert post(clocked).headers.get("Idempotent-Replayed") == "true"
    clock.advance(2)
    late = post(clocked)
    assert "Idempotent-Replayed" not in late.headers
    assert late.json()["id"] != first["id"]
    assert clocked.state.succeeded_count() == 2


def test_default_retention__is_24_hours():
    assert FakeProviderServer().state.config.key_retention == 86400


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "param", "code"),
    [
        ({"amount": None}, "amount", "parameter_missing"),
        ({"amount": "ten"}, "amount", "parameter_invalid_integer"),
        ({"amount": "0"}, "amount", "amount_too_small"),
        ({"currency": "eu"}, "currency", "parameter_invalid_string"),
        ({"payment_method": "pm_card_unknown"}, "payment_method", "resource_missing"),
    ],
)
def test_validation__400_with_param_and_not_stored(fake_provider, changes, param, code):
    refused = post(fake_provider, **changes)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    retried = post(fake_provider)  # same key, valid params: executes, no replay
    assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers


def test_decline__402_with_intent_and_replayed(fake_provider):
    response = post(fake_provider, payment_method="pm_card_chargeDeclined")
    assert response.status_code == 402
    error = response.json()["error"]
    assert (error["type"], error["code"], error["decline_code"]) == (
        "card_error",
        "card_declined",
        "generic_decline",
    )
    assert error["payment_intent"]["status"] == "requires_payment_method"
    [intent] = fake_provider.state.intents()
    assert intent["id"] == error["payment_intent"]["id"]
    replay = post(fake_provider, payment_method="pm_card_chargeDeclined")
    assert replay.status_code == 402 and replay.headers["Idempotent-Replayed"] == "true"


def test_retrieve__found_and_404(fake_provider):
    created = post(fake_provider).json()
    assert get(fake_provider, f"/v1/payment_intents/{created['id']}").json() == created
    missing = get(fake_provider, "/v1/payment_intents/pi_missing")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "resource_missing"
    assert missing.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer pk_test_x"}, {"Authorization": "Basic c2tfOg=="}]
)
def test_auth__missing_or_bad_key_is_401(fake_provider, headers):
    response = requests.get(fake_provider.url + "/v1/payment_intents", headers=headers, timeout=2)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers["Request-Id"].startswith("req_")


def test_auth__configured_key_is_the_only_one(fake_provider):
    fake_provider.state.configure(api_key="sk_test_only")
    assert get(fake_provider, "/v1/payment_intents").status_code == 401
    only = {"Authorization": "Bearer sk_test_only"}
    url = fake_provider.url + "/v1/payment_intents"
    assert requests.get(url, headers=only, timeout=2).status_code == 200


# --- search and list ----------------------------------------------------------------------


def test_search__lags_writes_by_search_lag(clocked, clock):
    created = post(clocked).json()
    query = "metadata['step']:'checkout:order:1:charge'"
    assert get(clocked, "/v1/payment_intents/search", query=query).json()["data"] == []
    clock.advance(30)
    found = get(clocked, "/v1/payment_intents/search", query=query).json()
    assert found["object"] == "search_result" and found["has_more"] is False
    assert [pi["id"] for pi in found["data"]] == [created["id"]]


def test_search__and_clauses_status_and_escaped_quotes(clocked, clock):
    ok = post(clocked, key="a", **{"metadata[step]": "it's", "metadata[op]": "1"}).json()
    post(clocked, key="b", **{"metadata[step]": "it's", "metadata[op]": "2"})
    post(clocked, key="c", payment_method="pm_card_chargeDeclined", **{"metadata[step]": "it's"})
    clock.advance(31)

    def ids(query: str) -> list[str]:
        return [
            pi["id"]
            for pi in get(clocked, "/v1/payment_intents/search", query=query).json()["data"]
        ]

    assert ids("metadata['step']:'it\\'s' AND metadata['op']:'1'") == [ok["id"]]
    assert len(ids("metadata['step']:'it\\'s' and status:'succeeded'")) == 2
    assert len(ids('metadata["step"]:"it\'s"')) == 3


def test_search__unsupported_query_is_400(fake_provider):
    response = get(fake_provider, "/v1/payment_intents/search", query="amount>10 OR x")
    assert response.status_code == 400 and response.json()["error"]["param"] == "query"
    assert parse_search_query("metadata['a']:'b' AND") is None


def test_list__newest_first_with_cursor_pages_and_created_filters(clocked, clock):
    ids = []
    for n in range(5):
        ids.append(post(clocked, key=f"k{n}").json()["id"])
        clock.advance(10)
    newest_first = ids[::-1]
    page = get(clocked, "/v1/payment_intents", limit=2).json()
    assert (page["object"], page["url"], page["has_more"]) == ("list", "/v1/payment_intents", True)
    seen = [pi["id"] for pi in page["data"]]
    while page["has_more"]:
        page = get(clocked, "/v1/payment_intents", limit=2, starting_after=seen[-1]).json()
        seen += [pi["id"] for pi in page["data"]]
    assert seen == newest_first
    start = clock.now - 50
    window = get(
        clocked,
        "/v1/payment_intents",
        **{"created[gte]": int(start) + 10, "created[lte]": int(start) + 30},
    )
    assert [pi["id"] for pi in window.json()["data"]] == ids[1:4][::-1]
    back = get(clocked, "/v1/payment_intents", limit=2, ending_before=ids[2]).json()
    assert [pi["id"] for pi in back["data"]] == [ids[4], ids[3]]
    assert get(clocked, "/v1/payment_intents", starting_after="pi_gone").status_code == 400
    assert get(clocked, "/v1/payment_intents", limit=101).status_code == 400


# --- faults -----------------------------------------------------------------------------------


def test_fault_drop_after_accept__charges_stores_and_closes(fake_provider):
    fake_provider.state.enqueue_faults("drop_after_accept")
    with pytest.raises(requests.ConnectionError):
        post(fake_provider)
    assert fake_provider.state.succeeded_count() == 1
    replay = post(fake_provider)
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert fake_provider.state.succeeded_count() == 1


def test_fault_slow__charges_and_answers_after_the_client_gave_up(fake_provider):
    fake_provider.state.configure(slow_delay=0.4)
    fake_provider.state.enqueue_faults("slow")
    with pytest.raises(requests.exceptions.ReadTimeout):
        post(fake_provider, timeout=0.1)
    assert fake_provider.state.succeeded_count() == 1
    assert fake_provider.state.wait_idle(timeout=2)
    assert post(fake_provider).headers["Idempotent-Replayed"] == "true"


def test_fault_fail_before__500_should_retry_nothing_executed(fake_provider):
    fake_provider.state.enqueue_faults("fail_before")
    failed = post(fake_provider)
    assert failed.status_code == 500 and failed.headers["Stripe-Should-Retry"] == "true"
    assert fake_provider.state.intents() == []
    retried = post(fake_provider)
    assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers


def test_fault_fail_after__charges_and_replays_the_500(fake_provider):
    fake_provider.state.enqueue_faults("fail_after")
    failed = post(fake_provider)
    assert failed.status_code == 500 and "Stripe-Should-Retry" not in failed.headers
    assert fake_provider.state.succeeded_count() == 1
    replay = post(fake_provider)
    assert replay.status_code == 500 and replay.headers["Idempotent-Replayed"] == "true"


def test_fault_rate_limit__429_not_stored(fake_provider):
    fake_provider.state.enqueue_faults("rate_limit")
    assert post(fake_provider).status_code == 429
    retried = post(fake_provider)
    assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers


def test_faults__queue_runs_in_order_then_stops(fake_provider):
    for mode in ("rate_limit", "fail_before"):
        fake_provider.state.enqueue_faults(mode)
    statuses = [post(fake_provider, key=f"q{n}").status_code for n in range(3)]
    assert statuses == [429, 500, 200]


def test_fault_rates__seeded_and_repeatable():
    def statuses(seed: int) -> list[int]:
        with FakeProviderServer(seed=seed, fail_before_rate=0.3, rate_limit_rate=0.3) as server:
            return [post(server, key=f"r{n}").status_code for n in range(12)]

    first = statuses(7)
    assert first == statuses(7)
    assert {429, 500, 200} <= set(first)
    # One draw per create, walked through the modes in order: fail_before
    # takes [0, 0.3), rate_limit [0.3, 0.6), the rest executes normally.
    draws = random.Random(7)
    expected = []
    for _ in range(12):
        draw = draws.random()
        expected.append(500 if draw < 0.3 else 429 if draw < 0.6 else 200)
    assert first == expected


def test_stop__does_not_wait_for_a_slow_answer():
    server = FakeProviderServer(slow_delay=30).start()
    server.state.enqueue_faults("slow")

    def call() -> None:
        try:
            post(server, timeout=5)
        except requests.RequestException:
            pass  # a cut connection is as good as an answer here

    worker = threading.Thread(target=call)
    worker.start()
    assert server.state.wait_for_in_flight(1, timeout=2)
    started = time.monotonic()
    server.stop()
    worker.join(timeout=2)
    assert not worker.is_alive()
    assert time.monotonic() - started < 1


# --- refunds ------------------------------------------------------------------------------


def charged(server: FakeProviderServer, key: str = "charge-1", **changes: Any) -> dict[str, Any]:
    """A succeeded (or, with a declining card, refused) intent; the intent object either way."""
    body = post(server, key=key, **changes).json()
    return body["error"]["payment_intent"] if "error" in body else body


def refund(
    server: FakeProviderServer, key: str | None = "refund-1", timeout: float = 2, **form: Any
) -> requests.Response:
    headers = {**AUTH, **({"Idempotency-Key": key} if key else {})}
    data = {k: v for k, v in form.items() if v is not None}
    return requests.post(server.url + "/v1/refunds", data=data, headers=headers, timeout=timeout)


def refund_error(response: requests.Response) -> tuple[int, str, str | None, str | None]:
    error = response.json()["error"]
    return response.status_code, error["type"], error.get("code"), error.get("param")


def test_refund__partial_has_refund_shape(fake_provider):
    pi = charged(fake_provider)
    response = refund(
        fake_provider,
        payment_intent=pi["id"],
        amount="500",
        reason="requested_by_customer",
        **{"metadata[step]": "refund:1"},
    )
    assert response.status_code == 200 and response.headers["Request-Id"].startswith("req_")
    body = response.json()
    assert body["id"].startswith("re_") and body["object"] == "refund"
    assert (body["amount"], body["currency"], body["status"]) == (500, "eur", "succeeded")
    assert (body["payment_intent"], body["reason"]) == (pi["id"], "requested_by_customer")
    assert body["metadata"] == {"step": "refund:1"} and isinstance(body["created"], int)
    assert "Idempotent-Replayed" not in response.headers
    assert fake_provider.state.refunds(payment_intent=pi["id"]) == [body]
    # The intent itself is unchanged: Stripe keeps amount_refunded on the charge.
    assert get(fake_provider, f"/v1/payment_intents/{pi['id']}").json() == pi


def test_refund__without_amount_refunds_what_is_left(fake_provider):
    pi = charged(fake_provider)
    assert refund(fake_provider, key="r1", payment_intent=pi["id"], amount="400").ok
    rest = refund(fake_provider, key="r2", payment_intent=pi["id"])
    assert rest.status_code == 200
    assert (rest.json()["amount"], rest.json()["reason"]) == (1100, None)
    assert sum(r["amount"] for r in fake_provider.state.refunds()) == 1500


def test_refund__more_than_is_left_is_amount_too_large(fake_provider):
    pi = charged(fake_provider)
    too_much = refund(fake_provider, key="r1", payment_intent=pi["id"], amount="1501")
    assert refund_error(too_much) == (400, "invalid_request_error", "amount_too_large", "amount")
    assert too_much.json()["error"]["message"] == (
        "Refund amount (€15.01) is greater than charge amount (€15.00)"
    )
    assert refund(fake_provider, key="r2", payment_intent=pi["id"], amount="1000").ok
    over = refund(fake_provider, key="r3", payment_intent=pi["id"], amount="600")
    assert refund_error(over)[2] == "amount_too_large"
    assert over.json()["error"]["message"] == (
        "Refund amount (€6.00) is greater than unrefunded amount on charge (€5.00)"
    )
    assert [r["amount"] for r in fake_provider.state.refunds()] == [1000]


def test_refund__second_full_refund_is_charge_already_refunded(fake_provider):
    pi = charged(fake_provider)
    assert refund(fake_provider, key="r1", payment_intent=pi["id"]).json()["amount"] == 1500
    again = refund(fake_provider, key="r2", payment_intent=pi["id"])
    assert refund_error(again) == (400, "invalid_request_error", "charge_already_refunded", None)
    assert again.json()["error"]["message"].endswith(" has already been refunded.")
    partial = refund(fake_provider, key="r3", payment_intent=pi["id"], amount="1")
    assert refund_error(partial)[2] == "charge_already_refunded"
    assert len(fake_provider.state.refunds()) == 1


def test_refund__declined_intent_has_no_successful_charge(fake_provider):
    pi = charged(fake_provider, payment_method="pm_card_chargeDeclined")
    response = refund(fake_provider, payment_intent=pi["id"])
    assert refund_error(response) == (
        400,
        "invalid_request_error",
        "payment_intent_unexpected_state",
        "payment_intent",
    )
    assert response.json()["error"]["message"] == (
        f"This PaymentIntent ({pi['id']}) does not have a successful charge to refund."
    )
    unconfirmed = charged(fake_provider, key="charge-2", confirm=None)
    assert refund_error(refund(fake_provider, key="r2", payment_intent=unconfirmed["id"]))[2] == (
        "payment_intent_unexpected_state"
    )
    assert fake_provider.state.refunds() == []


def test_refund__unknown_intent_is_resource_missing(fake_provider):
    response = refund(fake_provider, payment_intent="pi_missing")
    assert refund_error(response) == (
        400,
        "invalid_request_error",
        "resource_missing",
        "payment_intent",
    )


@pytest.mark.parametrize(
    ("form", "param", "code"),
    [
        ({"payment_intent": None}, "payment_intent", "parameter_missing"),
        ({"amount": "ten"}, "amount", "parameter_invalid_integer"),
        ({"amount": "0"}, "amount", "parameter_invalid_integer"),
        ({"reason": "changed_my_mind"}, "reason", None),
    ],
)
def test_refund__validation_400_not_stored(fake_provider, form, param, code):
    pi = charged(fake_provider)
    refused = refund(fake_provider, **({"payment_intent": pi["id"]} | form))
    assert refund_error(refused) == (400, "invalid_request_error", code, param)
    retried = refund(fake_provider, payment_intent=pi["id"])  # same key, valid: executes
    assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers


def test_refund__same_key_same_params_replays(fake_provider):
    pi = charged(fake_provider)
    first = refund(fake_provider, payment_intent=pi["id"], amount="700")
    again = refund(fake_provider, payment_intent=pi["id"], amount="700")
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert len(fake_provider.state.refunds()) == 1
    assert fake_provider.state.stats()["refunds"]["replays"] == 1


def test_refund__refusals_are_stored_for_the_key(fake_provider):
    pi = charged(fake_provider)
    refused = refund(fake_provider, payment_intent=pi["id"], amount="9999")
    replay = refund(fake_provider, payment_intent=pi["id"], amount="9999")
    assert replay.status_code == 400 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json() == refused.json()


def test_refund__same_key_other_params_is_idempotency_error(fake_provider):
    pi = charged(fake_provider)
    refund(fake_provider, payment_intent=pi["id"], amount="700")
    conflict = refund(fake_provider, payment_intent=pi["id"], amount="800")
    assert conflict.status_code == 400
    assert conflict.json()["error"]["type"] == "idempotency_error"
    assert [r["amount"] for r in fake_provider.state.refunds()] == [700]
    assert fake_provider.state.stats()["refunds"]["idempotency_conflicts"] == 1


def test_refund__key_of_another_endpoint_is_idempotency_error(fake_provider):
    pi = charged(fake_provider, key="shared-key")
    response = refund(fake_provider, key="shared-key", payment_intent=pi["id"])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "idempotency_error"
    assert "('/v1/refunds' vs '/v1/payment_intents')" in error["message"]
    assert fake_provider.state.refunds() == []
    # The intent's own replay is untouched.
    assert post(fake_provider, key="shared-key").headers["Idempotent-Replayed"] == "true"


def test_refund__in_flight_same_key_gets_409_then_replay(fake_provider):
    pi = charged(fake_provider)
    fake_provider.state.configure(slow_delay=0.3)
    fake_provider.state.enqueue_faults("slow")
    answers: list[requests.Response] = []
    first = threading.Thread(
        target=lambda: answers.append(refund(fake_provider, payment_intent=pi["id"]))
    )
    first.start()
    assert fake_provider.state.wait_for_in_flight(1, timeout=2)
    concurrent = refund(fake_provider, payment_intent=pi["id"])
    first.join(timeout=3)
    assert concurrent.status_code == 409
    assert concurrent.json()["error"]["code"] == "idempotency_key_in_use"
    assert concurrent.headers["Stripe-Should-Retry"] == "true"
    assert answers[0].status_code == 200
    replay = refund(fake_provider, payment_intent=pi["id"])
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == answers[0].json()["id"]
    assert len(fake_provider.state.refunds()) == 1


def test_refund__key_forgotten_after_key_retention(clocked, clock):
    pi = charged(clocked)
    first = refund(clocked, payment_intent=pi["id"], amount="100").json()
    clock.advance(3599)
    assert (
        refund(clocked, payment_intent=pi["id"], amount="100").headers.get("Idempotent-Replayed")
        == "true"
    )
    clock.advance(2)
    late = refund(clocked, payment_intent=pi["id"], amount="100")
    assert "Idempotent-Replayed" not in late.headers and late.json()["id"] != first["id"]
    assert len(clocked.state.refunds()) == 2


def test_refund__retrieve_found_and_404(fake_provider):
    pi = charged(fake_provider)
    created = refund(fake_provider, payment_intent=pi["id"]).json()
    assert get(fake_provider, f"/v1/refunds/{created['id']}").json() == created
    missing = get(fake_provider, "/v1/refunds/re_missing")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "resource_missing"
    assert missing.json()["error"]["type"] == "invalid_request_error"


def test_refund__list_by_intent_newest_first_with_pages(clocked, clock):
    pi = charged(clocked, key="c1")
    other = charged(clocked, key="c2")
    ids = []
    for n in range(5):
        ids.append(refund(clocked, key=f"r{n}", payment_intent=pi["id"], amount="100").json()["id"])
        clock.advance(10)
    refund(clocked, key="other", payment_intent=other["id"], amount="100")
    page = get(clocked, "/v1/refunds", payment_intent=pi["id"], limit=2).json()
    assert (page["object"], page["url"], page["has_more"]) == ("list", "/v1/refunds", True)
    seen = [r["id"] for r in page["data"]]
    while page["has_more"]:
        page = get(
            clocked, "/v1/refunds", payment_intent=pi["id"], limit=2, starting_after=seen[-1]
        ).json()
        seen += [r["id"] for r in page["data"]]
    assert seen == ids[::-1]
    back = get(clocked, "/v1/refunds", payment_intent=pi["id"], limit=2, ending_before=ids[2])
    assert [r["id"] for r in back.json()["data"]] == [ids[4], ids[3]]
    assert len(get(clocked, "/v1/refunds", limit=100).json()["data"]) == 6
    assert get(clocked, "/v1/refunds", payment_intent=other["id"]).json()["has_more"] is False
    assert get(clocked, "/v1/refunds", starting_after="re_gone").status_code == 400
    assert get(clocked, "/v1/refunds", limit=0).status_code == 400
    assert [r["id"] for r in clocked.state.refunds(payment_intent=pi["id"])] == ids


def test_refund__state_helper_filters_by_metadata(fake_provider):
    pi = charged(fake_provider)
    refund(fake_provider, key="a", payment_intent=pi["id"], amount="1", **{"metadata[op]": "1"})
    refund(fake_provider, key="b", payment_intent=pi["id"], amount="2", **{"metadata[op]": "2"})
    assert [r["amount"] for r in fake_provider.state.refunds(metadata={"op": "2"})] == [2]
    assert fake_provider.state.refunds(payment_intent="pi_other") == []


@pytest.mark.parametrize(
    ("mode", "status", "refunds", "replayed_status"),
    [
        ("rate_limit", 429, 0, None),
        ("fail_before", 500, 0, None),
        ("fail_after", 500, 1, 500),
    ],
)
def test_refund_fault__like_intent_creates(fake_provider, mode, status, refunds, replayed_status):
    pi = charged(fake_provider)
    fake_provider.state.enqueue_faults(mode)
    failed = refund(fake_provider, payment_intent=pi["id"])
    assert failed.status_code == status
    assert len(fake_provider.state.refunds()) == refunds
    retried = refund(fake_provider, payment_intent=pi["id"])
    if replayed_status is None:
        assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers
    else:
        assert retried.status_code == replayed_status
        assert retried.headers["Idempotent-Replayed"] == "true"
    assert len(fake_provider.state.refunds()) == 1
    stats = fake_provider.state.stats()
    assert stats["refunds"]["faults_injected"] == {mode: 1}
    assert stats["faults_injected"] == {} and stats["create_requests"] == 1


def test_refund_fault_drop_after_accept__refunds_stores_and_closes(fake_provider):
    pi = charged(fake_provider)
    fake_provider.state.enqueue_faults("drop_after_accept")
    with pytest.raises(requests.ConnectionError):
        refund(fake_provider, payment_intent=pi["id"])
    assert len(fake_provider.state.refunds()) == 1
    replay = refund(fake_provider, payment_intent=pi["id"])
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert len(fake_provider.state.refunds()) == 1


def test_refund_fault_slow__refunds_after_the_client_gave_up(fake_provider):
    pi = charged(fake_provider)
    fake_provider.state.configure(slow_delay=0.4)
    fake_provider.state.enqueue_faults("slow")
    with pytest.raises(requests.exceptions.ReadTimeout):
        refund(fake_provider, payment_intent=pi["id"], timeout=0.1)
    assert len(fake_provider.state.refunds()) == 1
    assert fake_provider.state.wait_idle(timeout=2)
    assert refund(fake_provider, payment_intent=pi["id"]).headers["Idempotent-Replayed"] == "true"


def test_refund__stats_count_refund_creates_and_reset_forgets_them(fake_provider):
    pi = charged(fake_provider)
    refund(fake_provider, payment_intent=pi["id"], amount="300")
    refund(fake_provider, payment_intent=pi["id"], amount="300")  # replay
    refund(fake_provider, key="r2", payment_intent=pi["id"], amount="9999")  # refused
    stats = fake_provider.state.stats()
    assert (stats["create_requests"], stats["replays"]) == (1, 0)  # intent creates only
    assert stats["refunds"] | {"faults_injected": None} == {
        "create_requests": 3,
        "count": 1,
        "amount": 300,
        "replays": 1,
        "idempotency_conflicts": 0,
        "in_flight_rejections": 0,
        "faults_injected": None,
        "by_status": {"succeeded": 1},
    }
    fake_provider.state.reset()
    assert fake_provider.state.refunds() == []
    assert fake_provider.state.stats()["refunds"]["create_requests"] == 0
    assert get(fake_provider, "/v1/refunds").json()["data"] == []


# --- control API ----------------------------------------------------------------------------


def test_control__faults_config_stats_reset_health(fake_provider):
    url = fake_provider.url + "/_fake"
    assert requests.get(url + "/health", timeout=2).json() == {"status": "ok"}
    assert requests.post(
        url + "/faults", json={"mode": "fail_after", "count": 2}, timeout=2
    ).json() == {"queued": 2}
    assert requests.post(url + "/faults", json={"mode": "explode"}, timeout=2).status_code == 400
    config = requests.post(url + "/config", json={"search_lag": 5, "slow_delay": 0.5}, timeout=2)
    assert config.json()["search_lag"] == 5
    assert requests.post(url + "/config", json={"slow_rate": 2}, timeout=2).status_code == 400
    post(fake_provider)
    post(fake_provider)
    stats = requests.get(url + "/stats", timeout=2).json()
    assert stats["create_requests"] == 2 and stats["replays"] == 1
    assert stats["intents_by_status"] == {"succeeded": 1}
    assert stats["faults_injected"] == {"fail_after": 1} and stats["faults_queued"] == [
        "fail_after"
    ]
    assert stats["in_flight"] == 0 and stats["config"]["api_key"] is None
    assert requests.post(url + "/reset", timeout=2).json() == {"reset": True}
    after = requests.get(url + "/stats", timeout=2).json()
    assert (
        after["intents"] == 0
        and after["faults_queued"] == []
        and after["config"]["search_lag"] == 5
    )


# --- the management command ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--slow-rate", "1.5"],
        ["--fail-before-rate", "-0.1"],
        ["--slow-rate", "0.6", "--fail-after-rate", "0.6"],
    ],
)
def test_command__rejects_bad_rates(args):
    with pytest.raises(CommandError):
        call_command("run_fake_provider", "--port", "0", *args)


def test_command__serves_until_sigterm_then_exits_cleanly():
    process = subprocess.Popen(
        [sys.executable, "manage.py", "run_fake_provider", "--port", "0", "--seed", "3"],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        url = line.split("listening on ", 1)[1].strip()
        assert requests.get(url + "/_fake/health", timeout=2).json() == {"status": "ok"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_timeline__every_success_to_the_microsecond_declines_left_out(clocked, clock):
    """`GET /_fake/timeline`: when each charge and refund succeeded (the chaos run's clock)."""
    clock.advance(0.25)
    intent = post(clocked, key="k-1").json()
    post(clocked, key="k-2", payment_method="pm_card_chargeDeclined")
    clock.advance(0.5)
    refunded = refund(clocked, payment_intent=intent["id"], amount="500").json()

    timeline = requests.get(clocked.url + "/_fake/timeline", timeout=2).json()["data"]

    assert [(row["object"], row["id"]) for row in timeline] == [
        ("payment_intent", intent["id"]),
        ("refund", refunded["id"]),
    ]
    assert timeline[0]["metadata"] == {"step": "checkout:order:1:charge"}
    assert timeline[1]["succeeded_at"] - timeline[0]["succeeded_at"] == pytest.approx(0.5)
    assert timeline[0]["succeeded_at"] != int(timeline[0]["succeeded_at"])  # not whole seconds


# --- confirm and cancel ------------------------------------------------------------------


def act(
    server: FakeProviderServer,
    pi_id: str,
    verb: str,
    key: str | None = None,
    timeout: float = 2,
    **form: Any,
) -> requests.Response:
    """POST /v1/payment_intents/{id}/confirm or /cancel."""
    headers = {**AUTH, **({"Idempotency-Key": key} if key else {})}
    return requests.post(
        f"{server.url}/v1/payment_intents/{pi_id}/{verb}",
        data={k: v for k, v in form.items() if v is not None},
        headers=headers,
        timeout=timeout,
    )


def unexpected_state(response: requests.Response) -> dict[str, Any]:
    """The error of a 400 payment_intent_unexpected_state (asserted)."""
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (
        "invalid_request_error",
        "payment_intent_unexpected_state",
    )
    return error


def test_decline__last_payment_error_names_the_payment_method(fake_provider):
    error = post(fake_provider, payment_method="pm_card_chargeDeclined").json()["error"]
    assert error["payment_method"] == {"id": "pm_card_chargeDeclined", "object": "payment_method"}
    intent = error["payment_intent"]
    assert intent["last_payment_error"]["payment_method"]["id"] == "pm_card_chargeDeclined"
    # Stripe detaches the declined method: the next attempt needs one.
    assert intent["payment_method"] is None


def test_confirm__after_decline_succeeds_with_a_good_card(fake_provider):
    declined = charged(fake_provider, payment_method="pm_card_chargeDeclined")
    confirmed = act(fake_provider, declined["id"], "confirm", "c-1", payment_method="pm_card_visa")
    assert confirmed.status_code == 200
    body = confirmed.json()
    assert (body["id"], body["status"], body["amount_received"]) == (
        declined["id"],
        "succeeded",
        1500,
    )
    assert body["payment_method"] == "pm_card_visa" and body["last_payment_error"] is None
    assert body["latest_charge"].startswith("ch_")
    assert fake_provider.state.succeeded_count() == 1
    assert [e["type"] for e in fake_provider.state.events()] == [
        "payment_intent.payment_failed",
        "payment_intent.succeeded",
    ]
    # The charge is real: it can be refunded.
    assert refund(fake_provider, payment_intent=declined["id"]).status_code == 200


def test_confirm__declining_card_is_402_and_back_to_requires_payment_method(fake_provider):
    pi = post(fake_provider, confirm=None, payment_method=None).json()
    assert pi["status"] == "requires_payment_method"
    declined = act(fake_provider, pi["id"], "confirm", payment_method="pm_card_chargeDeclined")
    assert declined.status_code == 402
    error = declined.json()["error"]
    assert (error["type"], error["code"], error["decline_code"]) == (
        "card_error",
        "card_declined",
        "generic_decline",
    )
    assert error["payment_intent"]["status"] == "requires_payment_method"
    assert error["payment_intent"]["last_payment_error"]["payment_method"]["id"] == (
        "pm_card_chargeDeclined"
    )
    assert [e["type"] for e in fake_provider.state.events()] == ["payment_intent.payment_failed"]
    # Without a method of its own left, confirming needs one.
    error = unexpected_state(act(fake_provider, pi["id"], "confirm"))
    assert "missing a payment method" in error["message"]


def test_confirm__requires_confirmation_intent_charges_its_own_method(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    assert pi["status"] == "requires_confirmation"
    confirmed = act(fake_provider, pi["id"], "confirm")
    assert confirmed.status_code == 200 and confirmed.json()["status"] == "succeeded"


def test_confirm__succeeded_intent_refuses_with_unexpected_state(fake_provider):
    pi = charged(fake_provider)
    error = unexpected_state(act(fake_provider, pi["id"], "confirm"))
    assert error["message"] == (
        "You cannot confirm this PaymentIntent because it has already succeeded after being "
        "previously confirmed."
    )
    assert error["payment_intent"] == pi
    with_method = unexpected_state(
        act(fake_provider, pi["id"], "confirm", payment_method="pm_card_visa")
    )
    assert with_method["message"].startswith(
        "This PaymentIntent's payment_method could not be updated because it has a status of "
        "succeeded."
    )
    assert with_method["payment_intent"]["status"] == "succeeded"
    assert fake_provider.state.succeeded_count() == 1
    assert [e["type"] for e in fake_provider.state.events()] == ["payment_intent.succeeded"]


def test_confirm__missing_intent_is_404_and_unknown_method_400(fake_provider):
    missing = act(fake_provider, "pi_missing", "confirm", payment_method="pm_card_visa")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "resource_missing"
    pi = post(fake_provider, confirm=None).json()
    unknown = act(fake_provider, pi["id"], "confirm", payment_method="pm_card_unknown")
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "payment_method"


def test_confirm__replays_by_key_and_keys_are_scoped_to_the_intents_confirm(fake_provider):
    first = charged(fake_provider, key="c1", payment_method="pm_card_chargeDeclined")
    second = charged(fake_provider, key="c2", payment_method="pm_card_chargeDeclined")
    confirmed = act(
        fake_provider, first["id"], "confirm", "confirm-1", payment_method="pm_card_visa"
    )
    again = act(fake_provider, first["id"], "confirm", "confirm-1", payment_method="pm_card_visa")
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == confirmed.json()
    other_params = act(
        fake_provider, first["id"], "confirm", "confirm-1", payment_method="pm_card_mastercard"
    )
    assert other_params.status_code == 400
    assert other_params.json()["error"]["type"] == "idempotency_error"
    other_intent = act(
        fake_provider, second["id"], "confirm", "confirm-1", payment_method="pm_card_visa"
    )
    assert other_intent.status_code == 400
    error = other_intent.json()["error"]
    assert error["type"] == "idempotency_error" and "same endpoint" in error["message"]
    assert fake_provider.state.succeeded_count() == 1
    stats = fake_provider.state.stats()
    assert stats["confirm_requests"] == 4
    assert stats["confirm"]["replays"] == 1 and stats["confirm"]["idempotency_conflicts"] == 2


def test_confirm__in_flight_same_key_gets_409_then_replay(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    fake_provider.state.configure(slow_delay=0.3)
    fake_provider.state.enqueue_faults("slow")
    answers: list[requests.Response] = []
    worker = threading.Thread(
        target=lambda: answers.append(act(fake_provider, pi["id"], "confirm", "slow-1"))
    )
    worker.start()
    assert fake_provider.state.wait_for_in_flight(1, timeout=2)
    concurrent = act(fake_provider, pi["id"], "confirm", "slow-1")
    worker.join(timeout=3)
    assert concurrent.status_code == 409
    assert concurrent.json()["error"]["code"] == "idempotency_key_in_use"
    assert answers[0].status_code == 200
    assert (
        act(fake_provider, pi["id"], "confirm", "slow-1").headers["Idempotent-Replayed"] == "true"
    )


@pytest.mark.parametrize(
    ("mode", "status", "charges", "replayed_status"),
    [
        ("rate_limit", 429, 0, None),
        ("fail_before", 500, 0, None),
        ("fail_after", 500, 1, 500),
    ],
)
def test_confirm_fault__like_creates(fake_provider, mode, status, charges, replayed_status):
    pi = post(fake_provider, confirm=None).json()
    fake_provider.state.enqueue_faults(mode)
    failed = act(fake_provider, pi["id"], "confirm", "fault-1")
    assert failed.status_code == status
    assert fake_provider.state.succeeded_count() == charges
    retried = act(fake_provider, pi["id"], "confirm", "fault-1")
    if replayed_status is None:
        assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers
    else:
        assert retried.status_code == replayed_status
        assert retried.headers["Idempotent-Replayed"] == "true"
    assert fake_provider.state.succeeded_count() == 1
    assert fake_provider.state.stats()["confirm"]["faults_injected"] == {mode: 1}


def test_confirm_fault_drop_after_accept__charges_and_closes(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    fake_provider.state.enqueue_faults("drop_after_accept")
    with pytest.raises(requests.ConnectionError):
        act(fake_provider, pi["id"], "confirm", "drop-1")
    assert fake_provider.state.succeeded_count() == 1
    replay = act(fake_provider, pi["id"], "confirm", "drop-1")
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"


def test_cancel__requires_payment_method_intent_is_canceled_with_event(clocked, clock):
    pi = charged(clocked, payment_method="pm_card_chargeDeclined")
    clock.advance(5)
    canceled = act(clocked, pi["id"], "cancel", "cancel-1", cancellation_reason="abandoned")
    assert canceled.status_code == 200
    body = canceled.json()
    assert (body["status"], body["cancellation_reason"]) == ("canceled", "abandoned")
    assert body["canceled_at"] == int(clock.now)
    [event] = clocked.state.events(type="payment_intent.canceled")
    assert event["data"]["object"] == body
    replay = act(clocked, pi["id"], "cancel", "cancel-1", cancellation_reason="abandoned")
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.json() == body
    stats = clocked.state.stats()
    assert (stats["cancel_requests"], stats["cancels"]) == (2, 1)
    assert stats["intents_by_status"] == {"canceled": 1}


def test_cancel__without_key_or_reason_and_from_requires_confirmation(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    canceled = act(fake_provider, pi["id"], "cancel")
    assert canceled.status_code == 200
    assert (canceled.json()["status"], canceled.json()["cancellation_reason"]) == ("canceled", None)


def test_cancel__succeeded_intent_refuses_with_unexpected_state(fake_provider):
    pi = charged(fake_provider)
    error = unexpected_state(act(fake_provider, pi["id"], "cancel"))
    assert error["message"] == (
        "You cannot cancel this PaymentIntent because it has a status of succeeded. Only a "
        "PaymentIntent with one of the following statuses may be canceled: "
        "requires_payment_method, requires_capture, requires_confirmation, requires_action, "
        "processing."
    )
    assert error["payment_intent"] == pi
    assert fake_provider.state.events(type="payment_intent.canceled") == []


def test_cancel__canceled_intent_refuses_cancel_and_confirm(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    assert act(fake_provider, pi["id"], "cancel").status_code == 200
    again = unexpected_state(act(fake_provider, pi["id"], "cancel"))
    assert "has a status of canceled" in again["message"]
    confirm = unexpected_state(act(fake_provider, pi["id"], "confirm"))
    assert confirm["message"].startswith(
        "You cannot confirm this PaymentIntent because it has a status of canceled."
    )
    assert confirm["payment_intent"]["status"] == "canceled"
    assert fake_provider.state.succeeded_count() == 0


def test_cancel__bad_reason_is_400_and_missing_intent_404(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    bad = act(fake_provider, pi["id"], "cancel", cancellation_reason="bored")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "cancellation_reason"
    assert act(fake_provider, "pi_missing", "cancel").status_code == 404
    assert get(fake_provider, f"/v1/payment_intents/{pi['id']}").json()["status"] == (
        "requires_confirmation"
    )


def test_cancel__draws_no_faults(fake_provider):
    pi = post(fake_provider, confirm=None).json()
    fake_provider.state.enqueue_faults("fail_before")
    assert act(fake_provider, pi["id"], "cancel").status_code == 200
    assert fake_provider.state.stats()["faults_queued"] == ["fail_before"]


def test_timeline__intent_that_succeeds_through_confirm_is_listed_when_it_succeeds(clocked, clock):
    later = post(clocked, key="k-1", confirm=None).json()
    clock.advance(1)
    first = post(clocked, key="k-2").json()
    clock.advance(2)
    act(clocked, later["id"], "confirm")
    timeline = clocked.state.timeline()
    assert [row["id"] for row in timeline] == [first["id"], later["id"]]
    assert timeline[1]["succeeded_at"] - timeline[0]["succeeded_at"] == pytest.approx(2)


# --- list windows --------------------------------------------------------------------------


def test_list__created_windows_combine_with_cursor_pages(clocked, clock):
    start = int(clock.now)
    ids = []
    for n in range(6):
        ids.append(post(clocked, key=f"w{n}").json()["id"])
        clock.advance(10)
    # Created at start, start+10, ... start+50; newest first.
    window = {"created[gte]": start + 10, "created[lte]": start + 40}

    def walk(**params: Any) -> list[str]:
        page = get(clocked, "/v1/payment_intents", limit=2, **window, **params).json()
        seen = [pi["id"] for pi in page["data"]]
        while page["has_more"]:
            page = get(
                clocked, "/v1/payment_intents", limit=2, starting_after=seen[-1], **window
            ).json()
            seen += [pi["id"] for pi in page["data"]]
        return seen

    assert walk() == ids[1:5][::-1]
    strict = {"created[gt]": start + 10, "created[lt]": start + 40}
    assert [pi["id"] for pi in get(clocked, "/v1/payment_intents", **strict).json()["data"]] == [
        ids[3],
        ids[2],
    ]
    exact = get(clocked, "/v1/payment_intents", created=start + 20).json()
    assert [pi["id"] for pi in exact["data"]] == [ids[2]]
    back = get(clocked, "/v1/payment_intents", limit=2, ending_before=ids[2], **window).json()
    assert ([pi["id"] for pi in back["data"]], back["has_more"]) == ([ids[4], ids[3]], False)
    first_page = get(clocked, "/v1/payment_intents", limit=3, **window).json()
    assert first_page["has_more"] is True and len(first_page["data"]) == 3
    bad = get(clocked, "/v1/payment_intents", **{"created[gte]": "yesterday"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "created[gte]"


# --- refund states ---------------------------------------------------------------------------


def control(server: FakeProviderServer, path: str, **body: Any) -> requests.Response:
    return requests.post(f"{server.url}/_fake/{path}", json=body, timeout=2)


def test_refund_pending__holds_its_amount_until_it_succeeds(fake_provider):
    fake_provider.state.configure(refund_status="pending")
    pi = charged(fake_provider)
    pending = refund(fake_provider, payment_intent=pi["id"]).json()
    assert (pending["status"], pending["failure_reason"]) == ("pending", None)
    assert pending["failure_balance_transaction"] is None
    # The whole charge is held by the pending refund: nothing is left to refund.
    again = refund(fake_provider, key="refund-2", payment_intent=pi["id"], amount="1")
    assert refund_error(again)[2] == "charge_already_refunded"
    assert [e["type"] for e in fake_provider.state.events()][1:] == ["refund.created"]
    succeeded = control(fake_provider, f"refunds/{pending['id']}/succeed")
    assert succeeded.status_code == 200 and succeeded.json()["status"] == "succeeded"
    assert get(fake_provider, f"/v1/refunds/{pending['id']}").json()["status"] == "succeeded"
    assert [e["type"] for e in fake_provider.state.events()][2:] == [
        "refund.updated",
        "charge.refunded",
    ]
    assert control(fake_provider, f"refunds/{pending['id']}/succeed").status_code == 400


def test_refund_fail__after_success_gives_the_amount_back_and_emits_refund_failed(fake_provider):
    pi = charged(fake_provider)
    made = refund(fake_provider, payment_intent=pi["id"], amount="1000").json()
    assert made["status"] == "succeeded"
    failed = fake_provider.state.fail_refund(made["id"])
    assert (failed["status"], failed["failure_reason"]) == ("failed", "lost_or_stolen_card")
    assert failed["failure_balance_transaction"].startswith("txn_")
    assert get(fake_provider, f"/v1/refunds/{made['id']}").json() == failed
    [updated, refund_failed] = [
        e for e in fake_provider.state.events() if e["type"] in ("refund.updated", "refund.failed")
    ]
    assert (updated["type"], refund_failed["type"]) == ("refund.updated", "refund.failed")
    assert refund_failed["data"]["object"] == failed
    # The amount is back on the charge: the whole charge can be refunded again.
    whole = refund(fake_provider, key="refund-again", payment_intent=pi["id"])
    assert whole.status_code == 200 and whole.json()["amount"] == 1500
    stats = fake_provider.state.stats()["refunds"]
    assert (stats["amount"], stats["by_status"]) == (1500, {"failed": 1, "succeeded": 1})


def test_refund_fail__pending_refund_fails_over_the_control_api(fake_provider):
    fake_provider.state.configure(refund_status="pending")
    pi = charged(fake_provider)
    pending = refund(fake_provider, payment_intent=pi["id"], amount="500").json()
    failed = control(
        fake_provider, f"refunds/{pending['id']}/fail", reason="expired_or_canceled_card"
    )
    assert failed.status_code == 200
    assert (failed.json()["status"], failed.json()["failure_reason"]) == (
        "failed",
        "expired_or_canceled_card",
    )
    assert fake_provider.state.events(type="charge.refunded") == []
    assert len(fake_provider.state.events(type="refund.failed")) == 1
    # A failed refund cannot fail or succeed again; unknown ones are 404.
    assert control(fake_provider, f"refunds/{pending['id']}/fail").status_code == 400
    assert control(fake_provider, f"refunds/{pending['id']}/succeed").status_code == 400
    assert control(fake_provider, "refunds/re_missing/fail").status_code == 404
    assert (
        control(fake_provider, f"refunds/{pending['id']}/fail", reason="bored").status_code == 400
    )
    assert refund(fake_provider, key="r-2", payment_intent=pi["id"]).json()["amount"] == 1500
    # Neither pending refund ever succeeded: the timeline has the charge alone.
    assert [row["object"] for row in fake_provider.state.timeline()] == ["payment_intent"]


def test_refund_config__rejects_unknown_start_status(fake_provider):
    with pytest.raises(ValueError):
        fake_provider.state.configure(refund_status="failed")
    with pytest.raises(ValueError):
        fake_provider.state.configure(refund_fail_after=-1)
    assert control(fake_provider, "config", refund_status="requires_action").status_code == 400


def test_refund_fail_after__fails_each_refund_that_long_after_it_succeeded(clocked, clock):
    clocked.state.configure(refund_fail_after=60)
    pi = charged(clocked)
    made = refund(clocked, payment_intent=pi["id"], amount="100").json()
    clock.advance(59)
    assert get(clocked, f"/v1/refunds/{made['id']}").json()["status"] == "succeeded"
    clock.advance(1)
    failed = get(clocked, f"/v1/refunds/{made['id']}").json()
    assert (failed["status"], failed["failure_reason"]) == ("failed", "lost_or_stolen_card")
    assert [e["type"] for e in clocked.state.events()][-2:] == ["refund.updated", "refund.failed"]


class Recorder:
    """An event sink: what the fake hands its webhook sender, without any request."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.failed = threading.Event()

    def submit(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if event["type"] == "refund.failed":
            self.failed.set()

    def clear(self) -> None:
        self.events.clear()


def test_refund_fail_after__a_thread_fails_them_and_tells_the_sinks():
    sink = Recorder()
    with FakeProviderServer(refund_fail_after=0.2) as server:
        server.state.add_event_sink(sink)
        pi = charged(server)
        made = refund(server, payment_intent=pi["id"], amount="100").json()
        assert sink.failed.wait(timeout=3)  # no request in between: the thread did it
        assert [e["type"] for e in sink.events][-2:] == ["refund.updated", "refund.failed"]
        assert sink.events[-1]["data"]["object"]["id"] == made["id"]
        again = refund(server, key="refund-2", payment_intent=pi["id"], amount="100").json()
        server.state.reset()  # forgets the scheduled failure with the refunds
        time.sleep(0.3)
        assert sink.events == []
        assert server.state.refunds() == [] and again["status"] == "succeeded"
    assert not [t for t in threading.enumerate() if t.name == "fake-provider-refund-failures"]


# --- manual capture ---------------------------------------------------------------------------


def held(server: FakeProviderServer, key: str = "hold-1", **changes: Any) -> dict[str, Any]:
    """A manual intent authorised and waiting in requires_capture."""
    body = post(server, key=key, capture_method="manual", **changes).json()
    assert body["status"] == "requires_capture", body
    return body


def test_capture_method__manual_authorises_and_unknown_is_refused_unstored(fake_provider):
    body = held(fake_provider)
    assert (body["capture_method"], body["amount_capturable"], body["amount_received"]) == (
        "manual",
        1500,
        0,
    )
    assert body["latest_charge"].startswith("ch_")
    [event] = fake_provider.state.events()
    assert event["type"] == "payment_intent.amount_capturable_updated"
    assert event["data"]["object"] == body
    paid = post(fake_provider, key="auto-1").json()
    assert (paid["capture_method"], paid["amount_capturable"], paid["amount_received"]) == (
        "automatic",
        0,
        1500,
    )
    odd = post(fake_provider, key="odd-1", capture_method="automatic_later")
    assert odd.status_code == 400
    assert (odd.json()["error"]["type"], odd.json()["error"]["param"]) == (
        "invalid_request_error",
        "capture_method",
    )
    # A parameter refusal is never stored: the key still executes once corrected.
    assert post(fake_provider, key="odd-1", capture_method="manual").status_code == 200


def test_capture_method__manual_declines_as_automatic_and_confirm_authorises(fake_provider):
    declined = post(
        fake_provider, key="d-1", capture_method="manual", payment_method="pm_card_chargeDeclined"
    )
    assert declined.status_code == 402
    pi = declined.json()["error"]["payment_intent"]
    assert (pi["status"], pi["amount_capturable"]) == ("requires_payment_method", 0)
    confirmed = act(fake_provider, pi["id"], "confirm", "c-1", payment_method="pm_card_visa")
    assert (confirmed.json()["status"], confirmed.json()["amount_capturable"]) == (
        "requires_capture",
        1500,
    )
    assert fake_provider.state.succeeded_count() == 0


def test_capture__partial_with_metadata_merge_replays_and_keys_are_scoped(fake_provider):
    first, second = held(fake_provider, "h1"), held(fake_provider, "h2")
    form = {"amount_to_capture": "600", "metadata[shipped]": "yes", "metadata[step]": ""}
    captured = act(fake_provider, first["id"], "capture", "cap-1", **form)
    assert captured.status_code == 200
    body = captured.json()
    assert (body["status"], body["amount_received"], body["amount_capturable"]) == (
        "succeeded",
        600,
        0,
    )
    # An empty value removes the key, as a Stripe metadata update does.
    assert body["metadata"] == {"shipped": "yes"}
    again = act(fake_provider, first["id"], "capture", "cap-1", **form)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json() == body
    other = act(fake_provider, first["id"], "capture", "cap-1", amount_to_capture="700")
    assert other.json()["error"]["type"] == "idempotency_error"
    elsewhere = act(fake_provider, second["id"], "capture", "cap-1", **form)
    assert "same endpoint" in elsewhere.json()["error"]["message"]
    [event] = fake_provider.state.events(type="payment_intent.succeeded")
    assert event["data"]["object"] == body
    stats = fake_provider.state.stats()
    assert stats["capture_requests"] == 4
    assert stats["capture"]["replays"] == 1 and stats["capture"]["idempotency_conflicts"] == 2


def test_capture__refusals_carry_the_intent_and_are_stored_under_the_key(fake_provider):
    pi = held(fake_provider)
    too_much = act(fake_provider, pi["id"], "capture", "cap-big", amount_to_capture="1501")
    error = too_much.json()["error"]
    assert too_much.status_code == 400
    assert (error["code"], error["param"], error["payment_intent"]["id"]) == (
        "amount_too_large",
        "amount_to_capture",
        pi["id"],
    )
    assert (
        act(fake_provider, pi["id"], "capture", "cap-big", amount_to_capture="1501").headers[
            "Idempotent-Replayed"
        ]
        == "true"
    )
    bad = act(fake_provider, pi["id"], "capture", "cap-zero", amount_to_capture="0")
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "amount_to_capture")
    act(fake_provider, pi["id"], "capture")
    twice = unexpected_state(act(fake_provider, pi["id"], "capture"))
    assert twice["payment_intent"]["status"] == "succeeded"
    assert "may be captured: requires_capture" in twice["message"]
    unpaid = unexpected_state(
        act(fake_provider, post(fake_provider, "k", confirm=None).json()["id"], "capture")
    )
    assert unpaid["payment_intent"]["status"] == "requires_confirmation"
    assert act(fake_provider, "pi_missing", "capture").status_code == 404


def test_cancel__releases_a_held_authorisation(fake_provider):
    pi = held(fake_provider)
    canceled = act(fake_provider, pi["id"], "cancel", "cancel-1")
    body = canceled.json()
    assert (body["status"], body["amount_capturable"], body["amount_received"]) == (
        "canceled",
        0,
        0,
    )
    [event] = fake_provider.state.events(type="payment_intent.canceled")
    assert event["data"]["object"] == body


def test_refund__of_a_manual_intent_waits_for_capture_and_reaches_only_what_was_taken(
    fake_provider,
):
    pi = held(fake_provider)
    uncaptured = refund(fake_provider, payment_intent=pi["id"]).json()["error"]
    assert uncaptured["code"] == "payment_intent_unexpected_state"
    act(fake_provider, pi["id"], "capture", amount_to_capture="1000")
    too_much = refund(fake_provider, "refund-2", payment_intent=pi["id"], amount="1001")
    assert too_much.json()["error"]["code"] == "amount_too_large"
    assert "charge amount (€10.00)" in too_much.json()["error"]["message"]
    rest = refund(fake_provider, "refund-3", payment_intent=pi["id"]).json()
    assert rest["amount"] == 1000
    [charge] = fake_provider.state.events(type="charge.refunded")
    charge_object = charge["data"]["object"]
    assert (charge_object["amount_captured"], charge_object["refunded"]) == (1000, True)


@pytest.mark.parametrize(
    ("mode", "status", "captures", "replayed_status"),
    [
        ("rate_limit", 429, 0, None),
        ("fail_before", 500, 0, None),
        ("fail_after", 500, 1, 500),
    ],
)
def test_capture_fault__like_confirms(fake_provider, mode, status, captures, replayed_status):
    pi = held(fake_provider)
    fake_provider.state.enqueue_faults(mode)
    failed = act(fake_provider, pi["id"], "capture", "fault-1")
    assert failed.status_code == status
    assert fake_provider.state.succeeded_count() == captures
    retried = act(fake_provider, pi["id"], "capture", "fault-1")
    if replayed_status is None:
        assert retried.status_code == 200 and "Idempotent-Replayed" not in retried.headers
    else:
        assert retried.status_code == replayed_status
        assert retried.headers["Idempotent-Replayed"] == "true"
    assert fake_provider.state.succeeded_count() == 1
    assert fake_provider.state.stats()["capture"]["faults_injected"] == {mode: 1}


def test_capture_fault__drop_captures_and_a_slow_one_holds_its_key_in_flight(fake_provider):
    dropped, slow = held(fake_provider, "h1"), held(fake_provider, "h2")
    fake_provider.state.enqueue_faults("drop_after_accept")
    with pytest.raises(requests.ConnectionError):
        act(fake_provider, dropped["id"], "capture", "drop-1")
    assert fake_provider.state.succeeded_count() == 1
    replay = act(fake_provider, dropped["id"], "capture", "drop-1")
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    fake_provider.state.configure(slow_delay=0.3)
    fake_provider.state.enqueue_faults("slow")
    answers: list[requests.Response] = []
    worker = threading.Thread(
        target=lambda: answers.append(act(fake_provider, slow["id"], "capture", "slow-1"))
    )
    worker.start()
    assert fake_provider.state.wait_for_in_flight(1, timeout=2)
    concurrent = act(fake_provider, slow["id"], "capture", "slow-1")
    worker.join(timeout=3)
    assert concurrent.status_code == 409
    assert concurrent.json()["error"]["code"] == "idempotency_key_in_use"
    assert answers[0].status_code == 200 and answers[0].json()["status"] == "succeeded"
    assert fake_provider.state.stats()["capture"]["faults_injected"] == {
        "drop_after_accept": 1,
        "slow": 1,
    }


def test_capture__manual_intents_are_listed_searched_and_timed_at_capture(clocked, clock):
    pi = held(clocked)
    clock.advance(40)  # past the search lag
    listed = get(clocked, "/v1/payment_intents").json()["data"]
    assert [(p["id"], p["amount_capturable"]) for p in listed] == [(pi["id"], 1500)]
    found = get(clocked, "/v1/payment_intents/search", query="status:'requires_capture'").json()[
        "data"
    ]
    assert [p["id"] for p in found] == [pi["id"]]
    assert clocked.state.timeline() == []
    act(clocked, pi["id"], "capture", amount_to_capture="500")
    fetched = get(clocked, f"/v1/payment_intents/{pi['id']}").json()
    assert (fetched["status"], fetched["amount_received"]) == ("succeeded", 500)
    [row] = clocked.state.timeline()
    assert row["id"] == pi["id"] and row["succeeded_at"] == pytest.approx(clock.now)


def test_incident__requests_held_in_flight_until_it_ends__reads_answered(fake_provider):
    """`POST /_fake/incident`: a new charge is executed and held; its key answers 409
    meanwhile; the list shows the intent; when the incident ends, the held answer comes."""
    started = requests.post(
        fake_provider.url + "/_fake/incident", json={"seconds": 2, "drop_rate": 0}, timeout=2
    )
    assert started.json()["active"] is True

    with pytest.raises(requests.exceptions.ReadTimeout):
        post(fake_provider, key="held-1", timeout=0.5)
    busy = post(fake_provider, key="held-1")
    listed = get(fake_provider, "/v1/payment_intents").json()["data"]

    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "idempotency_key_in_use"
    assert [i["status"] for i in listed] == ["succeeded"]
    assert fake_provider.state.wait_idle(timeout=5)
    replayed = post(fake_provider, key="held-1")
    assert replayed.status_code == 200
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert fake_provider.state.stats()["incident"]["active"] is False


def test_incident__drops_answers_at_its_rate(fake_provider):
    fake_provider.state.start_incident(5, drop_rate=1.0)

    with pytest.raises(requests.exceptions.ConnectionError):
        post(fake_provider, key="dropped-1")

    assert fake_provider.state.stats()["faults_injected"] == {"drop_after_accept": 1}
    assert post(fake_provider, key="dropped-1").headers["Idempotent-Replayed"] == "true"
