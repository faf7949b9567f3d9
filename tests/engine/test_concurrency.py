"""Two workers with their own database connections race on the same operation.

Threads each open their own PostgreSQL connection (Django connections are
per thread); a Barrier releases them together and the fake provider holds the
first call open (`slow` fault) so the race really overlaps.
"""

from __future__ import annotations

from functools import partial

import pytest

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine import runtime
from payments.engine.steps import run_external_step
from payments.exceptions import StepBusy
from payments.models import ClaimState, Operation, OperationState
from tests.support.builders import charge_effect
from tests.support.concurrency import race

# Transactional: each thread's connection must see what the others committed.
pytestmark = pytest.mark.django_db(transaction=True)


def new_operation(provider) -> Operation:
    provider.state.configure(slow_delay=0.5)  # the winner's call stays open for 0.5 s
    provider.state.enqueue_faults("slow", 1)
    order = create_order(amount=700, currency="eur", email="race@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="race", payment_method="pm_card_visa", actor="test"
    )
    return op


def test_two_workers_run_the_same_operation__one_provider_call(provider, queue):
    op = new_operation(provider)

    outcomes = race([partial(runtime.execute, op.pk, worker_id=f"worker-{i}") for i in range(2)])

    assert sorted(map(str, outcomes)) == ["deferred", "succeeded"]
    assert provider.state.stats()["create_requests"] == 1
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED


def test_two_workers_claim_the_same_step__loser_backs_off_without_calling(provider, queue):
    op = new_operation(provider)

    def claim_and_call(i: int) -> object:
        fresh = Operation.objects.get(pk=op.pk)
        return run_external_step(fresh, "charge", charge_effect(fresh), owner=f"worker-{i}")

    outcomes = race([partial(claim_and_call, i) for i in range(2)])

    busy = [o for o in outcomes if isinstance(o, StepBusy)]
    done = [o for o in outcomes if isinstance(o, dict)]
    assert len(busy) == 1 and len(done) == 1, outcomes
    assert provider.state.stats()["create_requests"] == 1
    claim = op.claims.get(step="charge")
    assert claim.state == ClaimState.DONE
    assert claim.provider_reference == done[0]["reference"]
