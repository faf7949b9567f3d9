"""Two operators act on the same operation at the same moment.

Each thread has its own PostgreSQL connection; a Barrier releases them
together. The desk locks the operation row, so the second waits for the
first to commit, re-checks, and gets a DeskError: exactly one decision wins.
"""

from __future__ import annotations

import pytest

from payments.desk import services as desk
from payments.desk.services import DeskError
from payments.models import ClaimState, Operation, OperationEvent, OperationState
from payments.shop.models import Invoice
from tests.support import flows
from tests.support.concurrency import race
from tests.support.users import NEW_ATTEMPT, RECONCILE, VIEW, make_user
from tests.support.workers import run_worker

# Transactional: each operator's connection must see what the other committed.
pytestmark = pytest.mark.django_db(transaction=True)


def operators(*perms: str) -> tuple:
    return make_user("alice", *VIEW, *perms), make_user("bob", *VIEW, *perms)


def split(results: list[object]) -> tuple[list[object], list[Exception]]:
    errors = [r for r in results if isinstance(r, Exception)]
    return [r for r in results if not isinstance(r, Exception)], errors


def test_two_operators_resume_at_once__one_resumes_the_other_is_refused(
    provider, queue, monkeypatch
):
    op = flows.failed_by_invoice_bug(monkeypatch, queue)
    assert op.state == OperationState.NEEDS_REVIEW  # charged: never "failed"
    alice, bob = operators(RECONCILE)

    results = race(
        [
            lambda u=u: desk.resume(op.pk, user=u, reason=f"{u.username}: bug fixed")
            for u in (alice, bob)
        ]
    )

    wins, errors = split(results)
    assert len(wins) == 1 and len(errors) == 1
    assert isinstance(errors[0], DeskError) and "retrying and will run" in str(errors[0])
    resumed = OperationEvent.objects.filter(operation=op, reason__startswith="resumed:")
    assert resumed.count() == 1
    assert queue.count == 1  # one delivery enqueued on commit

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1
    assert Invoice.objects.count() == 1


def test_two_operators_start_a_new_attempt_at_once__exactly_one_new_operation(provider, queue):
    op = flows.checkout(pm="pm_card_chargeDeclined")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    alice, bob = operators(RECONCILE, NEW_ATTEMPT)

    results = race(
        [
            lambda u=u: desk.start_new_attempt(
                op.pk,
                user=u,
                reason="customer authorised a new card",
                payment_method="pm_card_visa",
            )
            for u in (alice, bob)
        ]
    )

    wins, errors = split(results)
    assert len(wins) == 1 and len(errors) == 1
    assert isinstance(errors[0], DeskError) and "a new attempt exists already" in str(errors[0])
    assert Operation.objects.filter(retry_of=op).count() == 1
    assert Operation.objects.count() == 2

    run_worker(queue)

    new = Operation.objects.get(retry_of=op)
    assert new.state == OperationState.SUCCEEDED
    # The new attempt confirmed the order's one intent: no second one was made.
    [intent] = provider.state.intents()
    assert intent["status"] == "succeeded"
    assert new.claims.get(step="charge").provider_reference == intent["id"]


def test_two_operators_mark_the_same_step_succeeded__recorded_once(provider, queue):
    op = flows.uncertain_after_read_timeout(provider, queue)
    [intent] = provider.state.intents(metadata={"operation_key": op.key})
    alice, bob = operators(RECONCILE)

    results = race(
        [
            lambda u=u: desk.mark_step_succeeded(
                op.pk, "charge", reference=intent["id"], user=u, reason="seen at the provider"
            )
            for u in (alice, bob)
        ]
    )

    wins, errors = split(results)
    assert len(wins) == 1 and len(errors) == 1
    # The loser waited for the lock, then found the step changed or settled already.
    assert isinstance(errors[0], DeskError)
    assert "changed while the provider was asked" in str(errors[0]) or "settled" in str(errors[0])
    marked = OperationEvent.objects.filter(operation=op, step="charge", to_state=ClaimState.DONE)
    assert marked.count() == 1

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert provider.state.succeeded_count(metadata={"operation_key": op.key}) == 1
