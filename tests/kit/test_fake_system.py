"""payments.testing.FakeSystem: its contract over real HTTP, and a handler driven through it.

The fake is the kit's stand-in for a project's own external system (docs/testing.md):
a lost answer (made, the connection closed without a byte), a 503 (nothing made), a
replay under the same key (the same answer, nothing made), and the list by
`external_id` that settles a lost answer. tests/kit/deposits.py is the handler a
project would write; its operation runs on a real FenceWorker in the test's process.
"""

from __future__ import annotations

import http.client
import io
from datetime import timedelta

import pytest
import requests
from django.core.management import call_command
from django.db import transaction
from django.db.models import F

from payments.engine.writes import fence_writes
from payments.fence import OperationConflict, create_operation_in_tx
from payments.models import ClaimState, Operation, OperationState, StepClaim
from payments.testing import FakeSystem, run_jobs
from tests.kit.deposits import DEPOSITS, HOLD, TAKE_DEPOSIT


@pytest.fixture
def system():
    with FakeSystem() as running:
        yield running


def post(system: FakeSystem, body: dict, key: str = "k-1") -> requests.Response:
    return requests.post(
        f"{system.url}/objects", json=body, headers={"Idempotency-Key": key}, timeout=5
    )


def test_a_create__201_then_the_same_key_replays_it_and_makes_nothing(system):
    first = post(system, {"external_id": "e-1", "amount": 500})
    again = post(system, {"external_id": "e-1", "amount": 500})

    assert first.status_code == again.status_code == 201
    assert first.json() == again.json() and first.json()["id"].startswith("obj_")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert len(system.objects()) == 1


def test_the_same_key_with_another_body__422_nothing_made(system):
    post(system, {"external_id": "e-1", "amount": 500})

    other = post(system, {"external_id": "e-1", "amount": 900})

    assert other.status_code == 422 and other.json() == {"error": "idempotency_key_reused"}
    assert [o["amount"] for o in system.objects()] == [500]


def test_no_key_or_no_json_object__400(system):
    no_key = requests.post(f"{system.url}/objects", json={"amount": 1}, timeout=5)
    not_object = post(system, [1, 2])

    assert (no_key.status_code, not_object.status_code) == (400, 400)
    assert system.objects() == []


def test_retrieve_by_id_and_list_by_external_id(system):
    made = post(system, {"external_id": "e-7", "amount": 1}).json()
    post(system, {"external_id": "e-8", "amount": 2}, key="k-2")

    one = requests.get(f"{system.url}/objects/{made['id']}", timeout=5)
    missing = requests.get(f"{system.url}/objects/obj_nope", timeout=5)
    listed = requests.get(f"{system.url}/objects", params={"external_id": "e-7"}, timeout=5)

    assert one.json() == made and missing.status_code == 404
    assert listed.json() == {"data": [made]}


def test_a_lost_answer__made_but_the_client_gets_no_byte(system):
    system.lose_answers(1)

    with pytest.raises(requests.ConnectionError):
        post(system, {"external_id": "e-1", "amount": 500})
    replayed = post(system, {"external_id": "e-1", "amount": 500})

    assert len(system.objects()) == 1
    assert replayed.json()["id"] == system.objects()[0]["id"]


def test_fail_next__answers_the_status_and_makes_nothing(system):
    system.fail_next(1, status=503)

    failed = post(system, {"external_id": "e-1", "amount": 500})
    then = post(system, {"external_id": "e-1", "amount": 500})

    assert (failed.status_code, then.status_code) == (503, 201)
    assert len(system.objects()) == 1


def test_a_list_without_an_external_id__400_never_everything(system):
    post(system, {"external_id": "e-1", "amount": 500})

    missing = requests.get(f"{system.url}/objects", timeout=5)
    empty = requests.get(f"{system.url}/objects?external_id=", timeout=5)

    assert (missing.status_code, empty.status_code) == (400, 400)
    assert missing.json() == {"error": "external_id_required"}


def test_a_body_without_a_length__411__a_bad_length_400__nothing_made(system):
    def chunks():
        yield b'{"external_id": "e-1", '
        yield b'"amount": 500}'

    chunked = requests.post(
        f"{system.url}/objects", data=chunks(), headers={"Idempotency-Key": "k-c"}, timeout=5
    )
    raw = http.client.HTTPConnection("127.0.0.1", int(system.url.rsplit(":", 1)[1]), timeout=5)
    raw.putrequest("POST", "/objects")
    raw.putheader("Idempotency-Key", "k-n")
    raw.putheader("Content-Length", "-1")
    raw.endheaders()
    negative = raw.getresponse()

    unsized = http.client.HTTPConnection("127.0.0.1", int(system.url.rsplit(":", 1)[1]), timeout=5)
    unsized.putrequest("POST", "/objects")
    unsized.putheader("Idempotency-Key", "k-u")
    unsized.endheaders()  # no Content-Length, no chunks: a body of unknown length

    assert chunked.status_code == 411 and chunked.json() == {"error": "length_required"}
    assert unsized.getresponse().status == 411
    assert negative.status == 400
    assert system.objects() == []


def test_forget_keys__a_key_sent_again_makes_a_second_object(system):
    first = post(system, {"external_id": "e-1", "amount": 500}).json()
    system.forget_keys()

    again = post(system, {"external_id": "e-1", "amount": 500})

    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    assert [o["id"] for o in system.objects()] == [first["id"], again.json()["id"]]


# --- a handler through the fake, on a real FenceWorker ----------------------------------------


@pytest.fixture
def deposits(system, settings):
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "RETRY_BACKOFF": [0, 0],  # a transient failure's next try at once, in the same burst
        "SYSTEMS": {
            **settings.PAYMENTS.get("SYSTEMS", {}),
            DEPOSITS: {"URL": system.url, "API_KEY": "test"},
        },
    }
    return system


def take_deposit(key: str, amount: int = 5000, tenant: str = "") -> Operation:
    with transaction.atomic():
        op, _ = create_operation_in_tx(
            key=key, kind=TAKE_DEPOSIT, entity_type="booking", entity_id="b-1",
            params={"amount": amount}, actor="test", tenant=tenant,
        )  # fmt: skip
    return op


@pytest.mark.django_db(transaction=True)
def test_two_hotels_of_the_project_use_the_same_key__two_deposits_each_held_once(deposits, queue):
    """A project's own tenants ("hotel:1", "hotel:2": not API clients) keep their keys
    apart: the same booking key is two operations, sent under two idempotency keys (the
    system would otherwise replay the first hotel's deposit to the second), and each
    hotel's key asked again is its operation, not a new one."""
    first = take_deposit("booking-7", amount=5000, tenant="hotel:1")
    second = take_deposit("booking-7", amount=7000, tenant="hotel:2")
    again = take_deposit("booking-7", amount=5000, tenant="hotel:1")

    run_jobs()

    first.refresh_from_db()
    second.refresh_from_db()
    keys = {op.claims.get(step=HOLD).idempotency_key for op in (first, second)}
    assert again.pk == first.pk and first.pk != second.pk
    assert (first.tenant, second.tenant) == ("hotel:1", "hotel:2")
    assert first.state == second.state == OperationState.SUCCEEDED
    assert len(keys) == 2
    assert sorted(o["amount"] for o in deposits.objects()) == [5000, 7000]
    with pytest.raises(OperationConflict):  # hotel 1's key, another amount
        take_deposit("booking-7", amount=6000, tenant="hotel:1")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "tenant", ["hotel 1", "hotel\x1d1", "h" * 65, "hôtel:1", "client:007", "client:", "client:x"]
)
def test_a_tenant_that_could_meet_another_in_a_derived_key__refused_nothing_written(tenant):
    """The tenant goes into each step's idempotency key before a control character:
    one holding control characters, spaces or more than 64 characters is refused by
    name, before any row is written; so is "client:" followed by anything but an API
    client's id as the API writes it (the previous release's trigger reads
    "client:007" as client 7, whose tenant is "client:7")."""
    with pytest.raises(ValueError, match=r"printable ASCII|JSON API's clients' prefix"):
        take_deposit("booking-8", tenant=tenant)
    assert not Operation.objects.filter(key="booking-8").exists()


@pytest.mark.django_db
def test_a_key_holding_a_derived_keys_separator__refused_nothing_written():
    """Tenant "" and key "hotel:1\x1dk" would derive hotel:1's key "k"'s idempotency key."""
    with pytest.raises(ValueError, match="control character"):
        take_deposit("hotel:1\x1dk")
    assert not Operation.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_answer_lost__a_same_key_replay_settles_it__one_deposit_held(deposits, queue):
    deposits.lose_answers(1)
    op = take_deposit("deposit-lost")

    run_jobs()  # the answer lost: the operation waits, uncertain
    op.refresh_from_db()
    waited = op.state
    call_command("reconcile", stdout=io.StringIO())  # a same-key replay answers it: done, resumed
    run_jobs()

    op.refresh_from_db()
    assert waited == OperationState.UNCERTAIN
    claim = op.claims.get(step=HOLD)
    made = deposits.objects(external_id=f"{op.key}@{op.pk}")
    assert op.state == OperationState.SUCCEEDED
    assert len(made) == 1
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, made[0]["id"])
    # The requests the effect noted are the step's evidence: the lost POST, then its replay.
    sent = [
        (r["method"], r["path"], r["status"], r.get("replayed", False), r.get("error", ""))
        for event in op.events.filter(step=HOLD).exclude(requests=None).order_by("pk")
        for r in event.requests
    ]
    assert sent == [
        ("POST", "/objects", None, False, "ConnectionError"),
        ("POST", "/objects", 201, True, ""),
    ]


@pytest.mark.django_db(transaction=True)
def test_the_system_unavailable__retried_under_the_same_key__one_deposit_held(deposits, queue):
    deposits.fail_next(1, status=503)
    op = take_deposit("deposit-503")

    run_jobs()

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert len(deposits.objects()) == 1
    assert op.claims.get(step=HOLD).attempts == 2


@pytest.mark.django_db(transaction=True)
def test_the_answer_lost_past_the_keys_retention__the_list_read_settles_it__one_deposit(
    deposits, queue
):
    """A replay would make a second deposit once the system forgot the key: the fence
    does not replay past the system's key retention (24 h, declared); it finds the
    deposit by its external id (HoldDeposit.candidates and matches: the list read) and
    settles the claim done."""
    deposits.lose_answers(1)
    op = take_deposit("deposit-forgotten")
    run_jobs()  # the answer lost: the operation waits, uncertain
    # Two days later: the key's retention passed, and the system forgot it.
    with fence_writes():  # hand-made age: the claim's key first used two days ago
        StepClaim.objects.filter(operation=op, step=HOLD).update(
            claimed_at=F("claimed_at") - timedelta(days=2),
            last_request_at=F("last_request_at") - timedelta(days=2),
        )
    deposits.forget_keys()

    call_command("reconcile", stdout=io.StringIO())
    run_jobs()

    op.refresh_from_db()
    claim = op.claims.get(step=HOLD)
    made = deposits.objects()
    assert len(made) == 1  # no replay: nothing made again
    assert op.state == OperationState.SUCCEEDED
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, made[0]["id"])
