"""A call's outcome, known outside, is queued in the run's open transaction: it goes in
front of the unit's next fence statement or with its COMMIT, in no round trip and no
commit of its own (payments.engine.fence.queue_outcome_in_tx, WorkUnit.record_outcome).

What must hold: the charge's outcome commits with the handler's next writes, before the
next call (the e-mail's claim is in the same COMMIT); a rollback of the unit never loses
it (it is written again alone); if it settles nothing when sent (the claim was taken over
meanwhile), nothing queued behind it runs, no COMMIT, no e-mail, and the unit rolls back.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE, CONFIRMATION_EMAIL, INVOICE
from payments.checkout.orders import create_order
from payments.engine import fence
from payments.engine.effects import DeliveryPolicy
from payments.engine.handlers import Run, get_handler
from payments.engine.writes import fence_writes
from payments.exceptions import OutcomeRefused
from payments.models import ClaimState, Operation, OperationEvent, StepClaim
from payments.shop.models import LedgerEntry
from tests.support.concurrency import on_another_connection

pytestmark = pytest.mark.django_db(transaction=True)


def leased_run(key: str, worker: str = "a/1") -> Run:
    order = create_order(amount=1300, currency="eur", email="o@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    leased = fence.acquire_lease(op.pk, owner=worker, seconds=30)
    return Run(
        leased.operation, worker, get_handler(op.kind), claimed_at_lease=leased.claimed_steps
    )


def ledger_line(op: Operation):
    def write() -> dict[str, str]:
        LedgerEntry.objects.create(
            order_id=op.params["order_id"], amount=1, currency="eur", provider_reference="a"
        )
        return {"by": "a"}

    return write


def charge_claim(op: Operation) -> StepClaim:
    return StepClaim.objects.get(operation=op, step=CHARGE)


def test_the_charge_outcome_waits_for_the_next_fence_statement__and_commits_with_it(provider):
    run = leased_run("qo-1")
    result = run.external(CHARGE)

    assert result["reference"].startswith("pi_") and fence.has_queued()
    seen: list[str] = []
    on_another_connection(lambda: seen.append(charge_claim(run.operation).state))
    assert seen == [ClaimState.CLAIMED]  # not committed yet: nothing was sent

    run.local(INVOICE, ledger_line(run.operation))
    run.unit.commit()  # the outcome and the invoice's claim go with the COMMIT

    claim = charge_claim(run.operation)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, result["reference"])
    assert claim.result == result
    assert OperationEvent.objects.filter(
        operation=run.operation, step=CHARGE, from_state="claimed", to_state="done"
    ).exists()
    assert StepClaim.objects.get(operation=run.operation, step=INVOICE).state == ClaimState.DONE


def test_the_charge_outcome_commits_with_the_email_claim__before_the_email(provider, mailoutbox):
    run = leased_run("qo-2")
    reference = run.external(CHARGE)["reference"]
    states_when_sent: list[tuple[str, str]] = []

    def send() -> dict[str, bool]:
        on_another_connection(
            lambda: states_when_sent.extend(
                StepClaim.objects.filter(operation=run.operation).values_list("step", "state")
            )
        )
        return {"sent": True}

    run.side_effect(CONFIRMATION_EMAIL, send, policy=DeliveryPolicy.AT_MOST_ONCE)

    assert (CHARGE, ClaimState.DONE) in states_when_sent
    assert (CONFIRMATION_EMAIL, ClaimState.CLAIMED) in states_when_sent
    assert charge_claim(run.operation).provider_reference == reference
    assert fence.has_queued()  # the e-mail's outcome, in turn, waits for the next statement
    run.unit.commit()
    email = StepClaim.objects.get(operation=run.operation, step=CONFIRMATION_EMAIL)
    assert (email.state, email.result["sent"]) == (ClaimState.DONE, True)


def test_a_step_failing_after_the_call__the_outcome_is_written_alone(provider, caplog):
    run = leased_run("qo-3")
    reference = run.external(CHARGE)["reference"]

    def broken() -> dict:
        raise RuntimeError("invoice numbering bug")

    with pytest.raises(RuntimeError):
        run.local(INVOICE, broken)

    claim = charge_claim(run.operation)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert not StepClaim.objects.filter(operation=run.operation, step=INVOICE).exists()
    assert not fence.has_queued() and not run.unit.is_open


def test_a_refused_outcome__nothing_behind_it_runs__no_email_claim_no_email(
    provider, mailoutbox, caplog
):
    """The run's lease and the charge's claim ran out during the call; another worker took
    the claim over. The outcome settles nothing: the invoice's claim, the e-mail's claim
    and the COMMIT behind it do not run, the e-mail is not sent, the invoice rolls back,
    and the claim stays the other worker's to settle (not written again by this run)."""
    run = leased_run("qo-4")
    run.external(CHARGE)

    def take_over() -> None:  # another worker, its own connection (this run's unit is open)
        with fence_writes():  # time, shortened: the claim's lease ran out during the call
            StepClaim.objects.filter(operation=run.operation, step=CHARGE).update(
                lease_expires_at=timezone.now() - timedelta(seconds=1)
            )
        assert fence.take_over_claim(charge_claim(run.operation), owner="b/2", lease_seconds=30)

    on_another_connection(take_over)
    run.local(INVOICE, ledger_line(run.operation))
    sent: list[str] = []

    caplog.set_level(logging.WARNING, logger="payments.engine.fence")
    caplog.set_level(logging.INFO, logger="payments.engine.telemetry")  # the handler: INFO
    with pytest.raises(OutcomeRefused, match="not settled"):
        run.side_effect(
            CONFIRMATION_EMAIL,
            lambda: sent.append("mail") or {},
            policy=DeliveryPolicy.AT_MOST_ONCE,
        )

    assert sent == [] and mailoutbox == []
    claim = charge_claim(run.operation)
    assert (claim.state, claim.claimed_by, claim.provider_reference) == ("uncertain", "b/2", "")
    assert not StepClaim.objects.filter(operation=run.operation, step=INVOICE).exists()
    assert not StepClaim.objects.filter(operation=run.operation, step=CONFIRMATION_EMAIL).exists()
    assert LedgerEntry.objects.count() == 0
    assert "not written again" in caplog.text
    assert not fence.has_queued() and not run.unit.is_open
    (end,) = [
        r
        for r in caplog.records
        if getattr(r, "event", None) == "step.end" and r.step == CONFIRMATION_EMAIL
    ]
    # Taken over meanwhile: busy, and this run's open transaction rolled back.
    assert (end.outcome, end.transaction, end.error) == ("busy", "rollback", "OutcomeRefused")


def test_queue_outcome_outside_a_transaction__refused(provider):
    run = leased_run("qo-5")
    claimed = fence.claim_step(run.operation, CHARGE, owner="a/1", lease_seconds=30)

    with pytest.raises(Exception, match="inside transaction.atomic"):
        fence.queue_outcome_in_tx(claimed.claim, ClaimState.DONE, actor="a/1")
    with transaction.atomic():
        fence.queue_outcome_in_tx(claimed.claim, ClaimState.DONE, actor="a/1", result={})
        fence.send_queued_in_tx()
    assert charge_claim(run.operation).state == ClaimState.DONE


def test_refused_with_the_release__deferred_uncounted__the_claim_left_to_its_owner(
    provider, monkeypatch
):
    """A handler returns right after its call: the outcome goes with the release and its
    COMMIT. Refused (the claim was taken over meanwhile), neither runs: the operation is
    looked at again, no attempt counted, and the new owner settles the claim."""
    from payments.engine import runtime
    from payments.models import OperationState

    order = create_order(amount=1300, currency="eur", email="o@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="qo-6", payment_method="pm_card_visa", actor="t"
    )
    leased = fence.acquire_lease(op.pk, owner="a/1", seconds=30)
    spec = get_handler(op.kind)

    def handler(run: Run) -> None:
        run.external(CHARGE)

        def take_over() -> None:
            with fence_writes():  # time, shortened: the claim's lease ran out
                StepClaim.objects.filter(operation=op, step=CHARGE).update(
                    lease_expires_at=timezone.now() - timedelta(seconds=1)
                )
            assert fence.take_over_claim(charge_claim(op), owner="b/2", lease_seconds=30)

        on_another_connection(take_over)

    monkeypatch.setattr(fence, "acquire_lease", lambda *a, **k: leased)
    monkeypatch.setattr(
        runtime,
        "get_handler",
        lambda kind: type(spec)(kind=spec.kind, func=handler, effects=spec.effects),
    )
    assert runtime.execute(op.pk, worker_id="a/1") == "deferred"

    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.RETRYING, 0)
    claim = charge_claim(op)
    assert (claim.state, claim.claimed_by) == (ClaimState.UNCERTAIN, "b/2")
    assert not OperationEvent.objects.filter(operation=op, to_state="succeeded").exists()
