"""A handler's writes between two calls commit together (payments.engine.unit).

The unit changes when a local step's writes commit (with the next claim, or
with the operation's release), never what commits: each test drives the real
checkout or `Run` and looks at the committed rows from the outside.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from payments.checkout import handler as checkout_handler
from payments.checkout.names import CONFIRMATION_EMAIL
from payments.engine import fence
from payments.engine.handlers import Run, get_handler
from payments.models import ClaimState, Invoice, Operation, OperationState, Order, StepClaim
from tests.support.flows import checkout
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def committed(query):
    """Run `query` on another connection: what is committed, not what this one sees."""
    found = []

    def look() -> None:
        try:
            found.append(query())
        finally:
            connection.close()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(20)
    return found[0]


def claims(op: Operation) -> dict[str, str]:
    return dict(StepClaim.objects.filter(operation=op).values_list("step", "state"))


def test_the_invoice__is_committed_before_the_email_goes(provider, queue, monkeypatch, mailoutbox):
    seen = {}
    send = checkout_handler.send_confirmation

    def watching(order, reference):
        seen["invoices"] = committed(lambda: Invoice.objects.filter(order=order).count())
        seen["email_claim"] = committed(
            lambda: StepClaim.objects.filter(step=CONFIRMATION_EMAIL).values_list(
                "state", flat=True
            )[0]
        )
        return send(order, reference)

    monkeypatch.setattr(checkout_handler, "send_confirmation", watching)
    op = checkout("unit-1")
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert seen == {"invoices": 1, "email_claim": ClaimState.CLAIMED}
    assert len(mailoutbox) == 1


def test_a_step_failing_after_the_email__keeps_the_emails_outcome__and_the_retry_sends_none(
    provider, queue, monkeypatch, mailoutbox
):
    """The e-mail's `done` is written in the same open transaction as mark_paid,
    which rolls back once: the outcome is written again on its own, so the
    retry skips the e-mail as sent (not as "unknown") and pays the order once."""
    failures = []
    mark_paid = checkout_handler.mark_paid

    def broken_once(order, reference, operation):
        if not failures:
            failures.append("mark_paid")
            raise RuntimeError("mark_paid bug")
        return mark_paid(order, reference, operation)

    monkeypatch.setattr(checkout_handler, "mark_paid", broken_once)
    op = checkout("unit-2")
    run_worker(queue)

    op.refresh_from_db()
    assert (op.state, op.attempts, failures) == (OperationState.SUCCEEDED, 1, ["mark_paid"])
    email = StepClaim.objects.get(operation=op, step=CONFIRMATION_EMAIL)
    assert (email.state, email.result["sent"], email.result["resent"]) == (
        ClaimState.DONE,
        True,
        False,
    )
    assert len(mailoutbox) == 1
    assert Order.objects.get(pk=op.params["order_id"]).status == "paid"
    assert Operation.objects.filter(parent=op).count() == 2


def test_a_local_step_that_raises__rolls_back_the_local_steps_since_the_last_claim(queue):
    op = checkout("unit-3")
    op = fence.acquire_lease(op.pk, owner="worker-a/1", seconds=30).operation
    run = Run(op, "worker-a/1", get_handler(op.kind))
    run.local("first_local", lambda: {"n": 1})

    def failing():
        Invoice.objects.create(
            order_id=op.params["order_id"], number="INV-partial", amount=1, currency="eur"
        )
        raise RuntimeError("second step bug")

    with pytest.raises(RuntimeError):
        run.local("second_local", failing)
    run.unit.commit()  # what the runtime does before it handles the error: nothing is left

    assert claims(op) == {}
    assert not Invoice.objects.filter(number="INV-partial").exists()
    assert run.local("first_local", lambda: {"n": 2}) == {"n": 2}  # runs again
    run.unit.commit()
    assert StepClaim.objects.get(operation=op, step="first_local").result == {"n": 2}


def test_the_last_steps_writes_and_the_release__commit_together(provider, queue, monkeypatch):
    """Killed between mark_paid and the release, nothing of mark_paid is committed:
    the order is not paid while its operation is still running."""
    seen = {}
    release = fence.release_held_lease

    def watching(operation, to_state, **kwargs):
        seen["paid_before_release"] = committed(
            lambda: Order.objects.get(pk=operation.params["order_id"]).status
        )
        return release(operation, to_state, **kwargs)

    monkeypatch.setattr(fence, "release_held_lease", watching)
    op = checkout("unit-4")
    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert seen == {"paid_before_release": "processing"}
    assert Order.objects.get(pk=op.params["order_id"]).status == "paid"
