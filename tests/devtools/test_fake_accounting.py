"""The fake accounting API keeps its documented contract (devtools.fake_provider.accounting).

Real HTTP against a real server on a free port; the clock is injected to age keys.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from django.core.management import CommandError, call_command

from devtools.fake_provider.accounting.server import FakeAccountingServer

API_KEY = "acct_test_key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake(clock: Clock) -> Iterator[FakeAccountingServer]:
    with FakeAccountingServer(api_key=API_KEY, clock=clock, slow_delay=1.0) as server:
        yield server


def invoice(**changes: Any) -> dict[str, Any]:
    body = {
        "external_id": "order-42",
        "customer": "cust-7",
        "currency": "eur",
        "lines": [{"description": "Order 42", "amount": 2000}],
        "total": 2000,
    }
    return {**body, **changes}


def create(fake, key: str = "k-1", body: Any = None, **kwargs: Any) -> requests.Response:
    return requests.post(
        f"{fake.url}/v1/invoices",
        json=invoice() if body is None else body,
        headers={**AUTH, "Idempotency-Key": key},
        timeout=kwargs.pop("timeout", 5),
        **kwargs,
    )


def listed(fake, external_id: str = "order-42") -> list[dict[str, Any]]:
    answer = requests.get(
        f"{fake.url}/v1/invoices", params={"external_id": external_id}, headers=AUTH, timeout=5
    )
    assert answer.status_code == 200
    return answer.json()["data"]


def test_create__201_with_an_open_invoice__listed_and_retrieved(fake):
    answer = create(fake)

    assert answer.status_code == 201
    made = answer.json()
    assert made["id"].startswith("inv_") and made["status"] == "open"
    assert (made["external_id"], made["total"], made["currency"]) == ("order-42", 2000, "eur")
    assert [i["id"] for i in listed(fake)] == [made["id"]]
    assert listed(fake, "order-43") == []
    got = requests.get(f"{fake.url}/v1/invoices/{made['id']}", headers=AUTH, timeout=5)
    assert got.json() == made
    missing = requests.get(f"{fake.url}/v1/invoices/inv_nope", headers=AUTH, timeout=5)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")


def test_same_key_same_body__replays_the_stored_answer_once_executed(fake):
    first = create(fake)
    # The same JSON in another key order and spacing is the same body.
    again = requests.post(
        f"{fake.url}/v1/invoices",
        data='{"total": 2000, "lines": [{"amount": 2000, "description": "Order 42"}], '
        '"currency": "eur", "customer": "cust-7", "external_id": "order-42"}',
        headers={**AUTH, "Idempotency-Key": "k-1", "Content-Type": "application/json"},
        timeout=5,
    )

    assert (again.status_code, again.json()) == (201, first.json())
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert len(fake.state.invoices()) == 1


def test_same_key_other_body__422_idempotency_key_reused__nothing_executed(fake):
    create(fake)

    answer = create(fake, body=invoice(total=2500, lines=[{"description": "x", "amount": 2500}]))

    assert answer.status_code == 422
    assert answer.json()["error"]["code"] == "idempotency_key_reused"
    assert len(fake.state.invoices()) == 1


def test_key_in_flight__409__then_the_held_request_completes_once(fake):
    fake.state.enqueue_faults("hold")
    held: dict[str, requests.Response] = {}
    thread = threading.Thread(target=lambda: held.setdefault("answer", create(fake)))
    thread.start()
    while fake.state.stats()["held"] == 0:
        threading.Event().wait(0.01)

    answer = create(fake)

    assert (answer.status_code, answer.json()["error"]["code"]) == (409, "request_in_progress")
    assert fake.state.invoices() == []  # executed only once released
    assert requests.post(f"{fake.url}/_fake/release", timeout=5).json() == {"released": 1}
    thread.join(5)
    assert held["answer"].status_code == 201
    assert len(fake.state.invoices()) == 1


def test_drop_after_commit__the_client_sees_a_reset__the_invoice_exists_and_replays(fake):
    requests.post(f"{fake.url}/_fake/faults", json={"mode": "drop_after_commit"}, timeout=5)

    with pytest.raises(requests.ConnectionError):
        create(fake)

    (made,) = listed(fake)
    replay = create(fake)
    assert (replay.status_code, replay.json()["id"]) == (201, made["id"])
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_fail_after_commit__500_stored_under_the_key__only_the_list_tells(fake):
    fake.state.enqueue_faults("fail_after_commit")

    answer = create(fake)
    replay = create(fake)

    assert answer.status_code == 500
    assert (replay.status_code, replay.headers["Idempotent-Replayed"]) == (500, "true")
    assert len(listed(fake)) == 1


def test_slow__the_client_times_out_on_a_created_invoice__the_key_in_flight_meanwhile(fake):
    fake.state.enqueue_faults("slow")

    with pytest.raises(requests.ReadTimeout):
        create(fake, timeout=0.3)

    assert len(listed(fake)) == 1
    assert create(fake).status_code == 409  # still held for slow_delay
    threading.Event().wait(1.0)
    assert create(fake).headers.get("Idempotent-Replayed") == "true"


def test_past_the_key_retention__the_same_request_executes_again(fake, clock):
    fake.state.configure(key_retention=60)
    create(fake)
    clock.now += 59
    assert create(fake).headers.get("Idempotent-Replayed") == "true"

    clock.now += 1
    again = create(fake)

    assert "Idempotent-Replayed" not in again.headers
    assert len(listed(fake)) == 2  # a second invoice: the key was forgotten


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": API_KEY}])
def test_without_a_valid_key__401__nothing_executed(fake, headers):
    answer = requests.post(
        f"{fake.url}/v1/invoices",
        json=invoice(),
        headers={**headers, "Idempotency-Key": "k"},
        timeout=5,
    )

    assert (answer.status_code, answer.json()["error"]["code"]) == (401, "unauthorized")
    assert fake.state.invoices() == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("not json", "body"),
        (invoice(external_id=""), "external_id"),
        (invoice(currency="euro"), "currency"),
        (invoice(lines=[]), "lines"),
        (invoice(lines=[{"description": "x", "amount": "20"}]), "lines[0]"),
        (invoice(total=1999), "total"),
    ],
)
def test_malformed_body__400__not_stored_under_the_key(fake, body, param):
    sent = {"data": body} if isinstance(body, str) else {"json": body}
    answer = requests.post(
        f"{fake.url}/v1/invoices", headers={**AUTH, "Idempotency-Key": "k-1"}, timeout=5, **sent
    )

    assert answer.status_code == 400
    assert answer.json()["error"] == {**answer.json()["error"], "param": param}
    assert create(fake).status_code == 201  # the key was not taken by the refusal


def test_no_idempotency_key__400(fake):
    answer = requests.post(f"{fake.url}/v1/invoices", json=invoice(), headers=AUTH, timeout=5)

    assert answer.json()["error"]["code"] == "idempotency_key_invalid"


def test_control_api__health_stats_reset(fake):
    create(fake)
    assert requests.get(f"{fake.url}/_fake/health", timeout=5).json()["contract"] == "accounting"
    assert requests.get(f"{fake.url}/_fake/stats", timeout=5).json()["invoices"] == 1
    assert requests.post(f"{fake.url}/_fake/reset", timeout=5).json() == {"reset": True}
    assert requests.get(f"{fake.url}/_fake/invoices", timeout=5).json() == {"data": []}
    bad = requests.post(f"{fake.url}/_fake/faults", json={"mode": "nope"}, timeout=5)
    assert bad.status_code == 400


def test_command__accounting_refuses_another_contracts_options():
    with pytest.raises(CommandError, match="does not apply to --contract accounting"):
        call_command("run_fake_provider", "--contract", "accounting", "--hmac-key", "00")
    with pytest.raises(CommandError, match="does not apply to --contract accounting"):
        call_command("run_fake_provider", "--contract", "accounting", "--slow-rate", "0.5")


def test_command__serves_the_accounting_contract_until_sigterm():
    process = subprocess.Popen(
        [sys.executable, "manage.py", "run_fake_provider", "--contract", "accounting",
         "--port", "0", "--api-key", API_KEY, "--key-retention", "120"],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        url = process.stdout.readline().split("listening on ", 1)[1].strip()
        server = SimpleNamespace(url=url)
        assert requests.get(url + "/_fake/health", timeout=2).json()["contract"] == "accounting"
        assert create(server).status_code == 201
        stats = requests.get(url + "/_fake/stats", timeout=2).json()
        assert (stats["invoices"], stats["config"]["key_retention"]) == (1, 120)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
