"""A handler's writes between two calls commit together (payments.engine.unit).

The unit changes when a local step's writes commit (with the next claim, or
with the operation's release), never what commits: each test drives the real
checkout or `Run` and looks at the committed rows from the outside.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from django.db import connection, transaction

from payments.checkout import handler as checkout_handler
from payments.checkout.names import CONFIRMATION_EMAIL, MARK_PAID
from payments.engine import fence, runtime
from payments.engine import handlers as handlers_module
from payments.engine.effects import DeliveryPolicy
from payments.engine.handlers import Run, get_handler
from payments.engine.unit import UnitRolledBack
from payments.exceptions import InvalidTransition, RetryLater
from payments.models import ClaimState, Operation, OperationState, StepClaim
from payments.shop.models import Invoice, Order
from tests.support.builders import with_test_steps
from tests.support.concurrency import on_another_connection
from tests.support.flows import checkout
from tests.support.workers import run_fence_worker, run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def claims(op: Operation) -> dict[str, str]:
    return dict(StepClaim.objects.filter(operation=op).values_list("step", "state"))


def test_the_invoice__is_committed_before_the_email_goes(provider, queue, monkeypatch, mailoutbox):
    seen = {}
    send = checkout_handler.send_confirmation

    def watching(order, reference):
        seen["invoices"] = on_another_connection(
            lambda: Invoice.objects.filter(order=order).count()
        )
        seen["email_claim"] = on_another_connection(
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

    def broken_once(order, reference, operation, confirmation):
        if not failures:
            failures.append("mark_paid")
            raise RuntimeError("mark_paid bug")
        return mark_paid(order, reference, operation, confirmation)

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
    run = Run(op, "worker-a/1", with_test_steps(get_handler(op.kind)))
    run.local("first_local", lambda: {"n": 1})

    def failing():
        Invoice.objects.create(
            order_id=op.params["order_id"], number="INV-partial", amount=1, currency="eur"
        )
        raise RuntimeError("second step bug")

    with pytest.raises(RuntimeError):
        run.local("second_local", failing)

    assert claims(op) == {}
    assert not Invoice.objects.filter(number="INV-partial").exists()
    with pytest.raises(UnitRolledBack):  # this run may not go on as if first_local were done
        run.local("third_local", lambda: {"n": 3})
    again = Run(op, "worker-a/1", with_test_steps(get_handler(op.kind)))  # the next attempt
    assert again.local("first_local", lambda: {"n": 2}) == {"n": 2}
    again.unit.commit()
    assert StepClaim.objects.get(operation=op, step="first_local").result == {"n": 2}


def test_the_last_steps_writes_and_the_release__commit_together(provider, queue, monkeypatch):
    """Killed between mark_paid and the release, nothing of mark_paid is committed:
    the order is not paid while its operation is still running."""
    seen = {}
    release = fence.release_held_lease

    def watching(operation, to_state, **kwargs):
        seen["paid_before_release"] = on_another_connection(
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


# --- a failure while the unit ends: nothing stays open, nothing recorded is lost ---------


def cancel_this_statement() -> None:
    """A real database error in the current transaction (as a lock wait or deadlock gives)."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL statement_timeout = 50")
        cursor.execute("SELECT pg_sleep(1)")


def before_the_first_success_release(monkeypatch, failure) -> list[str]:
    """Call `failure` inside the first `succeeded` release; return the keys it hit."""
    release = fence.release_held_lease
    hits: list[str] = []

    def once(operation, to_state, **kwargs):
        if to_state == OperationState.SUCCEEDED and not hits:
            hits.append(operation.key)
            failure()
        return release(operation, to_state, **kwargs)

    monkeypatch.setattr(fence, "release_held_lease", once)
    return hits


def test_a_database_error_in_the_release__rolls_the_unit_back__and_the_retry_pays(
    provider, queue, monkeypatch, mailoutbox
):
    hits = before_the_first_success_release(monkeypatch, cancel_this_statement)
    op = checkout("unit-5")
    run_worker(queue)

    assert hits == ["unit-5"] and not connection.in_atomic_block
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert Order.objects.get(pk=op.params["order_id"]).status == "paid"
    email = StepClaim.objects.get(operation=op, step=CONFIRMATION_EMAIL)
    assert email.result["sent"] is True and len(mailoutbox) == 1


def test_a_database_error_on_a_claim_in_the_unit__keeps_the_emails_outcome(
    provider, queue, monkeypatch, mailoutbox
):
    """An aborted transaction is not "committed" (PostgreSQL would roll it back in
    silence): the unit rolls back and writes the e-mail's outcome again."""
    queue_claim = fence.queue_local_claim_in_tx
    hits = []

    def cancelled_once(operation, step, *, owner, result):
        if step == MARK_PAID and not hits:
            hits.append(step)
            cancel_this_statement()
        return queue_claim(operation, step, owner=owner, result=result)

    monkeypatch.setattr(fence, "queue_local_claim_in_tx", cancelled_once)
    op = checkout("unit-6")
    run_worker(queue)

    op.refresh_from_db()
    assert (hits, op.state) == ([MARK_PAID], OperationState.SUCCEEDED)
    email = StepClaim.objects.get(operation=op, step=CONFIRMATION_EMAIL)
    assert (email.result["sent"], len(mailoutbox)) == (True, 1)


def test_the_jobs_timeout_during_the_release__leaves_no_transaction_open(
    provider, queue, monkeypatch, mailoutbox
):
    """RQ's SIGALRM fires while the lease is released: the unit rolls back, the
    worker's connection stays usable, the retry pays the order and the next
    checkout on the same worker runs."""
    # The job's timeout (JOB_TIMEOUT 3 s in the tests) fires in this sleep.
    slowed = before_the_first_success_release(monkeypatch, lambda: time.sleep(5))
    op = checkout("unit-7")
    run_fence_worker(queue)

    assert slowed == ["unit-7"] and not connection.in_atomic_block
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert Order.objects.get(pk=op.params["order_id"]).status == "paid"
    assert len(mailoutbox) == 1
    second = checkout("unit-8")
    run_fence_worker(queue)
    second.refresh_from_db()
    assert second.state == OperationState.SUCCEEDED


def test_a_job_that_leaves_a_transaction_open__is_rolled_back_by_the_worker(queue, caplog):
    queue.enqueue(leave_a_transaction_open)
    run_fence_worker(queue)

    assert not connection.in_atomic_block
    assert "left a transaction open" in caplog.text
    # Rolled back, and the connection works again (Django reconnected).
    assert not Order.objects.filter(customer_email="left-open@example.com").exists()


def leave_a_transaction_open() -> None:
    """A job that enters atomic() and returns inside it (what a bug would do)."""
    transaction.atomic().__enter__()
    Order.objects.create(amount=1, currency="eur", customer_email="left-open@example.com")


# --- from an outside review: handlers that catch a step's failure, or wrap steps in atomic()


def with_handler(monkeypatch, op: Operation, func) -> None:
    """Run `op` with `func` as its handler (the kind's registration, otherwise unchanged)."""
    spec = with_test_steps(get_handler(op.kind))
    monkeypatch.setitem(handlers_module._HANDLERS, op.kind, dataclasses.replace(spec, func=func))


def test_a_handler_that_catches_a_failing_local_step__does_not_succeed_without_the_steps_before(
    queue, monkeypatch
):
    """The failing step rolled back the local steps since the last claim: returning
    as if they were done would lose them for good. The run refuses, the attempt
    counts as failed, and the next attempt writes them."""
    op = checkout("unit-9")
    attempts = []

    def handler(run):
        run.local("first_local", lambda: {"invoice": "written"})
        try:
            run.local("optional", lambda: {"ratio": 1 / len(attempts)})  # fails on the first try
        except ZeroDivisionError:
            attempts.append("caught")

    with_handler(monkeypatch, op, handler)
    with pytest.raises(RetryLater, match="UnitRolledBack"):
        runtime.execute(op.pk, worker_id="worker-a/1")

    assert claims(op) == {}
    assert runtime.execute(op.pk, worker_id="worker-a/1") == "succeeded"
    assert claims(op) == {"first_local": ClaimState.DONE, "optional": ClaimState.DONE}


def refused_with_the_handler(monkeypatch, op: Operation, handler) -> None:
    """Run `op` once with `handler`: the attempt fails on InvalidTransition (a step in atomic())."""
    with_handler(monkeypatch, op, handler)
    with pytest.raises(RetryLater, match="InvalidTransition"):
        runtime.execute(op.pk, worker_id="worker-a/1")


def send_an_email(run, sent: list[int]) -> None:
    """A side effect whose sending appends to `sent`."""

    def send() -> dict[str, bool]:
        sent.append(1)
        return {"sent": True}

    run.side_effect("email", send, policy=DeliveryPolicy.AT_MOST_ONCE)


def test_a_side_effect_inside_the_handlers_own_atomic__is_refused_before_anything_is_sent(
    queue, monkeypatch
):
    op = checkout("unit-10")
    sent = []

    def handler(run):
        with transaction.atomic():
            send_an_email(run, sent)

    refused_with_the_handler(monkeypatch, op, handler)

    assert (sent, claims(op)) == ([], {})


def test_a_local_step_inside_the_handlers_own_atomic__is_refused__and_the_block_rolls_back(
    queue, monkeypatch
):
    """Opened inside the handler's block, the run's transaction would outlive it and
    commit what the block rolled back."""
    op = checkout("unit-11")

    def handler(run):
        try:
            with transaction.atomic():
                Invoice.objects.create(
                    order_id=op.params["order_id"], number="INV-unit-11", amount=1, currency="eur"
                )
                run.local("x", lambda: {"x": 1})
                raise ValueError("the handler's own block fails")
        except ValueError:
            pass

    refused_with_the_handler(monkeypatch, op, handler)

    assert not Invoice.objects.filter(number="INV-unit-11").exists()
    assert claims(op) == {} and not connection.in_atomic_block


def test_a_step_inside_an_atomic_opened_after_a_local_step__is_refused(queue, monkeypatch):
    op = checkout("unit-12")
    sent = []

    def handler(run):
        run.local("first_local", lambda: {"n": 1})
        with transaction.atomic():
            send_an_email(run, sent)

    refused_with_the_handler(monkeypatch, op, handler)

    assert sent == []
    assert claims(op) == {"first_local": ClaimState.DONE}  # done before the refusal: kept


@pytest.fixture
def fail_once_in_sql():
    """Install a database trigger that fails once: `claim` refuses the e-mail's claim insert,
    `slow claim` makes it take 1 s, `commit` makes the first COMMIT after an invoice
    insert fail (a deferred constraint)."""
    installed: list[str] = []

    def install(where: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("CREATE SEQUENCE test_fail_once")
            if where == "claim":
                cursor.execute(
                    "CREATE FUNCTION test_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN IF NEW.step = 'confirmation_email' AND nextval('test_fail_once') = 1 "
                    "THEN RAISE EXCEPTION 'the claim fails once (test)'; END IF; RETURN NEW; END $$"
                )
                cursor.execute(
                    "CREATE TRIGGER test_fail_once BEFORE INSERT ON payments_stepclaim "
                    "FOR EACH ROW EXECUTE FUNCTION test_fail_once()"
                )
                installed.append("payments_stepclaim")
            elif where == "slow claim":
                cursor.execute(
                    "CREATE FUNCTION test_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN IF NEW.step = 'confirmation_email' AND nextval('test_fail_once') = 1 "
                    "THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END $$"
                )
                cursor.execute(
                    "CREATE TRIGGER test_fail_once BEFORE INSERT ON payments_stepclaim "
                    "FOR EACH ROW EXECUTE FUNCTION test_fail_once()"
                )
                installed.append("payments_stepclaim")
            else:
                cursor.execute(
                    "CREATE FUNCTION test_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN IF nextval('test_fail_once') = 1 "
                    "THEN RAISE EXCEPTION 'the commit fails once (test)'; END IF; RETURN NEW; END $$"
                )
                cursor.execute(
                    "CREATE CONSTRAINT TRIGGER test_fail_once AFTER INSERT ON payments_invoice "
                    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_fail_once()"
                )
                installed.append("payments_invoice")

    yield install
    with connection.cursor() as cursor:
        for table in installed:
            cursor.execute(f"DROP TRIGGER test_fail_once ON {table}")
        cursor.execute("DROP FUNCTION IF EXISTS test_fail_once()")
        cursor.execute("DROP SEQUENCE IF EXISTS test_fail_once")


def failures_seen() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT last_value, is_called FROM test_fail_once")
        value, called = cursor.fetchone()
    return value if called else 0


def paid_once_after_one_failed_attempt(op: Operation, mailoutbox) -> None:
    """The trigger struck, one attempt failed, the retry invoiced and sent once."""
    assert failures_seen() >= 1
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED and op.attempts == 1
    assert Invoice.objects.filter(order_id=op.params["order_id"]).count() == 1
    email = StepClaim.objects.get(operation=op, step=CONFIRMATION_EMAIL)
    assert email.result is not None
    assert (email.result["sent"], email.result["resent"], len(mailoutbox)) == (True, False, 1)


def test_the_emails_claim_failing_with_its_commit__commits_nothing__and_the_retry_sends_once(
    provider, queue, fail_once_in_sql, mailoutbox
):
    """The e-mail's claim and the unit's COMMIT go in one round trip: the claim fails,
    the COMMIT after it is not run, the invoice rolls back with it; nothing was sent,
    and the retry invoices and sends once."""
    fail_once_in_sql("claim")
    op = checkout("unit-pipe-1")
    run_worker(queue)

    paid_once_after_one_failed_attempt(op, mailoutbox)


def test_a_commit_that_fails_after_the_emails_claim__is_not_taken_for_a_commit(
    provider, queue, fail_once_in_sql, mailoutbox
):
    """The COMMIT sent with the e-mail's claim fails (a deferred constraint): the claim
    and the invoice are not durable, so nothing is sent; the retry claims, invoices and
    sends once."""
    fail_once_in_sql("commit")
    op = checkout("unit-pipe-2")
    run_worker(queue)

    paid_once_after_one_failed_attempt(op, mailoutbox)


def test_the_jobs_timeout_while_the_emails_claim_and_commit_are_answered__is_what_is_raised(
    provider, queue, fail_once_in_sql, mailoutbox
):
    """The job's time runs out while the worker waits for the answer to the e-mail's
    claim and its COMMIT: the timeout is what the runtime handles (not psycopg's
    "cannot exit pipeline mode"), the connection left mid-answer is closed, nothing is
    sent, and the next statement runs on a fresh connection."""
    import signal

    from rq.timeouts import JobTimeoutException

    fail_once_in_sql("slow claim")
    op = checkout("unit-pipe-3")

    def time_is_up(signum, frame):
        raise JobTimeoutException("the job's time is up (test)")

    previous = signal.signal(signal.SIGALRM, time_is_up)
    signal.setitimer(signal.ITIMER_REAL, 0.4)
    try:
        with pytest.raises(RetryLater):
            runtime.execute(op.pk, worker_id="worker-a/1")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    op.refresh_from_db()
    assert "JobTimeoutException" in op.last_error, op.last_error
    assert len(mailoutbox) == 0
    raw = connection.connection
    assert raw.pgconn.pipeline_status == 0 and not connection.in_atomic_block


def test_a_connection_lost_while_the_emails_claim_and_commit_are_answered__is_what_is_raised(
    provider, queue, fail_once_in_sql, mailoutbox
):
    """The database connection dies while the e-mail's claim and its COMMIT are being
    answered, inside code that handles an earlier error: the connection's error is what
    the runtime counts (not the earlier, handled one), and nothing is sent."""
    import threading

    import psycopg

    from tests.support.workers import database_url

    fail_once_in_sql("slow claim")
    op = checkout("unit-pipe-4")
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid

    def kill_it():
        time.sleep(0.4)
        with psycopg.connect(database_url(), autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", [pid])

    killer = threading.Thread(target=kill_it)
    killer.start()
    try:
        raise KeyError("an earlier error, handled")
    except KeyError:
        with pytest.raises(RetryLater):
            runtime.execute(op.pk, worker_id="worker-a/1")
    killer.join(10)

    op.refresh_from_db()
    assert op.last_error.startswith("OperationalError"), op.last_error
    assert len(mailoutbox) == 0


def test_a_local_step_refused_inside_atomic__then_run_outside__is_still_its_first_go(
    queue, monkeypatch
):
    """A handler that catches the refusal (a step inside its own atomic()) and runs the
    step outside: that is the step's first go in this run, so its function runs first and
    its claim is queued, as for any step the lease found unclaimed (a reviewer found the
    refused call counted as the step's go: the claim went first, in a round trip of its
    own)."""
    op = checkout("unit-13")
    inserted_first = []
    insert = fence.insert_local_claim_in_tx

    def recording_insert(operation, step, **kwargs):
        inserted_first.append(step)
        return insert(operation, step, **kwargs)

    monkeypatch.setattr(fence, "insert_local_claim_in_tx", recording_insert)

    def handler(run):
        try:
            with transaction.atomic():
                run.local("x", lambda: {"x": 1})
        except InvalidTransition:
            pass
        run.local("x", lambda: {"x": 1})

    with_handler(monkeypatch, op, handler)
    assert runtime.execute(op.pk, worker_id="worker-a/1") == "succeeded"

    assert inserted_first == []
    assert claims(op) == {"x": ClaimState.DONE}
