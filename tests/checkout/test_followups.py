"""Follow-ups of a paid order behind the inbox; e-mails behind a step claim.

Transactional tests: the inbox row, the handler's writes and the operation's
state must be committed for a redelivery (or another process) to see them.
"""

from __future__ import annotations

import pytest
from django.core import mail
from django.core.mail import send_mail
from django.db import connection

from inbox.handlers import inbox_guard
from inbox.models import InboxEntry
from payments.checkout import followups
from payments.checkout import handler as checkout_module
from payments.checkout.names import COUNT_SALE, RECORD_SALE
from payments.engine import fence
from payments.engine.dispatch import dispatch, message_id_for
from payments.models import ClaimState, KeyScope, Operation, OperationState
from payments.shop.models import LedgerEntry, SalesDay
from tests.support import flows
from tests.support.workers import (
    FORKING,
    run_worker,
    start_worker,
    stop_worker,
    wait_until,
    worker_env,
)

pytestmark = pytest.mark.django_db(transaction=True)


def follow_up(parent: Operation, kind: str) -> Operation:
    return Operation.objects.get(parent=parent, kind=kind)


def test_paid_order__writes_follow_ups_once_each(provider, queue):
    order, op = flows.order_and_checkout(key="fu-1")

    run_worker(queue)

    for kind, consumer in ((RECORD_SALE, "ledger"), (COUNT_SALE, "sales_stats")):
        fu = follow_up(op, kind)
        assert fu.state == OperationState.SUCCEEDED
        assert (
            InboxEntry.objects.filter(
                consumer=consumer, message_id=message_id_for(fu.key, fu.scope)
            ).count()
            == 1
        )
    assert LedgerEntry.objects.filter(order=order).count() == 1
    day = SalesDay.objects.get(currency="eur")
    assert (day.orders, day.total) == (1, order.amount)


def test_redelivered_message_after_commit__is_skipped(provider, queue, caplog):
    order, op = flows.order_and_checkout(key="fu-1")
    run_worker(queue)
    fu = follow_up(op, RECORD_SALE)

    caplog.set_level("INFO", logger="inbox")
    dispatch(fu.pk)  # the same message again: same id, handler already committed
    run_worker(queue)

    assert LedgerEntry.objects.filter(order=order).count() == 1
    assert f"Skipping message {message_id_for(fu.key, fu.scope)} for ledger" in caplog.text


def test_crash_before_commit__message_runs_again_and_counts_once(provider, queue, monkeypatch):
    calls = {"n": 0}
    real_add = followups.add_to_sales_day

    def failing_once(*args, **kwargs):
        real_add(*args, **kwargs)  # the counter is added to, then the handler dies
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("database went away mid-handler")

    monkeypatch.setattr(followups, "add_to_sales_day", failing_once)
    order, op = flows.order_and_checkout(key="fu-1")

    run_worker(queue)  # first delivery rolls back; RQ's retry delivers it again

    fu = follow_up(op, COUNT_SALE)
    assert fu.state == OperationState.SUCCEEDED
    assert fu.attempts == 1
    day = SalesDay.objects.get(currency="eur")
    assert (day.orders, day.total) == (1, order.amount)


def test_crash_after_commit_before_ack__real_worker_skips_the_redelivery(provider, queue, tmp_path):
    order, op = flows.order_and_checkout(key="fu-crash")
    marker = tmp_path / "failpoint"
    env = worker_env(
        provider.url, FENCE_FAILPOINTS="after_inbox_commit", FENCE_FAILPOINT_MARKER=str(marker)
    )
    # The forking Worker hands a job whose work horse died back at once; with the
    # default FenceWorker the whole worker dies and RQ's abandoned-job cleanup
    # redelivers it later (tests/crash/test_inbox_crashes.py covers that path).
    worker = start_worker(env, name="fu-crash", worker_class=FORKING)
    try:
        wait_until(
            lambda: (
                Operation.objects.filter(parent=op, state=OperationState.SUCCEEDED).count() == 2
            ),
            timeout=40,
            what="both follow-ups to succeed",
        )
        # The killed delivery is handed back by RQ with the same id; wait until
        # both follow-up messages' jobs ran to the end (the redelivery included).
        ids = [
            message_id_for(fence.follow_up_key(op, kind), KeyScope.DERIVED)
            for kind in (RECORD_SALE, COUNT_SALE)
        ]
        wait_until(
            lambda: all(
                (job := queue.fetch_job(i)) is not None and job.get_status() == "finished"
                for i in ids
            ),
            timeout=20,
            what="the redelivery to finish",
        )
    finally:
        stderr = stop_worker(worker)

    assert marker.with_name("failpoint.after_inbox_commit").exists()
    assert "Skipping message" in stderr
    assert LedgerEntry.objects.filter(order=order).count() == 1
    day = SalesDay.objects.get(currency="eur")
    assert (day.orders, day.total) == (1, order.amount)


def test_inbox_does_not_protect_an_email__it_is_sent_again_after_a_rollback(settings):
    """Documents the limit: the inbox protects database writes, not e-mails or HTTP."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    mail.outbox = []

    def handler() -> None:
        send_mail("hello", "body", None, ["x@example.com"])
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    with pytest.raises(RuntimeError):
        with inbox_guard("mailer", "a" * 32) as first:
            assert first
            handler()
            raise RuntimeError("crash before commit")
    with inbox_guard("mailer", "a" * 32) as first:
        assert first  # the row rolled back, so the message runs again...
        handler()

    assert len(mail.outbox) == 2  # ...and the e-mail went out twice
    assert InboxEntry.objects.filter(consumer="mailer").count() == 1


def test_confirmation_email__step_claim_keeps_it_at_most_once_after_a_crash(
    provider, queue, monkeypatch
):
    class Crash(BaseException):
        """A process death between sending and recording (not an Exception)."""

    real_send = checkout_module.send_confirmation

    def send_then_die(order_id: int, reference: str):
        real_send(order_id, reference)
        raise Crash

    monkeypatch.setattr(checkout_module, "send_confirmation", send_then_die)
    order, op = flows.order_and_checkout(key="mail-crash")

    # The work horse dies after sending; RQ hands the job back and the same
    # worker (this process) runs it again.
    run_worker(queue)

    op.refresh_from_db()
    claim = op.claims.get(step="confirmation_email")
    assert op.state == OperationState.SUCCEEDED
    assert len(mail.outbox) == 1
    assert claim.state == ClaimState.DONE
    assert claim.result["skipped"] is True
