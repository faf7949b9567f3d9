"""A run-first local step's claim is queued: it goes in front of the unit's next fence
statement (a claim before a call, the release) or with its COMMIT, in no round trip of
its own (payments.engine.fence.queue_local_claim_in_tx).

What must hold: the claim commits with the step's writes or not at all; if another run
committed the step meanwhile, nothing queued behind the claim runs (no e-mail claim, no
COMMIT, no `succeeded`), the run's writes roll back and the operation runs again,
uncounted; a rollback forgets the queue.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from payments.checkout.handler import request_checkout
from payments.checkout.names import CONFIRMATION_EMAIL, COUNT_SALE, INVOICE, MARK_PAID
from payments.checkout.orders import create_order
from payments.engine import fence, runtime
from payments.engine.effects import DeliveryPolicy
from payments.engine.handlers import Run, get_handler
from payments.exceptions import InvalidTransition, OperationConflict, StepDoneMeanwhile
from payments.models import KeyScope, Operation, OperationEvent, OperationState, StepClaim
from payments.shop.models import LedgerEntry
from tests.support.concurrency import on_another_connection

pytestmark = pytest.mark.django_db(transaction=True)


def pending_checkout(key: str) -> Operation:
    order = create_order(amount=1200, currency="eur", email="q@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    return op


def run_first(key: str, worker: str = "a/1") -> Run:
    """A run whose lease found no claim: its local steps run first, their claims queued."""
    leased = fence.acquire_lease(pending_checkout(key).pk, owner=worker, seconds=30)
    assert leased.claimed_steps == frozenset()
    return Run(
        leased.operation, worker, get_handler(leased.operation.kind), claimed_at_lease=frozenset()
    )


def ledger_line(who: str, op: Operation):
    def write() -> dict[str, str]:
        LedgerEntry.objects.create(
            order_id=op.params["order_id"], amount=1, currency="eur", provider_reference=who
        )
        return {"by": who}

    return write


def committed_elsewhere(op: Operation, step: str) -> None:
    """Another run (its own connection) commits the step's claim now."""

    def other() -> None:
        with transaction.atomic():
            assert fence.insert_local_claim_in_tx(op, step, owner="b/2", result={"by": "b"})

    on_another_connection(other)


def test_the_claim_waits_for_the_next_fence_statement__and_commits_with_it():
    run = run_first("q-1")
    run.local(INVOICE, ledger_line("a", run.operation))

    assert fence.has_queued()
    assert not StepClaim.objects.filter(operation=run.operation, step=INVOICE).exists()
    run.unit.commit()  # nothing else to send: the claim goes with the COMMIT

    assert not fence.has_queued()
    claim = StepClaim.objects.get(operation=run.operation, step=INVOICE)
    assert (claim.state, claim.claimed_by, claim.result) == ("done", "a/1", {"by": "a"})
    assert OperationEvent.objects.filter(operation=run.operation, step=INVOICE).count() == 1
    assert LedgerEntry.objects.count() == 1


def test_taken_meanwhile__the_claim_behind_it_and_the_commit_do_not_run__no_email(mailoutbox):
    run = run_first("q-2")
    op = run.operation
    run.local(INVOICE, ledger_line("a", op))
    committed_elsewhere(op, INVOICE)
    sent: list[str] = []

    with pytest.raises(StepDoneMeanwhile) as raised:
        run.side_effect(
            CONFIRMATION_EMAIL,
            lambda: sent.append("mail") or {},
            policy=DeliveryPolicy.AT_MOST_ONCE,
        )

    assert raised.value.step == INVOICE
    assert sent == [] and mailoutbox == []
    assert not StepClaim.objects.filter(operation=op, step=CONFIRMATION_EMAIL).exists()
    assert StepClaim.objects.get(operation=op, step=INVOICE).claimed_by == "b/2"
    assert LedgerEntry.objects.count() == 0  # this run's write rolled back
    assert not fence.has_queued() and not run.unit.is_open


def test_taken_meanwhile_at_the_release__deferred_uncounted__not_succeeded(monkeypatch):
    """mark_paid runs first; its claim goes with the release, and finds the step done by
    another run: the release does not happen, the operation runs again, uncounted."""
    op = pending_checkout("q-3")
    leased = fence.acquire_lease(op.pk, owner="a/1", seconds=30)
    spec = get_handler(op.kind)

    def handler(run: Run) -> None:
        run.local(MARK_PAID, ledger_line("a", run.operation))
        committed_elsewhere(run.operation, MARK_PAID)

    monkeypatch.setattr(fence, "acquire_lease", lambda *a, **k: leased)
    monkeypatch.setattr(
        runtime,
        "get_handler",
        lambda kind: type(spec)(kind=spec.kind, func=handler, steps=spec.known_steps),
    )
    assert runtime.execute(op.pk, worker_id="a/1") == "deferred"

    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.RETRYING, 0)
    assert LedgerEntry.objects.count() == 0
    assert not OperationEvent.objects.filter(operation=op, to_state="succeeded").exists()


def test_a_rollback_forgets_the_queue__the_next_unit_sends_nothing_of_it():
    run = run_first("q-4")
    op = run.operation
    run.local(INVOICE, ledger_line("a", op))

    def fails() -> dict[str, str]:
        raise ValueError("the step's function failed")

    with pytest.raises(ValueError):
        run.local(MARK_PAID, fails)

    assert not fence.has_queued()
    with transaction.atomic():
        fence.send_queued_in_tx()  # a later transaction on this connection
    assert not StepClaim.objects.filter(operation=op).exists()
    assert LedgerEntry.objects.count() == 0


def test_queue_outside_a_transaction__refused():
    op = pending_checkout("q-5")
    with pytest.raises(InvalidTransition):
        fence.queue_local_claim_in_tx(op, INVOICE, owner="a/1", result={})
    assert not fence.has_queued()


def test_a_fence_statement_in_a_savepoint__the_queue_waits_for_the_unit(mailoutbox):
    """A step whose function sends a fence statement inside its own atomic() (a savepoint)
    that then rolls back: the claim queued before must not ride in the savepoint (it would
    roll back alone and the step's writes commit unclaimed); it goes with the unit's."""
    run = run_first("q-6")
    op = run.operation
    with transaction.atomic():  # the follow-up's key, taken with other parameters
        fence.create_operations_in_tx([follow_up(op, {"x": 1})])
    run.local(INVOICE, ledger_line("a", op))

    def tolerates_a_conflict() -> dict[str, str]:
        try:
            with transaction.atomic():
                fence.create_operations_in_tx([follow_up(op, {"x": 2})])
        except OperationConflict:
            pass
        return {}

    run.local(MARK_PAID, tolerates_a_conflict)
    run.unit.commit()

    assert LedgerEntry.objects.count() == 1
    claimed = set(StepClaim.objects.filter(operation=op).values_list("step", flat=True))
    assert claimed == {INVOICE, MARK_PAID}


def test_a_queue_left_by_an_abandoned_transaction__never_sent_in_another(caplog):
    """A job that left its unit open (the worker's last line rolls it back): its queued
    claim is dropped with it, not committed by the next job's first fence statement."""
    from types import SimpleNamespace

    from payments.engine.worker import abandon_open_transaction

    run = run_first("q-7")
    run.local(INVOICE, ledger_line("a", run.operation))
    abandon_open_transaction(SimpleNamespace(id="job-1"))

    other = pending_checkout("q-8")
    with transaction.atomic():
        fence.create_operations_in_tx([follow_up(other, {"x": 1})])

    assert not StepClaim.objects.filter(operation=run.operation).exists()
    assert LedgerEntry.objects.count() == 0


def test_a_queue_whose_transaction_ended_unseen__discarded_loudly(caplog):
    """Even without the worker's last line: a queued claim whose transaction is gone is
    discarded at the next fence statement, with an error in the log."""
    run = run_first("q-9")
    run.local(INVOICE, ledger_line("a", run.operation))
    run.unit._atomic.__exit__(None, None, None)  # a bug ends the unit past the fence
    run.unit._atomic = None

    other = pending_checkout("q-10")
    with transaction.atomic():
        fence.create_operations_in_tx([follow_up(other, {"x": 1})])

    assert not StepClaim.objects.filter(operation=run.operation).exists()
    assert not fence.has_queued()
    assert "queued in a transaction that ended without them" in caplog.text


def follow_up(parent: Operation, params: dict[str, int]) -> fence.NewOperation:
    return fence.NewOperation(
        key=f"{parent.pk}:optional",
        kind=COUNT_SALE,
        scope=KeyScope.DERIVED,
        parent=parent,
        entity_type="order",
        entity_id=parent.params["order_id"],
        params=params,
        actor="t",
    )
