"""The fence's edges: paths around the claim that charged twice or showed a charged order failed.

Each test names a hole found by an adversarial read and drives the real path
(worker, desk, reconciler, provider over HTTP). Transactional: the desk and
the recovery processes are other connections that must see committed claims.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from django.db import OperationalError, connection
from rq import SimpleWorker

from payments.checkout.charge import PaymentIntentCharge
from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE, CHECKOUT
from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.engine import failpoints, fence, handlers
from payments.engine.recovery import reconcile
from payments.models import ClaimState, Operation, OperationState
from payments.shop.models import Order, OrderStatus
from tests.conftest import run_worker
from tests.support.workers import ROOT, worker_env

pytestmark = pytest.mark.django_db(transaction=True)


def checkout(key: str, amount: int = 1500) -> tuple[Order, Operation]:
    order = create_order(amount=amount, currency="eur", email="edge@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key=key, payment_method="pm_card_visa", actor="test"
    )
    return order, op


def successes(provider, order: Order) -> int:
    """Provider-side successes for the order, whatever operation or key charged it."""
    return sum(
        1
        for intent in provider.state.intents(metadata={"order_id": str(order.pk)})
        if intent["status"] == "succeeded"
    )


@pytest.fixture
def operator(django_user_model):
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("night-shift", password="x", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["reconcile_operation", "start_new_attempt"])
    )
    return django_user_model.objects.get(pk=user.pk)


# --- 1. an operator's query racing a worker's last transient attempt ---------------------


def test_query_racing_the_last_transient_attempt__never_charges_a_failed_order(
    provider, queue, operator, monkeypatch
):
    """Hole 1: the worker released its claim after its 3rd refusal and is about to give up;
    the operator presses "Query the provider now". The query must not replay the charge beside
    the worker, and the worker must not fail a claim someone else holds."""
    order, op = checkout("race")
    provider.state.enqueue_faults("fail_before", 3)  # every attempt refused, nothing executed
    replayed, gave_up = threading.Event(), threading.Event()
    real_perform = PaymentIntentCharge.perform
    outcome: dict[str, object] = {}

    def perform_then_wait(self, request, idempotency_key):
        answer = real_perform(self, request, idempotency_key)
        replayed.set()
        gave_up.wait(timeout=10)  # the answer is "in flight" while the worker gives up
        return answer

    def operator_queries() -> None:
        try:
            outcome["report"] = desk.query_provider([op.pk], user=operator)
        except Exception as exc:  # recorded for the assertions below
            outcome["error"] = exc
        finally:
            connection.close()

    def at_give_up() -> None:
        monkeypatch.setattr(PaymentIntentCharge, "perform", perform_then_wait)
        desk_thread = threading.Thread(target=operator_queries)
        outcome["thread"] = desk_thread
        desk_thread.start()
        replayed.wait(timeout=3)  # on a fixed fence the query never replays

    with failpoints.hooked(failpoints.BEFORE_GIVE_UP, at_give_up):
        run_worker(queue)
    gave_up.set()
    outcome["thread"].join(timeout=20)

    op.refresh_from_db()
    order.refresh_from_db()
    charge = op.claims.get(step=CHARGE)
    # Never charged and shown failed; a failed claim is one the worker itself released.
    if order.status == OrderStatus.PAYMENT_FAILED:
        assert successes(provider, order) == 0
    assert not (charge.state == ClaimState.FAILED and successes(provider, order) > 0)
    assert not replayed.is_set(), "the desk's query executed a charge beside the worker"
    # A customer's second attempt charges the order at most once in all.
    if order.status == OrderStatus.PAYMENT_FAILED:
        request_checkout(order_id=order.pk, key="race-2", payment_method="pm_card_visa", actor="t")
        run_worker(queue)
    assert successes(provider, order) <= 1


def test_query_on_a_retrying_operation__only_reads(provider, queue, operator):
    """Hole 1: between two attempts the claim is released; a query must not execute it."""
    order, op = checkout("between-attempts")
    provider.state.enqueue_faults("fail_before", 1)
    SimpleWorker([queue], connection=queue.connection).work(burst=True, max_jobs=1)
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    creates = provider.state.stats()["create_requests"]

    report = desk.query_provider([op.pk], user=operator)

    assert provider.state.stats()["create_requests"] == creates  # no replay, no charge
    assert "read only" in report.rows[0].outcome
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert op.claims.get(step=CHARGE).state == ClaimState.CLAIMED
    run_worker(queue)  # the worker's own next attempt charges, once
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    assert successes(provider, order) == 1


def test_query_under_a_live_lease__is_refused_naming_the_holder(provider, queue, operator):
    order, op = checkout("held")
    leased = fence.acquire_lease(op.pk, owner="worker-7/99", seconds=60)
    assert leased.acquired

    report = desk.query_provider([op.pk], user=operator)

    assert "held by worker-7/99 until" in report.rows[0].outcome
    assert provider.state.stats()["create_requests"] == 0


# --- 2. an error between the provider's 200 and the done commit, on the last attempt ------


def test_error_between_the_200_and_the_record_on_the_last_attempt__is_uncertain_not_failed(
    provider, queue, settings
):
    """Hole 2: a deadlock victim (or statement timeout) right before the claim's done commit."""
    settings.PAYMENTS = {**settings.PAYMENTS, "MAX_ATTEMPTS": 1}
    order, op = checkout("lost-record")

    def deadlock() -> None:
        raise OperationalError("deadlock detected")

    with failpoints.hooked(failpoints.BEFORE_RECORD_COMMIT, deadlock):
        run_worker(queue)

    op.refresh_from_db()
    order.refresh_from_db()
    assert successes(provider, order) == 1
    assert op.state == OperationState.UNCERTAIN  # the money is taken: never "failed"
    assert order.status == OrderStatus.PROCESSING
    assert op.claims.get(step=CHARGE).state == ClaimState.UNCERTAIN

    report = reconcile()  # the same-key replay returns the stored 200
    run_worker(queue)

    assert report.count("done") == 1
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert successes(provider, order) == 1


# --- 3. derived keys in their own namespace --------------------------------------------


def test_a_255_character_client_key__completes(provider, queue):
    """Hole 3: a long client key made the follow-up keys overflow after the charge."""
    key = "k:" + "x" * 253
    order, op = checkout(key)
    run_worker(queue)
    op.refresh_from_db()
    order.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert order.status == OrderStatus.PAID
    assert Operation.objects.filter(parent=op, state=OperationState.SUCCEEDED).count() == 2


def test_client_keys_equal_to_derived_keys__never_collide(provider, queue):
    """Hole 3: a client key equal to another checkout's follow-up key stalled that checkout."""
    first_order, first = checkout("abc")
    squatter_order, _ = checkout("abc:record_sale")  # the old derived form, taken first
    run_worker(queue)
    first.refresh_from_db()
    first_order.refresh_from_db()
    assert first.state == OperationState.SUCCEEDED
    assert first_order.status == OrderStatus.PAID
    # And every key the system derived is free for clients too.
    for derived in Operation.objects.filter(parent=first):
        order, op = checkout(derived.key)
        run_worker(queue)
        op.refresh_from_db()
        assert op.state == OperationState.SUCCEEDED
    squatter_order.refresh_from_db()
    assert squatter_order.status == OrderStatus.PAID


# --- 4. step names and kinds recorded on unfinished operations ---------------------------


def test_renamed_step_with_operations_in_flight__is_reported_and_the_worker_refuses(
    provider, queue, monkeypatch
):
    """Hole 4: a renamed step derives a new idempotency key for a step that already ran."""
    from payments import checks
    from payments.engine.worker import FenceWorker

    order, op = checkout("in-flight")
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN  # charged, answer lost: in flight
    spec = handlers.get_handler(CHECKOUT)
    renamed = {"charge_v2": spec.effects[CHARGE]}
    monkeypatch.setitem(
        handlers._HANDLERS, CHECKOUT, handlers.HandlerSpec(**{**vars(spec), "effects": renamed})
    )

    messages = checks.check_recorded_names_are_registered(databases=["default"])

    assert [m.id for m in messages] == ["payments.E010"]
    assert "'charge'" in messages[0].msg
    with pytest.raises(SystemExit, match="E010"):
        FenceWorker([queue], connection=queue.connection).work(burst=True)


# --- 5. many recovery processes ---------------------------------------------------------


def test_a_second_recovery_process__never_takes_over_a_claim_the_first_holds(provider, queue):
    """Hole 5: two recovery processes shared the actor "reconciler" and took over each other."""
    order, op = checkout("two-reconcilers")
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    # This process is recovery process A, in the middle of settling the claim.
    mine = fence.process_actor("reconciler", __import__("os").getpid())
    held = fence.take_over_claim(op.claims.get(step=CHARGE), owner=mine, lease_seconds=60)
    assert held is not None
    creates = provider.state.stats()["create_requests"]

    # Recovery process B: a real `manage.py reconcile` in another process.
    proc = subprocess.run(
        [sys.executable, "manage.py", "reconcile", "--verbosity", "2"],
        cwd=ROOT,
        env=worker_env(provider.url),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert proc.returncode == 0, proc.stderr
    assert provider.state.stats()["create_requests"] == creates  # B never replayed
    claim = op.claims.get(step=CHARGE)
    assert claim.claimed_by == mine


# --- 6. escalation when lookups keep failing ---------------------------------------------


def test_uncertain_with_the_provider_unreachable__goes_to_review_after_the_grace(
    provider, queue, settings
):
    """Hole 6: a lookup that kept failing skipped the grace check: uncertain forever."""
    order, op = checkout("provider-down")
    provider.state.enqueue_faults("drop_after_accept", 1)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    provider.stop()  # every replay and lookup now fails to connect
    settings.PAYMENTS = {**settings.PAYMENTS, "RECONCILE_GRACE": 1}
    time.sleep(1.2)  # past the grace period, by the database's clock

    report = reconcile()

    op.refresh_from_db()
    assert report.count("needs_review") == 1
    assert op.state == OperationState.NEEDS_REVIEW
    assert "grace period" in op.last_error  # the desk shows why


def test_a_migration_not_applied__the_worker_waits_for_it__then_gives_up_naming_it(
    queue, caplog, monkeypatch
):
    """This release's fence calls payments_fence_refuse() (payments 0009): a worker started
    before `migrate` ran would fail every queued outcome, so it takes no job: it waits
    for the migration (saying so), and exits naming it once its patience runs out."""
    from django.db.migrations.recorder import MigrationRecorder

    from payments.engine import worker
    from payments.engine.worker import FenceWorker

    monkeypatch.setattr(worker, "MIGRATIONS_PATIENCE", 0.3)
    monkeypatch.setattr(worker, "MIGRATIONS_POLL", 0.1)
    applied = MigrationRecorder.Migration.objects.get(app="payments", name="0009_fence_refuse")
    applied.delete()  # recorded as not applied: what the worker reads, as `migrate` would
    try:
        with pytest.raises(SystemExit, match=r"payments\.0009_fence_refuse.*manage.py migrate"):
            FenceWorker([queue], connection=queue.connection).work(burst=True)
    finally:
        applied.save()
    assert "worker waiting for `migrate`: payments.0009_fence_refuse" in caplog.text
    assert "migration payments.0009_fence_refuse is not applied" in caplog.text


def test_a_migration_applied_while_the_worker_waits__it_starts(queue, monkeypatch):
    from django.db.migrations.recorder import MigrationRecorder

    from payments.engine import worker

    monkeypatch.setattr(worker, "MIGRATIONS_POLL", 0.05)
    applied = MigrationRecorder.Migration.objects.get(app="payments", name="0009_fence_refuse")
    applied.delete()
    looks = []
    real = worker.pending_migrations

    def pending_then_applied() -> list[str]:
        looks.append(real())
        if len(looks) == 2:
            applied.save()  # `migrate` finishes while the worker waits
        return looks[-1]

    monkeypatch.setattr(worker, "pending_migrations", pending_then_applied)
    try:
        assert worker.wait_for_migrations() == []
    finally:
        if not MigrationRecorder.Migration.objects.filter(pk=applied.pk).exists():
            applied.save()
    assert looks[0] == ["payments.0009_fence_refuse"] and looks[-1] == []
