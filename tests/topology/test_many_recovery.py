"""`run_recovery` on every host: three recovery processes at once against the same claims.

Charges whose answers were lost (the provider accepted them, the worker never
heard) leave their claims uncertain. Three real `manage.py run_recovery`
processes, through PgBouncer in transaction pooling, then reconcile them at
the same time, with a provider slow enough that their rounds overlap. Each
claim is taken over and settled by one of them, named in the audit trail, and
asked of the provider once: no claim is replayed twice, no order is charged
twice.
"""

from __future__ import annotations

from collections import Counter

import pytest
from django.db import connection

from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE
from payments.checkout.orders import create_order
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim
from tests.support.flows import assert_paid_once
from tests.support.topology import Fleet, all_settled
from tests.support.workers import run_worker, worker_env

# Transactional: the recovery processes must see the committed claims.
pytestmark = pytest.mark.django_db(transaction=True)

CLAIMS = 12
RECOVERY_PROCESSES = 3


def test_three_recovery_processes__each_claim_reconciled_once_by_one_owner(
    provider, queue, pgbouncer, tmp_path
):
    orders = {}
    for index in range(CLAIMS):
        order = create_order(amount=1000 + index, currency="eur", email="many@example.com")
        op, _ = request_checkout(
            order_id=order.pk, key=f"uncertain-{index}", payment_method="pm_card_visa", actor="test"
        )
        orders[op.key] = order.pk
    provider.state.enqueue_faults("drop_after_accept", CLAIMS)  # accepted, answer lost
    run_worker(queue)
    assert Operation.objects.filter(state=OperationState.UNCERTAIN).count() == CLAIMS
    before = provider.state.stats()
    provider.state.configure(latency=0.4)  # each lookup takes a while: the rounds overlap

    env = worker_env(
        provider.url,
        DATABASE_URL=pgbouncer.url(str(connection.settings_dict["NAME"])),
        DATABASE_POOLING="transaction",
    )
    fleet = Fleet(env, "unused", tmp_path, workers=0, recoveries=RECOVERY_PROCESSES)
    try:
        fleet.wait(
            lambda: (
                not StepClaim.objects.filter(step=CHARGE).exclude(state=ClaimState.DONE).exists()
            ),
            60,
            "every uncertain charge to be reconciled",
        )
    finally:
        fleet.stop()
    diagnostics = fleet.output()
    after = provider.state.stats()

    # The provider was asked once per claim: a replay with the claim's own key.
    assert after["create_requests"] - before["create_requests"] == CLAIMS, diagnostics
    assert after["replays"] - before["replays"] == CLAIMS, diagnostics
    assert after["intents"] == before["intents"] == CLAIMS
    # The audit trail names one reconciler per claim: the one that took it over settled it.
    owners = {}
    for claim in StepClaim.objects.filter(step=CHARGE).select_related("operation"):
        events = OperationEvent.objects.filter(
            operation=claim.operation, step=CHARGE, actor__startswith="reconciler:"
        )
        actors = set(events.values_list("actor", flat=True))
        assert len(actors) == 1, (claim.operation.key, actors)
        (owner,) = actors
        taken = events.get(reason__startswith="taken over from")
        settled = events.get(from_state=ClaimState.UNCERTAIN, to_state=ClaimState.DONE)
        assert taken.id < settled.id
        assert claim.claimed_by == owner
        owners[claim.operation.key] = owner
    shares = Counter(owners.values())
    assert len(shares) >= 2, f"one process did everything: {shares}"  # they did run at once

    run_worker(queue)  # the resumed checkouts and their follow-ups
    assert all_settled(CLAIMS * 3)
    assert_paid_once(provider, orders)
    print(f"\n{CLAIMS} claims reconciled by {len(shares)} processes: {sorted(shares.values())}")
