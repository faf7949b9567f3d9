"""The fence's invariants under random sequences of workers, crashes, desk and recovery.

A Hypothesis state machine drives the real path (RQ jobs run by in-process
SimpleWorkers, the fake provider over HTTP, PostgreSQL, the reconciler, the
sweeper and the desk's services) through random interleavings of:

* jobs run by fresh workers (each a new owner id), or one job killed at a
  failpoint (a BaseException no `except Exception` catches: a SIGKILL) or hit
  by a database error there;
* provider faults queued for the next create requests; the provider down
  (connections refused) or back;
* time passing (every fence timestamp moved back by a lease, a minute or the
  reconcile grace) and scheduled jobs coming due;
* Redis losing every job; sweeper and reconciler rounds (the reconciler may die
  at a failpoint too);
* the desk: query the provider, resume, mark the charge failed or succeeded
  (with its real reference, another operation's or a bogus one), a new attempt;
  the customer's new key for a failed order; the provider's search lagging an
  hour behind (search decides nothing).

After every step (so after every sequence and every prefix of it) it checks:
at most one provider success and one live PaymentIntent per order, none for a
failed order; no failed
operation with an external step done or in doubt, no failed charge the
provider shows charged; every claim settled or released only by its owner of
the moment; every operation and claim move allowed by the transition table,
continuous, and ending in the row's state; no unexpected exception and no
refusal logged by the fence. Transactional: workers, desk and recovery must
see each other's commits. Each example starts from empty tables, Redis and
provider.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import hypothesis
import pytest
from django.apps import apps
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db import OperationalError, connection
from django.db.models import Q
from hypothesis import HealthCheck
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from rq import SimpleWorker
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.registry import ScheduledJobRegistry

from devtools.fake_provider.server import FakeProviderServer
from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.names import CHARGE, CHECKOUT
from payments.checkout.orders import create_order
from payments.conf import payments_settings
from payments.desk import services as desk
from payments.desk.rules import DeskError
from payments.engine import failpoints
from payments.engine.handlers import get_handler
from payments.engine.recovery import reconcile, sweep
from payments.engine.transitions import CLAIM_TRANSITIONS, OPERATION_TRANSITIONS, WITHDRAWN
from payments.exceptions import RetriesExhausted, RetryLater
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim
from payments.shop.models import Order, OrderStatus
from tests.support.users import NEW_ATTEMPT, RECONCILE, make_user

pytestmark = pytest.mark.django_db(transaction=True)

CARDS = ("pm_card_visa", "pm_card_visa", "pm_card_chargeDeclined")
FAULTS = ("drop_after_accept", "fail_before", "fail_after", "rate_limit", "slow")
POINTS = (
    failpoints.AFTER_CLAIM_COMMIT,
    failpoints.AFTER_PROVIDER_ACCEPT,
    failpoints.BEFORE_RECORD_COMMIT,
    failpoints.AFTER_RECORD_COMMIT,
    failpoints.BEFORE_GIVE_UP,
)
LEASE = 30  # CLAIM_LEASE, seconds
#: A lease runs out; a minute passes; the reconcile grace (RECONCILE_GRACE, 900 s) passes.
STEPS_OF_TIME = (LEASE + 1, 61, 1000)
ONE_OF_THE_ROWS = st.integers(min_value=0, max_value=7)  # an index, modulo the rows
_UNSETTLED_CHARGE = Q(
    claims__step=CHARGE, claims__state__in=[ClaimState.CLAIMED, ClaimState.UNCERTAIN]
)
#: The desk's actions, each aimed at the operations it may apply to (when there are any).
AIMS = {
    "query_provider": ~Q(state=OperationState.PENDING),
    "resume": ~Q(state__in=[OperationState.PENDING, OperationState.SUCCEEDED]),
    "mark_step_failed": _UNSETTLED_CHARGE,
    "mark_step_succeeded": _UNSETTLED_CHARGE,
    "start_new_attempt": Q(state=OperationState.FAILED),
}
INJECTION = st.none() | st.tuples(st.sampled_from(POINTS), st.sampled_from(("crash", "error")))


class Crash(BaseException):
    """The process dies here: no `except Exception` of the runtime or the reconciler runs."""


class InjectedDBError(OperationalError):
    """A database error (a deadlock victim, a statement timeout) at a failpoint."""


#: Exceptions a job may end with: RQ's retry signals and what this test injects.
EXPECTED_JOB_ERRORS = (RetryLater, RetriesExhausted, Crash, InjectedDBError)


def _tables() -> list[str]:
    fence = [
        apps.get_model("payments", name) for name in ("OperationEvent", "StepClaim", "Operation")
    ]
    shop = [
        apps.get_model("shop", name) for name in ("Invoice", "LedgerEntry", "SalesDay", "Order")
    ]
    models = [*fence, *shop, apps.get_model("inbox", "InboxEntry")]
    return [model._meta.db_table for model in models]


class QuietWorker(SimpleWorker):
    """An RQ SimpleWorker without its command channel (a pub/sub thread costs 0.1 s a worker)."""

    def subscribe(self) -> None:
        pass

    def unsubscribe(self) -> None:
        pass


class GuardLog(logging.Handler):
    """Collects the fence's refusals (illegal transitions, non-owner settles) as they happen."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _provider_at(url: str) -> None:
    """Point the app at `url`: a new PAYMENTS dict (payments_settings() reads each new one
    once; a dict changed in place would not be read again). The test's `settings`
    fixture has overridden the settings: this assignment is undone with it."""
    django_settings.PAYMENTS = {**django_settings.PAYMENTS, "PROVIDER_URL": url}
    assert payments_settings().provider_url == url  # what the provider client will use


class FenceMachine(RuleBasedStateMachine):
    """One example: 1-2 orders checked out, then a random sequence of what can happen."""

    # Set by the test before the first example: the fixtures outlive the examples.
    provider: FakeProviderServer
    queue: Queue
    staff: User  # the operator at the desk
    dead_url = ""  # where no provider listens
    guard: GuardLog

    def __init__(self) -> None:
        super().__init__()
        self.queue.connection.flushdb()
        self.provider.state.reset()
        _provider_at(self.provider.url)
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(_tables())} CASCADE")
        self.guard.messages.clear()
        self.orders: list[Order] = []
        self.keys = 0
        self.job_errors: list[str] = []
        self.reconcile_errors: list[str] = []
        # Preconditions read only the rules drawn so far (never the database or Redis,
        # which timing may change), so that Hypothesis can replay and shrink a sequence.
        self.last = ""  # the previous rule: no rule but the workers' runs twice in a row
        self.worked = False  # a worker ran: the desk and the customer have something to act on

    # --- helpers ----------------------------------------------------------------------

    @contextmanager
    def _injected(self, injection: tuple[str, str] | None) -> Iterator[None]:
        """Raise once at the failpoint named by `injection`, the first time it is reached."""
        if injection is None:
            yield
            return
        point, how = injection
        fired: list[bool] = []

        def hit() -> None:
            if not fired:
                fired.append(True)
                raise Crash(point) if how == "crash" else InjectedDBError(f"injected at {point}")

        with failpoints.hooked(point, hit):
            yield

    def _record_job_error(self, job: Job, exc_type, exc_value, tb) -> bool:
        if not issubclass(exc_type, EXPECTED_JOB_ERRORS):
            self.job_errors.append(f"job {job.description}: {exc_type.__name__}: {exc_value}")
        return True

    # --- the world ----------------------------------------------------------------------

    @initialize(cards=st.lists(st.sampled_from(CARDS), min_size=1, max_size=2))
    def checkouts(self, cards: list[str]) -> None:
        for card in cards:
            order = create_order(amount=1500, currency="eur", email="prop@example.com")
            self.keys += 1
            request_checkout(
                order_id=order.pk, key=f"chk-{self.keys}", payment_method=card, actor="api"
            )
            self.orders.append(order)

    def _work(self, jobs: int) -> None:
        """Fresh workers take `jobs` jobs, one each (each worker is a new owner id)."""
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for _ in range(jobs):
                QuietWorker(
                    [self.queue],
                    connection=self.queue.connection,
                    exception_handlers=[self._record_job_error],
                ).work(burst=True, max_jobs=1)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
            self._provider_settles()

    def _provider_settles(self) -> None:
        """Let a slow request finish at the provider: the next step meets its stored answer."""
        assert self.provider.state.wait_idle(timeout=5)

    @rule(jobs=st.integers(min_value=1, max_value=4))
    def workers_run(self, jobs: int) -> None:
        self.last, self.worked = "workers_run", True
        self._work(jobs)

    @precondition(lambda self: self.last != "worker_dies")
    @rule(point=st.sampled_from(POINTS), how=st.sampled_from(("crash", "error")))
    def worker_dies(self, point: str, how: str) -> None:
        """One job, killed (crash) or hit by a database error (error) at `point` if it gets there."""
        self.last, self.worked = "worker_dies", True
        with self._injected((point, how)):
            self._work(1)

    @precondition(lambda self: self.last != "provider_faults")
    @rule(mode=st.sampled_from(FAULTS), count=st.integers(min_value=1, max_value=3))
    def provider_faults(self, mode: str, count: int) -> None:
        self.last = "provider_faults"
        self.provider.state.enqueue_faults(mode, count if mode != "slow" else 1)

    @precondition(lambda self: self.last != "time_passes")
    @rule(seconds=st.sampled_from(STEPS_OF_TIME))
    def time_passes(self, seconds: int) -> None:
        """Move every fence timestamp back (the clock moves on); due scheduled jobs enqueue."""
        self.last = "time_passes"
        op, claim, event = (m._meta.db_table for m in (Operation, StepClaim, OperationEvent))
        shift = "{0} = {0} - %s * interval '1 second'"
        with connection.cursor() as cursor:  # raw SQL: the test plays the clock, not the fence
            cols: tuple[str, ...] = (
                "next_attempt_at",
                "lease_expires_at",
                "dispatched_at",
                "created_at",
            )
            cursor.execute(
                f"UPDATE {op} SET " + ", ".join(shift.format(c) for c in (*cols, "updated_at")),
                [seconds] * (len(cols) + 1),
            )
            cols = ("claimed_at", "last_request_at", "lease_expires_at", "settled_at", "updated_at")
            cursor.execute(
                f"UPDATE {claim} SET " + ", ".join(shift.format(c) for c in cols),
                [seconds] * len(cols),
            )
            cursor.execute(f"UPDATE {event} SET " + shift.format("created_at"), [seconds])
        self.provider.state.age(seconds)  # the provider's clock moves on with ours
        registry = ScheduledJobRegistry(queue=self.queue)
        for job_id in registry.get_job_ids():  # RQ's scheduler would enqueue them by now
            registry.remove(job_id)
            try:
                job = Job.fetch(job_id, connection=self.queue.connection)
            except NoSuchJobError:  # expired or deleted: nothing to enqueue
                continue
            self.queue.enqueue_job(job)

    @precondition(lambda self: self.last != "search_lags")
    @rule(lag=st.sampled_from((0, 3600)))
    def search_lags(self, lag: int) -> None:
        """The provider's search falls an hour behind (or catches up): it must decide nothing."""
        self.last = "search_lags"
        self.provider.state.configure(search_lag=lag)

    @precondition(lambda self: self.last != "provider_reachable")
    @rule(down=st.booleans())
    def provider_reachable(self, down: bool) -> None:
        """The provider goes down (connections refused) or comes back."""
        self.last = "provider_reachable"
        _provider_at(self.dead_url if down else self.provider.url)

    @precondition(lambda self: self.last != "recovery")
    @rule(
        what=st.sampled_from(("sweep", "reconcile", "redis_loses_every_job")), injection=INJECTION
    )
    def recovery(self, what: str, injection: tuple[str, str] | None) -> None:
        """A sweeper or reconciler round (the reconciler may die mid-round), or Redis lost."""
        self.last = "recovery"
        if what == "sweep":
            sweep()
        elif what == "redis_loses_every_job":
            self.queue.connection.flushdb()
        else:
            try:
                with self._injected(injection):
                    report = reconcile()
            except Crash:
                return  # the recovery process died mid-round
            finally:
                self._provider_settles()
            if injection is None and report.count("error"):
                self.reconcile_errors.append(f"reconcile: {report.outcomes}")

    @precondition(lambda self: self.worked and self.last != "at_the_desk")
    @rule(
        action=st.sampled_from(sorted(AIMS)),
        index=ONE_OF_THE_ROWS,
        reference=st.sampled_from(("own", "other", "bogus")),
        card=st.sampled_from(CARDS),
        injection=INJECTION,
    )
    def at_the_desk(
        self, action: str, index: int, reference: str, card: str, injection: tuple[str, str] | None
    ) -> None:
        """An operator at the desk; a refusal (DeskError, PermissionDenied) changes nothing."""
        self.last = "at_the_desk"
        checkouts = Operation.objects.filter(kind=CHECKOUT).order_by("pk")
        aimed = checkouts.filter(AIMS[action])  # where the action may apply, else anywhere
        ops = list(aimed) or list(checkouts)
        op = ops[index % len(ops)]
        user, why = self.staff, "property test"
        calls: dict[str, Callable[[], object]] = {
            "query_provider": lambda: desk.query_provider([op.pk], user=user),
            "resume": lambda: desk.resume(op.pk, user=user, reason=why),
            "mark_step_failed": lambda: desk.mark_step_failed(op.pk, CHARGE, user=user, reason=why),
            "mark_step_succeeded": lambda: desk.mark_step_succeeded(
                op.pk, CHARGE, reference=self._reference(op, reference), user=user, reason=why
            ),
            "start_new_attempt": lambda: desk.start_new_attempt(
                op.pk, user=user, reason=why, payment_method=card
            ),
        }
        try:
            with self._injected(injection):
                calls[action]()
        except (DeskError, PermissionDenied):
            pass
        except (Crash, InjectedDBError):
            assert injection is not None
        finally:
            self._provider_settles()

    def _reference(self, op: Operation, which: str) -> str:
        """A provider reference: this operation's real charge, another's, or none at all."""
        wins = [i for i in self.provider.state.intents() if i["status"] == "succeeded"]
        own = [i["id"] for i in wins if i["metadata"].get("operation_key") == op.key]
        other = [i["id"] for i in wins if i["metadata"].get("operation_key") != op.key]
        pool = {"own": own, "other": other, "bogus": []}[which]
        return pool[0] if pool else "pi_000000000000000000000000"

    @precondition(lambda self: self.worked and self.last != "customer_new_key")
    @rule(index=ONE_OF_THE_ROWS, card=st.sampled_from(CARDS))
    def customer_new_key(self, index: int, card: str) -> None:
        """The customer checks out again with a new key (refused unless the order is open)."""
        self.last = "customer_new_key"
        failed = list(Order.objects.filter(status=OrderStatus.PAYMENT_FAILED).order_by("pk"))
        orders = failed or self.orders  # a failed order may try again; others are refused
        order = orders[index % len(orders)]
        self.keys += 1
        try:
            request_checkout(
                order_id=order.pk, key=f"chk-{self.keys}", payment_method=card, actor="api"
            )
        except CheckoutNotAllowed:
            pass

    # --- the invariants -----------------------------------------------------------------

    @invariant()
    def the_fence_holds(self) -> None:
        """Every invariant, after every step (one line per step in a failing sequence)."""
        self.nothing_unexpected_was_raised_or_refused()
        self.at_most_one_provider_success_per_order()
        self.failed_means_nothing_charged()
        self.claims_settled_by_their_owner()
        self.operation_moves_follow_the_table()

    def nothing_unexpected_was_raised_or_refused(self) -> None:
        """No job or reconcile error but RQ's retry signals and ours; no fence refusal logged."""
        assert not self.job_errors, self.job_errors
        assert not self.reconcile_errors, self.reconcile_errors
        assert not self.guard.messages, self.guard.messages

    def at_most_one_provider_success_per_order(self) -> None:
        """One charge per order at most; a failed order was never charged, a paid one was; an
        order has one PaymentIntent, unless an operator's "mark failed" cancelled the one
        before."""
        for order in Order.objects.all():
            order_intents = self.provider.state.intents(metadata={"order_id": str(order.pk)})
            wins = [i["id"] for i in order_intents if i["status"] == "succeeded"]
            assert len(wins) <= 1, f"order {order.pk} charged {len(wins)} times: {wins}"
            live = [i["id"] for i in order_intents if i["status"] != "canceled"]
            assert len(live) <= 1, f"order {order.pk} has {len(live)} live intents: {live}"
            if order.status == OrderStatus.PAYMENT_FAILED:
                assert not wins, f"order {order.pk} is payment_failed but charged ({wins})"
            if order.status == OrderStatus.PAID:
                assert wins, f"order {order.pk} is paid without a provider success"

    def failed_means_nothing_charged(self) -> None:
        """A failed operation has no external step done or in doubt; no failed charge charged
        money that no done claim fences (an order's attempts share one intent: a later
        attempt's done claim may carry what an earlier, declined one made)."""
        won = [i for i in self.provider.state.intents() if i["status"] == "succeeded"]
        charges = StepClaim.objects.filter(step=CHARGE)
        fenced = set(
            charges.filter(state=ClaimState.DONE).values_list("provider_reference", flat=True)
        ) | {  # a later attempt's confirm, not settled yet (in doubt): it fences the intent
            str((request or {}).get("payment_intent"))
            for request in charges.exclude(state=ClaimState.FAILED).values_list(
                "request", flat=True
            )
        }
        for claim in StepClaim.objects.select_related("operation"):
            op = claim.operation
            if claim.step not in get_handler(op.kind).effects:
                continue  # local steps and side effects: no provider record to compare
            in_doubt = claim.state == ClaimState.UNCERTAIN or (
                claim.state == ClaimState.CLAIMED and claim.lease_expires_at is not None
            )
            if op.state == OperationState.FAILED:
                assert claim.state != ClaimState.DONE and not in_doubt, (
                    f"operation {op.key} failed with its {claim.step} {claim.state} "
                    f"(lease {claim.lease_expires_at}, by {claim.claimed_by})"
                )
            if claim.state == ClaimState.FAILED and claim.step == CHARGE:
                made = [
                    i["id"]
                    for i in won
                    if i["id"] == claim.provider_reference
                    or (
                        not claim.provider_reference
                        and i["metadata"].get("operation_key") == op.key
                    )
                ]
                unfenced = [pi for pi in made if pi not in fenced]
                assert not unfenced, f"{op.key}: charge failed, provider charged {unfenced}"
            if op.state == OperationState.SUCCEEDED:
                assert claim.state == ClaimState.DONE and claim.provider_reference, op.key

    def claims_settled_by_their_owner(self) -> None:
        """Replay each claim's audit: only its owner of the moment settles or releases it.

        An insert (no from-state) or a take-over names the owner; every other
        move (settle, release, a note) must be that owner's, be allowed by the
        claim table, start where the previous one ended and end in the row.
        """
        events: dict[tuple[int, str], list[OperationEvent]] = {}
        for event in OperationEvent.objects.exclude(step="").order_by("id"):
            events.setdefault((event.operation_id, event.step), []).append(event)
        for claim in StepClaim.objects.all():
            owner, state = None, None
            for ev in events.get((claim.operation_id, claim.step), []):
                where = f"claim {claim.operation_id}/{claim.step} event {ev.pk}"
                if not ev.from_state:
                    assert state is None, f"{where}: inserted twice"
                    owner, state = ev.actor, ev.to_state
                    continue
                if ev.to_state == WITHDRAWN:  # its owner deleted it unused: it may come again
                    assert ev.from_state == state == "claimed" and ev.actor == owner, where
                    owner, state = None, None
                    continue
                assert ev.from_state == state, f"{where}: from {ev.from_state}, was {state}"
                assert ev.to_state in CLAIM_TRANSITIONS[ev.from_state], (
                    f"{where}: illegal {ev.from_state} -> {ev.to_state}"
                )
                if ev.reason.startswith("taken over from"):
                    owner = ev.actor
                else:
                    assert ev.actor == owner, (
                        f"{where}: {ev.from_state} -> {ev.to_state} by {ev.actor}, "
                        f"but {owner} held it ({ev.reason})"
                    )
                state = ev.to_state
            assert (claim.state, claim.claimed_by) == (state, owner), (
                f"claim {claim.operation_id}/{claim.step} is {claim.state} by "
                f"{claim.claimed_by}; its audit says {state} by {owner}"
            )

    def operation_moves_follow_the_table(self) -> None:
        """Replay each operation's audit: allowed moves (or notes), continuous, ending in the row."""
        events: dict[int, list[OperationEvent]] = {}
        for event in OperationEvent.objects.filter(step="").order_by("id"):
            events.setdefault(event.operation_id, []).append(event)
        for op in Operation.objects.all():
            state = None
            for ev in events.get(op.pk, []):
                where = f"operation {op.key} event {ev.pk} ({ev.reason[:80]})"
                if not ev.from_state:
                    expected = OperationState.PENDING if state is None else state
                    assert ev.to_state == expected, f"{where}: note to {ev.to_state} in {state}"
                    state = ev.to_state
                    continue
                assert ev.from_state == state, f"{where}: from {ev.from_state}, was {state}"
                allowed = OPERATION_TRANSITIONS[ev.from_state] | {ev.from_state}
                assert ev.to_state in allowed, f"{where}: illegal {ev.from_state} -> {ev.to_state}"
                state = ev.to_state
            assert op.state == state, f"operation {op.key} is {op.state}; its audit says {state}"


def _dead_url() -> str:
    """A local URL that refuses connections (a port just freed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_random_sequences_keep_the_fence_invariants(provider, queue, settings):
    guard = GuardLog()
    watched = [
        logging.getLogger(n) for n in ("payments.engine.transitions", "payments.engine.fence")
    ]
    for logger in watched:
        logger.addHandler(guard)
    FenceMachine.provider, FenceMachine.queue, FenceMachine.guard = provider, queue, guard
    # A lease long enough that no real second runs it out: only `time_passes` does.
    settings.PAYMENTS = {**settings.PAYMENTS, "CLAIM_LEASE": LEASE}
    FenceMachine.dead_url = _dead_url()
    provider.state.configure(slow_delay=1.5)  # past the client's 1 s read timeout, always
    FenceMachine.staff = make_user("prop-operator", RECONCILE, NEW_ATTEMPT)
    try:
        run_state_machine_as_test(
            FenceMachine,
            settings=hypothesis.settings(
                max_examples=40,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,  # nothing written under the repository
            ),
        )
    finally:
        for logger in watched:
            logger.removeHandler(guard)
