"""The one-statement transitions under races, clock skew and redelivery (an outside review's tests).

Four of them failed on the first version of the rewrite and pass since: a
retry of a key committed while the request waited for the order's lock is a
replay, not a 409; the audit trail is ordered by one clock; a done local
step is replayed without running its function; a worker without the kind's
handler leaves another worker's live lease alone.

Concurrency is driven with a second thread (its own Django connection) that
holds a transaction open; the main thread's statement is started in a third
thread and we wait until PostgreSQL shows it blocked on a lock before the
holder commits.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import create_order
from payments.engine import fence
from payments.engine.writes import fence_writes
from payments.exceptions import NotClaimOwner, RetryLater
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim
from tests.support.builders import with_test_steps

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "worker-a/1"


def _pending_checkout(key: str) -> Operation:
    order = create_order(amount=1200, currency="eur", email="r@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    return op


def _wait_until_blocked(timeout: float = 10.0) -> None:
    """Wait until some other backend of this database waits on a lock."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                "AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError("the second statement never blocked")


class _Thread(threading.Thread):
    def __init__(self, target):
        super().__init__(daemon=True)
        self._target_fn = target
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            connections.close_all()


def _hold_then(work, hold_started: threading.Event, release: threading.Event):
    """In its own transaction: do `work`, signal, wait, commit."""

    def run():
        with transaction.atomic():
            value = work()
            hold_started.set()
            assert release.wait(20)
        return value

    return run


# --- F1: request_checkout's one annotated SELECT ... FOR UPDATE reads a stale snapshot ---


def test_concurrent_replay_of_the_same_key__returns_the_operation_not_order_not_open(queue):
    """A client retries its checkout (same Idempotency-Key) while the first is committing.

    The parent commit read the key in a statement issued after the order's row lock
    was granted (fresh snapshot); 43c0260 computes `key_known` in the locking
    statement itself: after the lock wait, EvalPlanQual re-reads the ORDER row
    (now `processing`) but the Exists() subquery keeps the statement's old snapshot,
    so the key looks unknown and the replay is refused as `order_not_open`.
    """
    order = create_order(amount=1200, currency="eur", email="r@example.com")
    started, release = threading.Event(), threading.Event()
    first = _Thread(
        _hold_then(
            lambda: request_checkout(
                order_id=order.pk, key="same-key", payment_method="pm_card_visa", actor="api"
            ),
            started,
            release,
        )
    )
    first.start()
    assert started.wait(20)
    second = _Thread(
        lambda: request_checkout(
            order_id=order.pk, key="same-key", payment_method="pm_card_visa", actor="api"
        )
    )
    second.start()
    _wait_until_blocked()
    release.set()
    first.join(20)
    second.join(20)
    assert first.error is None, first.error
    op, created = first.result
    assert created
    # The replay must be the same operation, not a refusal.
    assert not isinstance(second.error, CheckoutNotAllowed), second.error
    assert second.error is None, second.error
    assert second.result[0].pk == op.pk and second.result[1] is False


# --- F2: audit rows stamped by two clocks, ordered by created_at -------------------------


def test_audit_trail_order__survives_an_app_clock_ahead_of_the_database(queue):
    """OperationEvent is ordered by (created_at, id). One-statement transitions stamp it with
    statement_timestamp() (the DB's clock), the ORM ones (take-over, release, give-up, the
    desk) with timezone.now() (the host's clock). With a host 5 s ahead of the database,
    a settle written after a take-over sorts before it."""
    op = fence.acquire_lease(_pending_checkout("clock-1").pk, owner=WORKER, seconds=30).operation
    claim = fence.claim_step(op, "charge", owner=WORKER, lease_seconds=30).claim
    with fence_writes():  # the lease runs out (as the fence's own tests hand-make it)
        StepClaim.objects.filter(pk=claim.pk).update(
            lease_expires_at=timezone.now() - timedelta(seconds=1)
        )
    ahead = timezone.now() + timedelta(seconds=5)
    real_now = timezone.now
    with mock.patch("django.utils.timezone.now", lambda: real_now() + timedelta(seconds=5)):
        taken = fence.take_over_claim(claim, owner="worker-b/2", lease_seconds=30)
        assert taken is not None
        fence.settle_claim(taken, ClaimState.DONE, actor="worker-b/2", reference="pi_1")
    assert ahead  # (the patched clock was in force for both calls)
    trail = list(
        OperationEvent.objects.filter(operation=op, step="charge").values_list(
            "from_state", "to_state"
        )
    )  # the model's ordering: created_at, id
    assert trail == [
        ("", ClaimState.CLAIMED),
        (ClaimState.CLAIMED, ClaimState.UNCERTAIN),
        (ClaimState.UNCERTAIN, ClaimState.DONE),
    ], trail


# --- controls: the EvalPlanQual cases the brief asks about (expected to hold) -----------


def test_acquire_lease__waiting_behind_a_lease_taker__does_not_take_its_live_lease(queue):
    op = _pending_checkout("epq-1")
    started, release = threading.Event(), threading.Event()
    holder = _Thread(
        _hold_then(
            lambda: fence.acquire_lease(op.pk, owner="holder/1", seconds=60), started, release
        )
    )
    holder.start()
    assert started.wait(20)
    waiter = _Thread(lambda: fence.acquire_lease(op.pk, owner="waiter/2", seconds=60))
    waiter.start()
    _wait_until_blocked()
    release.set()
    holder.join(20)
    waiter.join(20)
    assert holder.error is None and waiter.error is None, (holder.error, waiter.error)
    assert holder.result.acquired
    assert not waiter.result.acquired
    op.refresh_from_db()
    assert op.lease_owner == "holder/1"
    assert OperationEvent.objects.filter(operation=op, to_state=OperationState.RUNNING).count() == 1


def test_settle__waiting_behind_a_take_over__is_refused(queue):
    op = fence.acquire_lease(_pending_checkout("epq-2").pk, owner=WORKER, seconds=30).operation
    claim = fence.claim_step(op, "charge", owner=WORKER, lease_seconds=30).claim
    with fence_writes():
        StepClaim.objects.filter(pk=claim.pk).update(
            lease_expires_at=timezone.now() - timedelta(seconds=1)
        )
    started, release = threading.Event(), threading.Event()
    taker = _Thread(
        _hold_then(
            lambda: fence.take_over_claim(claim, owner="worker-b/2", lease_seconds=30),
            started,
            release,
        )
    )
    taker.start()
    assert started.wait(20)
    late = _Thread(
        lambda: fence.settle_claim(claim, ClaimState.DONE, actor=WORKER, reference="pi_late")
    )
    late.start()
    _wait_until_blocked()
    release.set()
    taker.join(20)
    late.join(20)
    assert taker.error is None, taker.error
    assert isinstance(late.error, NotClaimOwner), late.error
    row = StepClaim.objects.get(pk=claim.pk)
    assert (row.state, row.claimed_by, row.provider_reference) == (
        ClaimState.UNCERTAIN,
        "worker-b/2",
        "",
    )


def test_release_held_lease__waiting_behind_a_take_over__changes_nothing(queue):
    op = fence.acquire_lease(_pending_checkout("epq-3").pk, owner=WORKER, seconds=30).operation
    with fence_writes():
        Operation.objects.filter(pk=op.pk).update(
            lease_expires_at=timezone.now() - timedelta(seconds=1)
        )
    started, release = threading.Event(), threading.Event()
    taker = _Thread(
        _hold_then(
            lambda: fence.acquire_lease(op.pk, owner="worker-b/2", seconds=60), started, release
        )
    )
    taker.start()
    assert started.wait(20)
    late = _Thread(
        lambda: fence.release_held_lease(op, OperationState.SUCCEEDED, owner=WORKER, reason="x")
    )
    late.start()
    _wait_until_blocked()
    release.set()
    taker.join(20)
    late.join(20)
    assert taker.error is None and late.error is None, (taker.error, late.error)
    assert taker.result.acquired
    assert late.result is None
    op.refresh_from_db()
    assert (op.state, op.lease_owner) == (OperationState.RUNNING, "worker-b/2")


def _local(run, step, fn):
    """Run one local step as the runtime would: its open transaction ends with the run."""
    try:
        return run.local(step, fn)
    finally:
        run.unit.commit()


def _first_run_holding(run, step: str, fn) -> tuple[_Thread, threading.Event]:
    """Run `run`'s local step on a thread of its own and keep its open transaction until
    the returned event is set (then commit it); return the thread and the event."""
    started, release = threading.Event(), threading.Event()

    def hold():
        value = run.local(step, fn)
        fence.send_queued_in_tx()  # a run-first step's claim: sent, not committed
        started.set()
        assert release.wait(20)
        run.unit.commit()
        return value

    first = _Thread(hold)
    first.start()
    assert started.wait(20)
    return first, release


def _second_behind_first(first: _Thread, release: threading.Event, target) -> _Thread:
    """Start `target` on a second thread, let it block behind `first`, release `first`;
    return the second once both ended."""
    second = _Thread(target)
    second.start()
    _wait_until_blocked()
    release.set()
    first.join(20)
    second.join(20)
    return second


def test_local_claim__concurrent_duplicate__writes_once(queue):
    """Run.local's claim after the writes: the second waits on ON CONFLICT and rolls back."""
    from payments.engine.handlers import Run, get_handler

    op = fence.acquire_lease(_pending_checkout("loc-1").pk, owner=WORKER, seconds=30).operation
    spec = with_test_steps(get_handler(op.kind))
    calls: list[str] = []

    def first_fn():
        calls.append("first")
        return {"n": 1}

    first, release = _first_run_holding(Run(op, "a/1", spec), "review_step", first_fn)

    def second_fn():
        calls.append("second")
        return {"n": 2}

    second = _second_behind_first(
        first, release, lambda: _local(Run(op, "b/2", spec), "review_step", second_fn)
    )
    assert first.error is None and second.error is None, (first.error, second.error)
    assert first.result == {"n": 1} and second.result == {"n": 1}
    assert StepClaim.objects.get(operation=op, step="review_step").claimed_by == "a/1"
    assert OperationEvent.objects.filter(operation=op, step="review_step").count() == 1


def test_local_step_run_first__concurrent_duplicate__rolls_its_writes_back(queue):
    """Two runs whose leases both found the step unclaimed (an operation the reconciler
    moved on while its first owner still ran) both run the function; the second's claim,
    sent with its COMMIT, waits on the first's and, once the first commits, finds it
    taken: nothing behind it runs, its writes roll back and StepDoneMeanwhile runs the
    operation again. The step's writes exist once."""
    from payments.engine.handlers import Run, get_handler
    from payments.exceptions import StepDoneMeanwhile
    from payments.shop.models import LedgerEntry

    leased = fence.acquire_lease(_pending_checkout("loc-2").pk, owner=WORKER, seconds=30)
    op, spec = leased.operation, with_test_steps(get_handler(leased.operation.kind))
    assert leased.claimed_steps == frozenset()

    def write(who):
        def fn():
            LedgerEntry.objects.create(
                order_id=op.params["order_id"], amount=1, currency="eur", provider_reference=who
            )
            return {"by": who}

        return fn

    first, release = _first_run_holding(
        Run(op, "a/1", spec, claimed_at_lease=leased.claimed_steps), "review_step", write("first")
    )
    second_run = Run(op, "b/2", spec, claimed_at_lease=leased.claimed_steps)

    def second_local_and_commit():
        second_run.local("review_step", write("second"))
        second_run.unit.commit()  # its claim goes with the COMMIT, and waits on the first's

    second = _second_behind_first(first, release, second_local_and_commit)
    assert first.error is None and first.result == {"by": "first"}
    assert isinstance(second.error, StepDoneMeanwhile), second.error
    assert list(LedgerEntry.objects.values_list("provider_reference", flat=True)) == ["first"]
    claim = StepClaim.objects.get(operation=op, step="review_step")
    assert (claim.claimed_by, claim.result) == ("a/1", {"by": "first"})
    assert OperationEvent.objects.filter(operation=op, step="review_step").count() == 1


def _ledger_follow_up(key: str, reference: str) -> Operation:
    """A checkout's ledger follow-up operation, created as mark_paid creates it."""
    from payments.checkout.names import RECORD_SALE

    parent = _pending_checkout(key)
    params = {"order_id": parent.params["order_id"], "amount": 5, "currency": "eur"}
    with transaction.atomic():
        op, _ = fence.create_operation_in_tx(
            key=fence.follow_up_key(parent, RECORD_SALE),
            kind=RECORD_SALE,
            entity_type="order",
            entity_id=parent.params["order_id"],
            params={**params, "reference": reference},
            actor="t",
            parent=parent,
            scope="derived",
        )
    return op


def test_deliver_message__concurrent_duplicate_delivery__runs_the_handler_once(queue, monkeypatch):
    """Two workers deliver one follow-up message at once (a redelivery while the first
    still runs its handler): the second's DELIVER_MESSAGE waits on the first's inbox row
    and, once the first commits, records nothing and skips the handler."""
    from payments.checkout.names import LEDGER_CONSUMER, RECORD_SALE
    from payments.engine import handlers
    from payments.engine.dispatch import message_id_for
    from payments.shop.models import LedgerEntry

    op = _ledger_follow_up("msg-1", "pi_1")
    message = (LEDGER_CONSUMER, message_id_for(op.key, op.scope))
    monkeypatch.setattr(handlers, "current_message", lambda consumer: message)
    started, release = threading.Event(), threading.Event()
    create = LedgerEntry.objects.create

    def slow_create(**fields):
        started.set()
        assert release.wait(20)
        return create(**fields)

    monkeypatch.setattr(LedgerEntry.objects, "create", slow_create)
    deliver = handlers.get_handler(RECORD_SALE).func
    first = _Thread(lambda: deliver(op.pk, "a/1"))
    first.start()
    assert started.wait(20)
    second = _second_behind_first(first, release, lambda: deliver(op.pk, "b/2"))

    assert (first.error, second.error) == (None, None)
    assert (first.result, second.result) == ("delivered", None)
    assert LedgerEntry.objects.filter(provider_reference="pi_1").count() == 1
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert list(OperationEvent.objects.filter(operation=op).values_list("to_state", "actor")) == [
        (OperationState.PENDING, "t"),
        (OperationState.SUCCEEDED, "a/1"),
    ]


def test_deliver_message__an_operation_that_may_not_succeed__rolls_back_its_inbox_row(
    queue, monkeypatch
):
    """A message delivered again after its inbox row was purged finds its operation
    succeeded: DELIVER_MESSAGE changes nothing, the refusal rolls the new inbox row back."""
    from inbox.models import InboxEntry
    from payments.checkout.names import LEDGER_CONSUMER, RECORD_SALE
    from payments.engine import handlers
    from payments.exceptions import IllegalTransition
    from payments.shop.models import LedgerEntry

    op = _ledger_follow_up("msg-2", "pi_2")
    monkeypatch.setattr(handlers, "current_message", lambda consumer: (LEDGER_CONSUMER, "m-2"))
    deliver = handlers.get_handler(RECORD_SALE).func
    assert deliver(op.pk, "a/1") == "delivered"
    InboxEntry.objects.all().delete()  # purged

    with pytest.raises(IllegalTransition):
        deliver(op.pk, "b/2")

    assert not InboxEntry.objects.exists()
    assert LedgerEntry.objects.filter(provider_reference="pi_2").count() == 1
    assert OperationEvent.objects.filter(operation=op, to_state="succeeded").count() == 1


def _a_worker_holding_the_invoice(
    op: Operation, started, release, *, claim_sent: bool = True
) -> _Thread:
    """Worker a/1 leases the checkout, writes its invoice step, keeps its transaction open
    (the invoice's claim sent with it, or still queued for a/1's next fence statement)."""
    from payments.checkout.handler import issue_invoice
    from payments.checkout.names import INVOICE
    from payments.engine.handlers import Run, get_handler
    from payments.shop.models import Order

    leased = fence.acquire_lease(op.pk, owner="a/1", seconds=30)
    order = Order.objects.get(pk=op.params["order_id"])

    def hold():
        run = Run(
            leased.operation,
            "a/1",
            with_test_steps(get_handler(op.kind)),
            claimed_at_lease=frozenset(),
        )
        run.local(INVOICE, lambda: issue_invoice(order, "pi_of_a"))
        if claim_sent:
            fence.send_queued_in_tx()
        started.set()
        assert release.wait(20)
        run.unit.commit()

    worker = _Thread(hold)
    worker.start()
    assert started.wait(20)
    with connection.cursor() as cursor:  # a/1's lease runs out while it still runs
        cursor.execute(
            "UPDATE payments_operation SET lease_expires_at = now() - interval '1 second' "
            "WHERE id = %s",
            [op.pk],
        )
    return worker


def test_a_lease_taken_over_from_a_worker_still_running__claims_its_local_steps_first(
    provider, queue
):
    """b/2 takes over the lease of a/1, which still runs with its invoice uncommitted:
    b/2's invoice step claims first, waits on a/1's claim and replays a/1's invoice."""
    from payments.engine import runtime
    from payments.shop.models import Invoice

    op = _pending_checkout("over-1")
    started, release = threading.Event(), threading.Event()
    first = _a_worker_holding_the_invoice(op, started, release)
    second = _second_behind_first(first, release, lambda: runtime.execute(op.pk, worker_id="b/2"))

    assert (first.error, second.error, second.result) == (None, None, "succeeded")
    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.SUCCEEDED, 0)
    assert list(Invoice.objects.values_list("provider_reference", flat=True)) == ["pi_of_a"]


def test_a_local_step_done_meanwhile_by_a_worker_still_running__runs_again_uncounted(
    provider, queue
):
    """The reconciler moved the operation on (retrying) after a/1's lease ran out, while
    a/1 still ran. b/2's lease saw no invoice claim, so b/2 runs the invoice first; its
    insert waits on a/1's invoice number and fails once a/1 commits. b/2 rolls back and
    defers without counting an attempt; its next run replays a/1's invoice."""
    from payments.engine import runtime
    from payments.shop.models import Invoice

    op = _pending_checkout("over-2")
    started, release = threading.Event(), threading.Event()
    first = _a_worker_holding_the_invoice(op, started, release)
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        fence.release_in_tx(
            locked, OperationState.RETRYING, actor="reconciler", reason="claims settled"
        )
    second = _second_behind_first(first, release, lambda: runtime.execute(op.pk, worker_id="b/2"))

    assert (first.error, second.error, second.result) == (None, None, "deferred")
    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.RETRYING, 0)
    assert runtime.execute(op.pk, worker_id="b/2") == "succeeded"
    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.SUCCEEDED, 0)
    assert list(Invoice.objects.values_list("provider_reference", flat=True)) == ["pi_of_a"]


def test_the_jobs_timeout_in_a_step_done_meanwhile__stays_a_timeout(queue):
    """A run-first step whose function is interrupted by the job's timeout raises the
    timeout, even when another run committed the step meanwhile (not StepDoneMeanwhile,
    which would hide that the job ran out of time)."""
    from rq.timeouts import JobTimeoutException

    from payments.engine.handlers import Run, get_handler

    leased = fence.acquire_lease(_pending_checkout("loc-3").pk, owner=WORKER, seconds=30)
    op, spec = leased.operation, with_test_steps(get_handler(leased.operation.kind))
    assert _local(Run(op, "a/1", spec, claimed_at_lease=frozenset()), "s", lambda: {}) == {}

    def time_is_up():
        raise JobTimeoutException("the job's time is up (test)")

    stale = Run(op, "b/2", spec, claimed_at_lease=frozenset())  # its lease saw no claim of s
    with pytest.raises(JobTimeoutException):
        stale.local("s", time_is_up)


# --- F3 (pre-existing, kept by the reordering): an unknown kind strips a live lease --------


def test_unknown_kind_on_a_worker__leaves_another_workers_live_lease_alone(queue):
    """Worker B (a deploy without the kind's handler) gets a redelivery while worker A
    holds a live lease. execute() now knows the lease was NOT acquired, yet _unrunnable
    (leased=False) parks the RUNNING operation in needs_review and clears A's lease."""
    from payments.engine import runtime
    from payments.exceptions import ConfigurationError

    op = _pending_checkout("unknown-1")
    assert fence.acquire_lease(op.pk, owner="worker-a/1", seconds=60).acquired

    def no_handler(kind):
        raise ConfigurationError(f"no handler for {kind!r}")

    with mock.patch.object(runtime, "get_handler", no_handler):
        outcome = runtime.execute(op.pk, worker_id="worker-b/2")

    op.refresh_from_db()
    assert (op.state, op.lease_owner) == (OperationState.RUNNING, "worker-a/1"), (
        outcome,
        op.state,
        op.lease_owner,
    )


# --- F4: Run.local runs the step's function again before it learns the step is done ------


def test_a_done_local_step__is_replayed_without_running_its_function_again(queue):
    """A redelivery (crash after the step committed, before _finish) replays a done local
    step. The parent inserted the claim first, so the duplicate stopped at the claim's
    unique violation and `fn` never ran again; 43c0260 runs `fn` first. Any fn whose
    second run raises (a check on the state its first run wrote), or that does
    something outside the transaction, now breaks or repeats on every redelivery."""
    from payments.engine.handlers import Run, get_handler

    op = fence.acquire_lease(_pending_checkout("replay-1").pk, owner=WORKER, seconds=30).operation
    spec = with_test_steps(get_handler(op.kind))
    assert _local(Run(op, WORKER, spec), "review_local", lambda: {"n": 1}) == {"n": 1}
    ran: list[str] = []

    def again():
        ran.append("again")
        raise RuntimeError("the order is no longer processing")  # what a state check says

    result = None
    error = None
    try:
        result = _local(Run(op, WORKER, spec), "review_local", again)
    except RuntimeError as exc:
        error = exc
    assert (ran, error, result) == ([], None, {"n": 1})


def test_a_lease_taken_over_while_the_old_run_still_queues_its_local_claim__invoice_once(
    provider, queue
):
    """a/1 ran its invoice step first; its claim waits for a/1's next fence statement
    (queued, not sent) when b/2 takes the lease over. b/2 claims the invoice first, then
    its invoice insert waits on a/1's invoice; a/1's commit sends its claim, which waits
    on b/2's: PostgreSQL ends the deadlock by failing b/2, a counted attempt retried
    later. The invoice exists once and the retry replays it. (Before claims were queued,
    the same stall between a/1's invoice and its claim statement deadlocked the same way;
    the window is now until a/1's next fence statement.)"""
    from payments.engine import runtime
    from payments.shop.models import Invoice

    op = _pending_checkout("over-3")
    started, release = threading.Event(), threading.Event()
    first = _a_worker_holding_the_invoice(op, started, release, claim_sent=False)
    second = _second_behind_first(first, release, lambda: runtime.execute(op.pk, worker_id="b/2"))

    # b/2 waited first, so its deadlock check runs first: it is the victim, a failed
    # attempt (transient, retried); a/1 commits its invoice with its claim.
    assert first.error is None and isinstance(second.error, RetryLater), second.error
    assert "deadlock detected" in str(second.error)
    assert Invoice.objects.count() == 1
    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.RETRYING, 1)
    assert runtime.execute(op.pk, worker_id="c/3") == "succeeded"  # RQ's retry: it replays
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED, (op.state, first.error, second.result)
    assert list(Invoice.objects.values_list("provider_reference", flat=True)) == ["pi_of_a"]
