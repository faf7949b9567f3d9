"""A worker killed at each fence point of an Adyen charge, capture and refund: once at Adyen.

Real processes: `manage.py rqworker` (SIGKILLed by the failpoint), `run_recovery` beside
it, the fake Adyen over HTTP; the workers read Adyen's entry from ADYEN_* variables, as a
deployment's do. Transactional: the worker processes must see committed rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools.fake_provider.adyen.server import FakeAdyenServer
from payments.captures.handler import request_capture
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine.failpoints import (
    AFTER_CLAIM_COMMIT,
    AFTER_PROVIDER_ACCEPT,
    AFTER_RECORD_COMMIT,
    POINTS,
)
from payments.models import ClaimState, Operation, OperationState
from payments.refunds.handler import request_refund
from payments.shop.models import CreditNote, Invoice, OrderStatus
from tests.support.adyen import adyen_shop, worker_env_of
from tests.support.workers import SIMPLE, Supervisor, run_worker, worker_env

pytestmark = pytest.mark.django_db(transaction=True)

CARD = json.dumps({"type": "scheme", "holderName": "John Smith"})


def crash_once_until_done(
    fake: FakeAdyenServer, op: Operation, point: str, tmp_path: Path, timeout: float
) -> None:
    """Run a worker that is killed at `point` the first time a step reaches it (restarted
    as a supervisor would), next to the recovery loop, until `op` succeeds."""
    marker = tmp_path / "failpoint"
    env = worker_env(
        fake.url,
        FENCE_FAILPOINTS=point,
        FENCE_FAILPOINT_MARKER=str(marker),
        **worker_env_of(fake.checkout_url),
    )
    supervisor = Supervisor(env, f"adyen-{op.key}", SIMPLE)
    stderr = supervisor.run_until(
        lambda: Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED,
        timeout=timeout,
        what=f"{op.kind} to succeed after a crash at {point}",
    )
    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"


@pytest.mark.parametrize("point", POINTS)
def test_adyen_crash_at_point__redelivery_charges_once_and_finishes(point, adyen, queue, tmp_path):
    shop = adyen_shop()
    order = create_order(amount=2500, currency="eur", email="crash@example.com", client=shop)
    op, _ = request_checkout(
        order_id=order.pk, key=f"adyen-crash-{point}", payment_method=CARD, actor="t", client=shop
    )

    crash_once_until_done(adyen, op, point, tmp_path, timeout=40)

    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert adyen.state.authorised_count() == 1  # one payment at Adyen, whatever the crash
    charge = op.claims.get(step="charge")
    assert charge.state == ClaimState.DONE
    assert adyen.state.payments()[0].psp == charge.provider_reference
    assert Invoice.objects.filter(order=order).count() == 1


@pytest.mark.parametrize("point", [AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, AFTER_RECORD_COMMIT])
def test_adyen_capture_crash_at_point__one_hold_one_capture_and_finishes(
    point, adyen_to_app, queue, tmp_path
):
    """The capture's notifications reach the app's live endpoint; the worker is a process
    of its own, killed at the point the first time any step reaches it."""
    shop = adyen_shop()
    order = create_order(amount=4000, currency="eur", email="crash@example.com", client=shop)
    op, _ = request_capture(
        order_id=order.pk, key=f"adyen-cap-{point}", payment_method=CARD, actor="t", client=shop
    )

    crash_once_until_done(adyen_to_app, op, point, tmp_path, timeout=60)

    assert [(e["eventCode"], e["amount"]["value"]) for e in adyen_to_app.state.timeline()] == [
        ("AUTHORISATION", 4000),
        ("CAPTURE", 4000),
    ]
    assert Invoice.objects.filter(order=order).count() == 1
    assert set(op.claims.values_list("step", "state")) == {
        ("authorize", ClaimState.DONE),
        ("capture", ClaimState.DONE),
        ("record", ClaimState.DONE),
    }


@pytest.mark.parametrize("point", [AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, AFTER_RECORD_COMMIT])
def test_adyen_refund_crash_at_point__one_refund_at_adyen_one_credit_note(
    point, adyen_to_app, queue, tmp_path
):
    """The refund is received (`[refund-received]`), then settled by its REFUND notification
    at the app's live endpoint (a web process's write: no worker records it done, so
    there is no before_record_commit to kill); the worker is killed at the point."""
    shop = adyen_shop()
    order = create_order(amount=2500, currency="eur", email="crash@example.com", client=shop)
    request_checkout(
        order_id=order.pk, key=f"adyen-paid-{point}", payment_method=CARD, actor="t", client=shop
    )
    run_worker(queue)  # paid, in this process, before any failpoint is armed
    op, _ = request_refund(
        order_id=order.pk, key=f"adyen-ref-{point}", amount=1000, actor="t", client=shop
    )

    crash_once_until_done(adyen_to_app, op, point, tmp_path, timeout=60)

    order.refresh_from_db()
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 1000)
    refunds = [e for e in adyen_to_app.state.timeline() if e["eventCode"] == "REFUND"]
    assert [e["amount"]["value"] for e in refunds] == [1000]  # one refund at Adyen
    assert CreditNote.objects.filter(order=order).count() == 1
    assert set(op.claims.values_list("step", "state")) == {
        ("refund", ClaimState.DONE),
        ("credit_note", ClaimState.DONE),
    }
