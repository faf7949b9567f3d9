"""Operations in the states a worker leaves them in, built through the fence's own functions.

Used by the tests that do not run a worker (they run inside one test
transaction, where a claim cannot commit before its call). Each builder does
what the runtime would have done at that point, including the real call to
the fake provider with the claim's stored request and idempotency key, so the
provider holds exactly what a lost answer leaves behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import requests
from django.db import transaction
from django.utils import timezone

from payments.checkout.handler import mark_order_failed, request_checkout
from payments.checkout.orders import create_order
from payments.conf import payments_settings
from payments.engine import fence
from payments.engine.handlers import get_handler
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationState, StepClaim
from payments.provider.client import ProviderClient
from payments.provider.errors import CardDeclined
from payments.shop.models import Order, OrderStatus

WORKER = "worker-1/4242"


def new_checkout(key: str = "chk-1", *, pm: str = "pm_card_visa", amount: int = 1999) -> Operation:
    """An order and its pending checkout operation (its job is enqueued on commit, never here)."""
    order = create_order(amount=amount, currency="eur", email="buyer@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method=pm, actor="api")
    return op


#: Step names the engine's tests run on the checkout's registration (a handler's run refuses
#: a step its `steps=` does not declare): `with_test_steps` declares them.
TEST_STEPS = frozenset(
    {"first_local", "second_local", "third_local", "optional", "x", "s", "review_step",
     "review_local", "email", "mail"}
)  # fmt: skip


def with_test_steps(spec: Any) -> Any:
    """`spec` with the tests' own step names declared too."""
    return dataclasses.replace(spec, steps=spec.steps | TEST_STEPS)


def charge_effect(op: Operation) -> Any:
    """The checkout's charge effect for `op`, as the engine builds it (recovery, desk)."""
    return get_handler(op.kind).effect("charge", op)


def claim_charge(op: Operation, *, age: timedelta = timedelta(0)) -> StepClaim:
    """The charge claim as `claim_step` inserts it, its lease already run out, `age` old."""
    now = timezone.now() - age
    with fence_writes():  # hand-made state, as the test says
        claim = StepClaim.objects.create(
            operation=op,
            step="charge",
            state=ClaimState.CLAIMED,
            idempotency_key=fence.derive_idempotency_key(op.key, "charge"),
            request=charge_effect(op).build_request(),
            claimed_by=WORKER,
            claimed_at=now,
            lease_expires_at=now,
            attempts=1,
        )
    return claim


@contextmanager
def provider_clock(age: timedelta) -> Iterator[None]:
    """Make the fake provider act `age` ago (its objects' `created` to match), in the block."""
    url = payments_settings().provider_url
    requests.post(f"{url}/_fake/config", json={"clock_offset": -age.total_seconds()}, timeout=5)
    try:
        yield
    finally:
        requests.post(f"{url}/_fake/config", json={"clock_offset": 0.0}, timeout=5)


def call_provider(claim: StepClaim, *, age: timedelta = timedelta(0)) -> tuple[str, str]:
    """Send the claim's request with its key, as the worker did `age` ago; return
    (reference, status)."""
    request = claim.request
    assert request is not None, "a charge claim holds its request from its insert on"
    with provider_clock(age), ProviderClient.from_settings() as client:
        try:
            intent = client.create_payment_intent(
                amount=request["amount"],
                currency=request["currency"],
                payment_method=request["payment_method"],
                metadata=request["metadata"],
                idempotency_key=claim.idempotency_key,
            )
        except CardDeclined as exc:
            return exc.payment_intent_id or "", "declined"
    return intent.id, intent.status


def move(op: Operation, state: OperationState, *, reason: str = "", **fields) -> Operation:
    """Move the operation as its worker would: take the lease (if runnable), then leave it."""
    fence.acquire_lease(op.pk, owner=WORKER, seconds=30)
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        fence.release_in_tx(locked, state, actor=WORKER, reason=reason, **fields)
        if state == OperationState.FAILED:
            mark_order_failed(locked)
    return locked


def backdate(claim: StepClaim, age: timedelta) -> None:
    """Make the claim look `age` old (its request and last write included)."""
    then = timezone.now() - age
    with fence_writes():  # hand-made state, as the test says
        StepClaim.objects.filter(pk=claim.pk).update(
            claimed_at=then, last_request_at=then, updated_at=then
        )


def backdate_last_request(claim: StepClaim, age: timedelta) -> None:
    """Make the last request under the claim's key `age` old (a replay sent then)."""
    with fence_writes():  # hand-made state, as the test says
        StepClaim.objects.filter(pk=claim.pk).update(last_request_at=timezone.now() - age)


def uncertain(
    key: str = "chk-1", *, charged: bool, pm: str = "pm_card_visa", age: timedelta = timedelta(0)
) -> tuple[Operation, StepClaim, str]:
    """The read timed out: claim and operation uncertain. Returns (op, claim, reference or "")."""
    op = new_checkout(key, pm=pm)
    claim = claim_charge(op)
    reference = call_provider(claim, age=age)[0] if charged else ""
    claim = fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=WORKER, error="ReadTimeout")
    move(op, OperationState.UNCERTAIN, reason="outcome unknown")
    if age:
        backdate(claim, age)
    op.refresh_from_db()
    claim.refresh_from_db()
    return op, claim, reference


def declined(key: str = "chk-1") -> tuple[Operation, StepClaim]:
    """The provider declined the card: claim failed with its reference, operation failed."""
    op = new_checkout(key, pm="pm_card_chargeDeclined")
    claim = claim_charge(op)
    reference, _ = call_provider(claim)
    claim = fence.settle_claim(
        claim, ClaimState.FAILED, actor=WORKER, reference=reference, error="refused: card_declined"
    )
    move(op, OperationState.FAILED, reason="card declined", last_error="card_declined")
    op.refresh_from_db()
    return op, claim


def failed_after_charge(key: str = "chk-1") -> tuple[Operation, StepClaim]:
    """Charged, then a bug failed the next step three times: operation failed, charge done."""
    op = new_checkout(key)
    claim = claim_charge(op)
    reference, _ = call_provider(claim)
    claim = fence.settle_claim(
        claim, ClaimState.DONE, actor=WORKER, reference=reference, result={"reference": reference}
    )
    move(op, OperationState.FAILED, reason="gave up after 3 attempts", attempts=3)
    op.refresh_from_db()
    return op, claim


def succeeded(key: str = "chk-1") -> tuple[Operation, StepClaim]:
    """Charged and finished: operation succeeded, order paid."""
    op = new_checkout(key)
    claim = claim_charge(op)
    reference, _ = call_provider(claim)
    claim = fence.settle_claim(
        claim, ClaimState.DONE, actor=WORKER, reference=reference, result={"reference": reference}
    )
    move(op, OperationState.SUCCEEDED, reason="all steps done")
    Order.objects.filter(pk=op.params["order_id"]).update(status=OrderStatus.PAID)
    op.refresh_from_db()
    return op, claim


def order_of(op: Operation) -> Order:
    return Order.objects.get(pk=op.params["order_id"])
