"""The claim of a run's first step rides its lease: one round trip, one transaction.

A checkout's job carries the operation's hint (payments.engine.dispatch.operation_hint).
The worker builds the charge's request from it before the lease, and the lease's round
trip inserts the claim (queries.sql, insert_claim_with_lease), committed synchronously
with the lease, before the call. The statement inserts it only with the lease and where
the row holds the hint's values; otherwise, or where the request needs a query, the run
claims the step after the lease, as before. A run that never gets to the step releases
the claim with nothing sent. Counted at the connection (devtools.bench.dbcount) and read
back on a connection of its own (what is committed), as a worker's job runs it
(payments.engine.runtime.execute with the job RQ stored).
"""

from __future__ import annotations

import dataclasses
import json

import psycopg
import pytest
from django.db import connection
from rq.job import Job

from devtools.bench.dbcount import counting
from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE, CHECKOUT
from payments.checkout.orders import create_order
from payments.desk.views.queries import first_error_of
from payments.engine import fence, handlers, runtime
from payments.engine.dispatch import HINT_META_KEY
from payments.engine.failpoints import AFTER_CLAIM_COMMIT, hooked, point_at
from payments.exceptions import RetriesExhausted, RetryLater
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim
from payments.provider.effect import PaymentIntentEffect
from tests.support.flows import order_and_checkout

pytestmark = pytest.mark.django_db(transaction=True)

WORKER = "worker-a/1"


def job_of(op: Operation, queue) -> Job:
    op.refresh_from_db()
    return Job.fetch(op.job_id, connection=queue.connection)


def committed_claims(op: Operation) -> list[tuple[str, str, dict]]:
    """The operation's claims as another connection sees them: what is committed."""
    with psycopg.connect(**connection.get_connection_params()) as other:
        rows = other.execute(
            "SELECT step, state, request::text FROM payments_stepclaim WHERE operation_id = %s",
            [op.pk],
        ).fetchall()
    return [(step, state, json.loads(request)) for step, state, request in rows]


def run_counted(op: Operation, job: Job) -> tuple[str, list[int]]:
    """Run the operation's job on this connection; its outcome, and the round trips it
    took before each charge call (without the Parse a first statement pays once)."""
    at_call: list[int] = []
    with counting() as counter:

        def before_the_call() -> None:
            counted = counter.snapshot()
            at_call.append(counted.total - counted.prepares)

        with hooked(point_at(AFTER_CLAIM_COMMIT, CHARGE), before_the_call):
            outcome = runtime.execute(op.pk, worker_id=WORKER, job=job)
    return outcome, at_call


def watching_leases(into: list[bool]):
    def watch(execute, sql, params, many, context):
        if sql is fence.ACQUIRE_LEASE:
            into.append(params["async_commit"])
        return execute(sql, params, many, context)

    return connection.execute_wrapper(watch)


def test_a_checkout__its_charge_claim_is_committed_with_the_lease__one_round_trip_before_the_call(
    provider, queue
):
    _, op = order_and_checkout(key="ride-1")
    job = job_of(op, queue)
    at_call: list = []

    with counting() as counter:

        def before_the_call() -> None:
            counted = counter.snapshot()
            at_call.append((counted.total - counted.prepares, committed_claims(op)))

        with hooked(point_at(AFTER_CLAIM_COMMIT, CHARGE), before_the_call):
            outcome = runtime.execute(op.pk, worker_id=WORKER, job=job)

    assert outcome == runtime.RunResult.SUCCEEDED
    ((trips, claims),) = at_call
    assert trips == 1
    assert [(step, state) for step, state, _ in claims] == [(CHARGE, ClaimState.CLAIMED)]
    assert claims[0][2]["amount"] == 1999
    events = list(
        OperationEvent.objects.filter(operation=op).order_by("id").values_list("step", "to_state")
    )
    assert events[:3] == [
        ("", OperationState.PENDING),  # created
        ("", OperationState.RUNNING),
        (CHARGE, ClaimState.CLAIMED),
    ]
    assert provider.state.succeeded_count(metadata={"operation_key": "ride-1"}) == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("params", {"amount": 1}),  # another amount: another request
        ("params", {"amount": 1999.0}),  # the same request, but not the row's params
        ("key", "ride-forged-other"),  # another idempotency key
        ("tenant", "another-tenant"),
        ("scope", "derived"),  # another idempotency key
        ("entity_id", "999999"),
    ],
)
def test_a_hint_the_row_disagrees_with__no_claim_from_it__the_rows_request_is_sent(
    provider, queue, field, value
):
    """A stale or forged hint builds a request or key the row does not hold: the lease's
    statement inserts no claim from it (its commit still waits for the flush), and the
    run claims the charge after the lease, with the row's request and key."""
    _, op = order_and_checkout(key="ride-forged")
    job = job_of(op, queue)
    hint = job.meta[HINT_META_KEY]
    hint[field] = {**hint[field], **value} if isinstance(value, dict) else value
    job.save_meta()
    leases: list[bool] = []

    with watching_leases(leases):
        outcome, trips = run_counted(op, Job.fetch(job.id, queue.connection))

    assert outcome == runtime.RunResult.SUCCEEDED
    assert leases == [False] and trips == [2]  # the lease, then the claim
    claim = StepClaim.objects.get(operation=op, step=CHARGE)
    assert claim.request["amount"] == 1999
    assert claim.idempotency_key == fence.derive_idempotency_key(op.key, CHARGE, op.scope, "")
    intents = provider.state.intents(metadata={"operation_key": "ride-forged"})
    assert [i["amount"] for i in intents] == [1999]


def test_another_workers_live_lease__the_claim_is_not_inserted(provider, queue):
    _, op = order_and_checkout(key="ride-busy")
    job = job_of(op, queue)
    assert fence.acquire_lease(op.pk, owner="worker-b/2", seconds=30).acquired
    before = OperationEvent.objects.filter(operation=op).count()

    outcome = runtime.execute(op.pk, worker_id=WORKER, job=job)

    assert outcome == runtime.RunResult.DEFERRED
    assert committed_claims(op) == []
    assert OperationEvent.objects.filter(operation=op).count() == before
    assert provider.state.intents(metadata={"operation_key": "ride-busy"}) == []


def declined_then_again(queue, key: str) -> tuple[Operation, Operation]:
    """An order's first attempt, declined and failed, and its next attempt (a new key),
    not run yet: the order's intent is the first attempt's."""
    order = create_order(amount=1500, currency="eur", email=f"{key}@example.com")
    first, _ = request_checkout(
        order_id=order.pk, key=key, payment_method="pm_card_chargeDeclined", actor="t"
    )
    assert runtime.execute(first.pk, worker_id=WORKER, job=job_of(first, queue)) == "failed"
    again, _ = request_checkout(
        order_id=order.pk, key=f"{key}-again", payment_method="pm_card_visa", actor="t"
    )
    return first, again


def test_a_later_attempt__its_request_needs_a_query__claimed_after_the_lease(provider, queue):
    """A new attempt of an order confirms the order's intent, found by a query: its
    request is not built before the lease. The lease goes alone (asynchronously), the
    claim after it, and the charge confirms the first attempt's intent."""
    first, again = declined_then_again(queue, "ride-declined")
    leases: list[bool] = []

    with watching_leases(leases):
        outcome = runtime.execute(again.pk, worker_id=WORKER, job=job_of(again, queue))

    assert outcome == runtime.RunResult.SUCCEEDED and leases == [True]
    first_intent = StepClaim.objects.get(operation=first, step=CHARGE).provider_reference
    claim = StepClaim.objects.get(operation=again, step=CHARGE)
    assert claim.request["payment_intent"] == first_intent == claim.provider_reference


def failing_before_the_charge(monkeypatch) -> None:
    """The checkout's handler raises before it charges (a bug, a deploy in between)."""

    def fails_first(run) -> None:
        raise RuntimeError("failed before the charge")

    spec = handlers.get_handler(CHECKOUT)
    monkeypatch.setitem(handlers._HANDLERS, CHECKOUT, dataclasses.replace(spec, func=fails_first))


def test_a_run_that_does_not_get_to_the_step__withdraws_the_claim__a_later_run_charges_once(
    provider, queue, monkeypatch
):
    """The claim made with the lease is withdrawn, audited, with nothing sent: the failure
    is a counted retry, not a charge in doubt; the next run claims and charges once."""
    _, op = order_and_checkout(key="ride-unused")
    spec = handlers.get_handler(CHECKOUT)
    failing_before_the_charge(monkeypatch)
    with pytest.raises(RetryLater):
        runtime.execute(op.pk, worker_id=WORKER, job=job_of(op, queue))

    assert committed_claims(op) == []
    events = OperationEvent.objects.filter(operation=op, step=CHARGE).order_by("id")
    assert [(e.from_state, e.to_state) for e in events] == [
        ("", "claimed"),
        ("claimed", "withdrawn"),
    ]
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert provider.state.intents(metadata={"operation_key": "ride-unused"}) == []

    monkeypatch.setitem(handlers._HANDLERS, CHECKOUT, spec)
    assert runtime.execute(op.pk, worker_id=WORKER, job=job_of(op, queue)) == "succeeded"
    assert provider.state.succeeded_count(metadata={"operation_key": "ride-unused"}) == 1
    assert StepClaim.objects.get(operation=op, step=CHARGE).state == ClaimState.DONE
    assert first_error_of(op, CHARGE).text == ""  # the desk reads past the withdrawn row


def test_giving_up_before_the_step__fails_with_no_claim__a_new_attempt_may_charge(
    provider, queue, monkeypatch, settings
):
    """The last attempt fails before the charge: the operation fails (nothing was charged,
    nothing is in doubt), and the order takes a new attempt, which charges once."""
    settings.PAYMENTS = {**settings.PAYMENTS, "MAX_ATTEMPTS": 1}
    order, op = order_and_checkout(key="ride-gave-up")
    failing_before_the_charge(monkeypatch)
    with pytest.raises(RetriesExhausted):
        runtime.execute(op.pk, worker_id=WORKER, job=job_of(op, queue))
    monkeypatch.undo()

    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert committed_claims(op) == []
    again, created = request_checkout(
        order_id=order.pk, key="ride-gave-up-2", payment_method="pm_card_visa", actor="t"
    )
    assert created
    assert runtime.execute(again.pk, worker_id=WORKER, job=job_of(again, queue)) == "succeeded"
    assert provider.state.succeeded_count(metadata={"order_id": str(order.pk)}) == 1


def test_a_handler_without_opens_with__its_jobs_carry_no_hint(queue):
    """The hint copies the operation's params into Redis: only for a handler that needs
    them there. A refund's job (no opens_with) has none."""
    from payments.engine.dispatch import operation_hint

    _, op = order_and_checkout(key="ride-hint")
    op.refresh_from_db()
    assert HINT_META_KEY in job_of(op, queue).meta
    assert handlers.get_handler("refund").opens_with is None
    refund = Operation(pk=op.pk, key="r", kind="refund", entity_type="order", entity_id="1",
                       params={}, scope=op.scope, tenant="")  # fmt: skip
    assert operation_hint(refund) == {}


@pytest.mark.parametrize(
    "declared",
    [
        {"opens_with": "work"},  # a local step
        {"opens_with": "call", "order": ("work", "call")},  # not the first
        {"opens_with": "call", "on_give_up": lambda run: None},
    ],
)
def test_opens_with__names_the_first_external_step_of_a_handler_without_on_give_up(declared):
    from payments.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="opens_with"):
        handlers.handler(
            "opens-with-check",
            effects={"call": lambda run, step: None},
            steps={"work"},
            **declared,
        )


def test_a_handler_that_returns_without_its_step__withdraws_it_with_the_release(
    provider, queue, monkeypatch, caplog
):
    """A handler that does not keep its declaration: the claim goes in the release's
    transaction, the operation succeeds, and the log says what is wrong."""
    _, op = order_and_checkout(key="ride-returns")
    spec = handlers.get_handler(CHECKOUT)
    monkeypatch.setitem(
        handlers._HANDLERS, CHECKOUT, dataclasses.replace(spec, func=lambda run: None)
    )

    assert runtime.execute(op.pk, worker_id=WORKER, job=job_of(op, queue)) == "succeeded"

    assert committed_claims(op) == []
    assert "declares opens_with='charge' but returned without it" in caplog.text
    assert provider.state.intents(metadata={"operation_key": "ride-returns"}) == []


def test_a_request_that_asks_for_a_query__even_caught__is_built_after_the_lease(
    provider, queue, monkeypatch
):
    """The effect swallows the refused query and builds a request all the same: the
    wrapper saw the query, so that request is not claimed; the one built after the
    lease is."""
    built = PaymentIntentEffect.build_request

    def with_a_caught_query(self):
        try:
            StepClaim.objects.filter(operation_id=self.operation.pk).exists()
        except Exception:  # a fallback an effect might have
            return {**built(self), "amount": 1}
        return built(self)

    monkeypatch.setattr(PaymentIntentEffect, "build_request", with_a_caught_query)
    _, op = order_and_checkout(key="ride-caught")

    outcome, trips = run_counted(op, job_of(op, queue))

    assert outcome == runtime.RunResult.SUCCEEDED and trips == [3]  # lease, the query, claim
    assert StepClaim.objects.get(operation=op, step=CHARGE).request["amount"] == 1999


def test_a_request_that_reads_a_field_the_hint_does_not_hold__is_built_after_the_lease(
    provider, queue, monkeypatch
):
    """The operation built before the lease holds the hint's fields only: reading its
    `created_at` asks a query, so the request is built after the lease, from the row."""
    built = PaymentIntentEffect.build_request

    def dated(self):
        return {**built(self), "metadata": {"created": str(self.operation.created_at.year)}}

    monkeypatch.setattr(PaymentIntentEffect, "build_request", dated)
    _, op = order_and_checkout(key="ride-dated")

    outcome, trips = run_counted(op, job_of(op, queue))

    assert outcome == runtime.RunResult.SUCCEEDED and trips == [2]
    request = StepClaim.objects.get(operation=op, step=CHARGE).request
    assert request["metadata"]["created"] == str(op.created_at.year)


def test_a_request_json_cannot_hold__fails_after_the_lease__as_a_counted_attempt(
    provider, queue, monkeypatch
):
    from decimal import Decimal

    built = PaymentIntentEffect.build_request
    monkeypatch.setattr(
        PaymentIntentEffect, "build_request", lambda self: {**built(self), "x": Decimal(1)}
    )
    _, op = order_and_checkout(key="ride-json")

    with pytest.raises(RetryLater):
        runtime.execute(op.pk, worker_id=WORKER, job=job_of(op, queue))

    op.refresh_from_db()
    assert (op.state, op.attempts) == (OperationState.RETRYING, 1)
    assert committed_claims(op) == []


def test_a_later_attempts_hint_without_its_retry_of__no_claim_from_it__the_intent_is_confirmed(
    provider, queue
):
    """One PaymentIntent per order: a hint that lost the attempt's `retry_of` would build
    a request creating a second intent; the row disagrees, so the claim is made after the
    lease and confirms the first attempt's intent."""
    first, again = declined_then_again(queue, "ride-d")
    job = job_of(again, queue)
    job.meta[HINT_META_KEY]["retry_of_id"] = None
    job.save_meta()

    outcome, trips = run_counted(again, Job.fetch(job.id, queue.connection))

    assert outcome == runtime.RunResult.SUCCEEDED and trips == [3]  # lease, the intent, claim
    first_intent = StepClaim.objects.get(operation=first, step=CHARGE).provider_reference
    claim = StepClaim.objects.get(operation=again, step=CHARGE)
    assert claim.request["payment_intent"] == first_intent == claim.provider_reference
