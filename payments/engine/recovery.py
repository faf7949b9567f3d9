"""Recovery: the sweeper (nothing is lost) and the reconciler (nothing stays unknown).

The sweeper re-enqueues operations that are due but have no live job: Redis
may lose every job, the operation rows are the record. The reconciler asks the
provider what happened to uncertain claims, by reference, else by a replay with
the same key, else by a consistent list (never the provider's search, which
lags). It never calls with a new key.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import ScheduledJobRegistry, StartedJobRegistry

from payments.conf import payments_settings
from payments.engine import exchanges, fence
from payments.engine.dispatch import dispatch, dispatch_on_commit
from payments.engine.effects import EffectResult, StillInProgress, reversal_step
from payments.engine.handlers import GIVE_UP_STEP, HandlerSpec, get_handler
from payments.engine.outcomes import Outcome
from payments.engine.queues import payments_queue
from payments.engine.steps import past_grace, reconcile_step, view_of
from payments.exceptions import (
    ConfigurationError,
    StepConflict,
    StepNeedsReview,
    StepRefused,
    StepTransient,
    StepUncertain,
)
from payments.models import (
    FINAL_OPERATION_STATES,
    UNSETTLED_CLAIM_STATES,
    ClaimState,
    LookShowed,
    Operation,
    OperationState,
    StepClaim,
)

logger = logging.getLogger("payments.engine.recovery")
alerts = logging.getLogger("payments.alerts")

#: A freshly dispatched operation is left alone this long before it counts as lost.
DISPATCH_GRACE = timedelta(seconds=10)
#: A scheduled job this late means no scheduler picked it up (none runs, or the one
#: holding RQ's scheduler lock died and the lock has not expired): deliver it anew.
SCHEDULED_GRACE = timedelta(seconds=15)


@dataclass
class SweepReport:
    examined: int = 0
    dispatched: list[str] = field(default_factory=list)
    live: int = 0


def job_is_live(op: Operation, now: datetime) -> bool:
    """Tell whether the operation's last job will still run (or is running)."""
    if not op.job_id:
        return False
    queue = payments_queue()
    try:
        job = Job.fetch(op.job_id, connection=queue.connection)
    except NoSuchJobError:
        return False
    status = job.get_status(refresh=False)
    if status == JobStatus.QUEUED:
        # Still waiting in the queue. A worker moves a job to RQ's intermediate queue as
        # it takes it; SIGKILLed before the started registry knew, the job stays there,
        # `queued`, until RQ's maintenance (every 10 min): not live.
        return queue.get_job_position(job.id) is not None
    if status == JobStatus.DEFERRED:
        return True
    if status == JobStatus.SCHEDULED:
        # RQ's own retry of an abandoned or failed job is scheduled too; only
        # the registry knows when it is due.
        try:
            due = ScheduledJobRegistry(queue=queue).get_scheduled_time(job)
        except NoSuchJobError:
            return False
        if due.tzinfo is None:
            due = due.replace(tzinfo=UTC)
        return now < due + SCHEDULED_GRACE
    if status == JobStatus.STARTED:
        if op.state == OperationState.RUNNING:
            # The lease outlives the job timeout: once it ran out, no horse runs the job.
            return fence.lease_alive(op, now)
        started = job.started_at
        if started is not None and started.tzinfo is None:  # rq stores naive UTC
            started = started.replace(tzinfo=UTC)
        limit = timedelta(seconds=payments_settings().claim_lease)
        return started is not None and now - started < limit
    return False


def due_operations(now: datetime) -> Q:
    """Operations a worker should be running now."""
    return (
        Q(state=OperationState.PENDING)
        & (Q(dispatched_at__isnull=True) | Q(dispatched_at__lt=now - DISPATCH_GRACE))
        | Q(state=OperationState.RETRYING)
        & (Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
        | Q(state=OperationState.RUNNING, lease_expires_at__lt=now)
    )


def sweep(*, dry_run: bool = False, batch_size: int = 500) -> SweepReport:
    """Re-enqueue due operations that have no live job."""
    queue = payments_queue()
    try:  # moves jobs of dead workers out of the started registry (RQ's own cleanup)
        StartedJobRegistry(queue=queue).cleanup()
    except Exception:  # Redis down: the sweep below fails loudly on its own
        logger.warning("started-registry cleanup failed", exc_info=True)
    now = fence.db_now()
    report = SweepReport()
    for op in Operation.objects.filter(due_operations(now)).order_by("id")[:batch_size]:
        report.examined += 1
        if job_is_live(op, now):
            report.live += 1
            continue
        report.dispatched.append(op.key)
        if not dry_run:
            # A worker had taken it (and may have charged) when it died: it goes back to the
            # front, ahead of new work; a pending or retrying one to the back.
            dispatch(op.pk, first=op.state == OperationState.RUNNING)
            logger.info("operation %s had no live job; dispatched again", op.key)
    return report


@dataclass
class ReconcileReport:
    examined: int = 0
    outcomes: dict[str, list[str]] = field(default_factory=dict)

    def add(self, outcome: str, key: str) -> None:
        self.outcomes.setdefault(outcome, []).append(key)

    def count(self, outcome: str) -> int:
        return len(self.outcomes.get(outcome, []))


def claims_to_reconcile(operation_ids: list[int] | None = None, now: datetime | None = None) -> Q:
    """Unsettled claims of operations no worker will run, whose next look is due.

    Uncertain and failed operations; and those under review for want of an
    answer (their looks are not on hold): when the provider answers again, the
    same consistent reads settle them without a person. Each claim's next look
    waits longer while its looks learn nothing (fence.look_wait), so that an
    incident's many claims are each read in turn, not the first few every round.
    Named operations (the desk's query) are read now, whatever their next look.
    """
    # Through the partial index over unsettled claims (migration 0014).
    unsettled = Q(state__in=UNSETTLED_CLAIM_STATES)
    if operation_ids is not None:
        return unsettled & Q(operation_id__in=operation_ids)
    parked = (
        Q(operation__state=OperationState.NEEDS_REVIEW) & Q(look__isnull=False) & Q(look__hold="")
    )
    due = Q(look__isnull=True) | Q(look__next_look_at__isnull=True)
    if now is not None:
        due |= Q(look__next_look_at__lte=now)
    return (
        unsettled
        & (Q(operation__state__in=[OperationState.UNCERTAIN, OperationState.FAILED]) | parked)
        & due
    )


def reconcile(
    *,
    actor: str | None = None,
    dry_run: bool = False,
    operation_ids: list[int] | None = None,
    batch_size: int = 200,
    time_budget: float | None = None,
) -> ReconcileReport:
    """Settle unsettled external claims by asking the provider; move their operations on.

    `time_budget` (seconds) stops starting new claims once spent, so that a
    slow provider cannot hold up the sweep that runs in the same loop.
    """
    # Each recovery process owns claims under its own id: run as many as you like,
    # a claim taken over by one is live (leased) for every other.
    actor = actor or fence.process_actor("reconciler", os.getpid())
    report = ReconcileReport()
    started = time.monotonic()
    claims = (
        StepClaim.objects.filter(claims_to_reconcile(operation_ids, fence.db_now()))
        .select_related("operation")
        .order_by("claimed_at", "id")[:batch_size]
    )
    for claim in claims:
        if time_budget is not None and time.monotonic() - started > time_budget:
            report.add("left_for_next_round", claim.operation.key)
            continue
        op = claim.operation
        try:
            spec = get_handler(op.kind)
        except ConfigurationError:  # one unknown kind must not stop every other claim
            logger.error("operation %s: no handler for kind %s", op.key, op.kind)
            report.add("no_handler", op.key)
            continue
        if claim.step not in spec.effects:
            continue  # a side effect without lookup: its policy decides when the op resumes
        report.examined += 1
        if dry_run:
            report.add("would_check", op.key)
            continue
        try:
            outcome = settle_one(claim, actor=actor)
        except Exception:  # one bad claim must not stop the others from settling
            logger.exception("reconciling %s/%s failed", op.key, claim.step)
            outcome = "error"
        report.add(outcome, op.key)
    if not dry_run and operation_ids is None:
        _resume_stranded(actor, report)
    return report


#: Stranded operations resumed per round.
STRANDED_BATCH = 200


def stranded_operations() -> Q:
    """Operations the provider answered for that stayed put (a crash between two commits).

    An uncertain operation with no unsettled claim, or a failed one with a
    charge done, was left between its claim's settlement and its own move.
    Each arm names its state, so that the query reads through the partial
    indexes over unfinished and failed operations (migration 0014), never
    through the finished history; the claims are probed by their unique
    (operation, step) index. For a check of named operations: the stranded
    pass sends each arm as a statement of its own (`_resume_stranded`).
    """
    settled_but_uncertain, charged_but_failed = _stranded_arms()
    return settled_but_uncertain | charged_but_failed


def _stranded_arms() -> tuple[Q, Q]:
    """The uncertain and the failed arm of `stranded_operations`."""
    unsettled = StepClaim.objects.filter(operation=OuterRef("pk"), state__in=UNSETTLED_CLAIM_STATES)
    charged = StepClaim.objects.filter(
        operation=OuterRef("pk"), state=ClaimState.DONE, provider_reference__gt=""
    )
    # A failed operation that compensated (its `on_give_up` completed, e.g. a released
    # hold) stays failed: what its done steps did was undone on purpose.
    compensated = StepClaim.objects.filter(operation=OuterRef("pk"), step=GIVE_UP_STEP)
    settled_but_uncertain = Q(~Exists(unsettled), state=OperationState.UNCERTAIN)
    charged_but_failed = Q(Exists(charged), ~Exists(compensated), state=OperationState.FAILED)
    return settled_but_uncertain, charged_but_failed


def _resume_stranded(actor: str, report: ReconcileReport) -> None:
    """Resume stranded operations: the runtime replays what is settled and decides."""
    # One statement per arm, never their OR: inside an OR each EXISTS is a subplan, which
    # PostgreSQL runs hashed once failed operations are many (a year of declined cards),
    # reading every done claim with a reference, the claims' history, to test them (#39:
    # 4 ms at 10,000 operations, 117 ms at 300,000). Alone, the failed arm is a join that
    # probes each failed operation's claims by the unique (operation, step) index; ordered
    # by the key of the index over failed operations, so that the planner walks that
    # index. Unordered, or by id, it may walk the primary key (the whole history) to find
    # the few there are.
    settled_but_uncertain, charged_but_failed = _stranded_arms()
    stranded = list(Operation.objects.filter(settled_but_uncertain)[:STRANDED_BATCH])
    if len(stranded) < STRANDED_BATCH:
        failed = Operation.objects.filter(charged_but_failed).order_by("updated_at")
        stranded += failed[: STRANDED_BATCH - len(stranded)]
    for op in stranded:
        try:
            spec = get_handler(op.kind)
            _move(
                op,
                OperationState.RETRYING,
                actor,
                "claims settled; resuming",
                on_resume=spec.on_resume,
                resume=True,
            )
        except Exception:
            logger.exception("resuming stranded operation %s failed", op.key)
            report.add("error", op.key)
        else:
            report.add("resumed", op.key)


#: How `look_up` words a step its system did not answer about ("charge: lookup failed (…)").
LOOKUP_FAILED = "lookup failed"


@exchanges.recorded
def look_up(op: Operation, *, actor: str = "") -> str:
    """Read what the provider shows for the operation's external steps; change nothing.

    For operations a worker may still run: no replay (it could execute a call
    beside the worker's), no claim taken or settled. Returns a short summary.
    Each step's provider view keeps its lookup's requests and who asked (`actor`);
    the caller's audit row, in its `recording()` block, may take them all.
    """
    spec = get_handler(op.kind)
    found = []
    for claim in StepClaim.objects.filter(operation=op, step__in=list(spec.effects)):
        before = len(exchanges.peek() or [])
        try:
            result = spec.effect(claim.step, op).find(view_of(claim))
        except StillInProgress as exc:  # there, pending: what it showed, never "failed"
            pending = exc.shown()
            if pending is not None:
                mine = (exchanges.peek() or [])[before:]
                fence.note_provider_view(claim, pending, source="query", actor=actor, requests=mine)
            fence.note_look(
                claim, LookShowed.IN_PROGRESS, actor=actor, source="query", detail=str(exc)
            )
            found.append(f"{claim.step}: still in progress {exc.reference}".strip())
            continue
        except Exception as exc:  # provider down: say so, change nothing but the look's count
            found.append(f"{claim.step}: {LOOKUP_FAILED} ({type(exc).__name__})")
            fence.note_look(
                claim,
                LookShowed.UNREADABLE,
                actor=actor,
                source="query",
                detail=f"{type(exc).__name__}: {exc}",
            )
            continue
        mine = (exchanges.peek() or [])[before:]
        fence.note_provider_view(claim, result, source="query", actor=actor, requests=mine)
        if result is None:
            found.append(f"{claim.step}: not found yet")
        else:
            found.append(f"{claim.step}: {result.outcome} {result.reference}".strip())
    shown = "; ".join(found) or "no external step claimed yet"
    return f"read only, a worker may still run it: {shown}"


def settle_one(claim: StepClaim, *, actor: str) -> str:
    """Reconcile one claim and move its operation; return the outcome's name.

    The outcome names what the look did: "done", "failed" (settled), "needs_review"
    (parked now, or still: a look at a parked claim that learned nothing keeps it
    there, without another audit row), "still_uncertain" (the provider answered,
    the outcome is not known yet), "retry_later" (the provider could not be read),
    "busy" (someone else holds the claim), "already_settled".
    """
    op = claim.operation
    taken = fence.take_over_claim(claim, owner=actor, lease_seconds=payments_settings().claim_lease)
    if taken is None:
        return "busy"
    if taken.state in (ClaimState.DONE, ClaimState.FAILED):
        return "already_settled"  # someone settled it meanwhile; the stranded pass moves the op
    try:
        return _look_and_move(taken, op, actor)
    finally:
        # A look that settled nothing leaves the claim free at once, for a worker, the
        # desk or the next round: no audit row, nothing changed.
        fence.release_after_look(taken, actor=actor)


def _look_and_move(taken: StepClaim, op: Operation, actor: str) -> str:
    spec = get_handler(op.kind)
    # Read now, not when the batch was listed: an operator may have failed it since.
    state = Operation.objects.values_list("state", flat=True).get(pk=op.pk)
    allow_replay = state not in FINAL_OPERATION_STATES
    parked = state == OperationState.NEEDS_REVIEW
    try:
        reconcile_step(
            taken,
            spec.effect(taken.step, op),
            actor=actor,
            allow_replay=allow_replay,
            looking=True,
        )
    except StepRefused as exc:
        _move(
            op,
            OperationState.FAILED,
            actor,
            f"provider: refused ({exc.provider_code})",
            on_failure=spec.on_failure,
        )
        return "failed"
    except StepNeedsReview as exc:
        if not parked:
            _move(op, OperationState.NEEDS_REVIEW, actor, str(exc))
            alerts.error("operation %s needs review: outcome of %s unknown", op.key, taken.step)
        return "needs_review"
    except StepConflict:  # its looks are held already (steps.call_effect, before it raised)
        _move(op, OperationState.NEEDS_REVIEW, actor, "idempotency conflict")
        alerts.error("operation %s: idempotency conflict at %s", op.key, taken.step)
        return "needs_review"
    except StepUncertain:
        if state not in (OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW):
            if state not in FINAL_OPERATION_STATES:
                _move(op, OperationState.UNCERTAIN, actor, "outcome not known yet")
        return "needs_review" if parked else "still_uncertain"
    except StepTransient as exc:
        # Provider unreachable: the look is counted on the claim (no audit row) and the
        # next round (or a worker) may take the claim at once; past the grace period a
        # person may decide, and the reconciler keeps looking until the provider answers.
        if parked:
            return "needs_review"
        if past_grace(taken):
            reason = f"outcome unknown past the grace period; last try: {exc}"[:500]
            _move(op, OperationState.NEEDS_REVIEW, actor, reason)
            alerts.error("operation %s needs review: %s", op.key, reason)
            return "needs_review"
        return "retry_later"
    _move(
        op,
        OperationState.RETRYING,
        actor,
        "provider shows the step succeeded; resuming",
        on_resume=spec.on_resume,
        resume=True,
    )
    return "done"


def settle_from_provider(
    claim: StepClaim, found: EffectResult, *, actor: str, source: str = "provider event"
) -> str:
    """Settle a claim from what the provider told us itself (an event); return the outcome.

    `found` is the provider object as the step's lookup would report it: SUCCESS
    with its reference, or PERMANENT (refused). Runs in its own transaction or
    inside the caller's (the inbox's, for a webhook): every write is a savepoint.

    * unsettled (`uncertain`, or `claimed` by an owner whose lease ran out or
      was released): taken over (`fence.take_over_claim`), settled through
      `fence.settle_claim` and the operation moved as `settle_one` moves it
      after a lookup: done -> `retrying` and dispatched (`on_resume`), refused
      -> `failed` (`on_failure`). "done" / "failed".
    * another owner holds a live lease on the claim, or a worker runs the
      operation now: nothing changes, that owner records its own answer; the
      caller may bring the fact again later. "busy".
    * settled the same way already: nothing changes, except that an operation
      left between its claim's commit and its own (what the reconciler's
      stranded pass resumes) is resumed. "already_settled".
    * a refusal of the very object a done step succeeded with (a refund that failed
      after it succeeded): the provider reversed it; recorded once, the handler's
      `on_reversal` undoes its writes, with an alert. "reversed" (without a hook,
      as a contradiction below).
    * a refusal of another object for a step recorded done: an older fact, nothing
      changes. "stale".
    * a contradiction (a success for a step recorded failed, a second success
      reference for a done step, a reference that already settles another
      claim): an alert, and the operation goes to `needs_review`; no claim
      changes. "needs_review" ("alerted" when the operation had succeeded).
    """
    if found.outcome not in (Outcome.SUCCESS, Outcome.PERMANENT):
        raise ValueError(f"a provider fact is a success or a refusal, not {found.outcome}")
    current = StepClaim.objects.select_related("operation").get(pk=claim.pk)
    op = current.operation
    spec = get_handler(op.kind)
    if current.state in (ClaimState.DONE, ClaimState.FAILED):
        return _against_settled(current, found, spec, actor)
    if found.outcome == Outcome.SUCCESS:
        other = fence.claim_carrying(found.reference, besides=current)
        if other is not None:  # one provider object settles one step: never record it twice
            return _contradiction(
                current,
                actor,
                f"{source}: the provider's {found.reference} already settles {other}",
            )
    if _worker_runs(op):
        return "busy"
    taken = fence.take_over_claim(
        current, owner=actor, lease_seconds=payments_settings().claim_lease, why=source
    )
    if taken is None:
        return "busy"
    if taken.state in (ClaimState.DONE, ClaimState.FAILED):
        return _against_settled(taken, found, spec, actor)
    fence.note_provider_view(taken, found, source=source)
    if found.outcome == Outcome.SUCCESS:
        fence.settle_claim(
            taken,
            ClaimState.DONE,
            actor=actor,
            reference=found.reference,
            result=found.as_result(),
            reason=f"{source}: {found.reference} succeeded",
        )
        _move(
            op,
            OperationState.RETRYING,
            actor,
            f"{source}: the provider shows the step succeeded; resuming",
            on_resume=spec.on_resume,
            resume=True,
        )
        return "done"
    code = str(found.data.get("code") or "refused")
    fence.settle_claim(
        taken,
        ClaimState.FAILED,
        actor=actor,
        reference=found.reference,
        result=found.as_result(),
        error=f"refused: {code}",
        reason=f"{source}: refused ({code})",
    )
    _move(
        op, OperationState.FAILED, actor, f"provider: refused ({code})", on_failure=spec.on_failure
    )
    return "failed"


def _worker_runs(op: Operation) -> bool:
    """Tell whether a worker holds the operation's lease now (it records its own outcome)."""
    return fence.lease_alive(Operation.objects.get(pk=op.pk), fence.db_now())


def _against_settled(claim: StepClaim, found: EffectResult, spec: HandlerSpec, actor: str) -> str:
    """Compare a provider fact with a settled claim; settled claims never change."""
    op = claim.operation
    if claim.state == ClaimState.DONE:
        if (
            found.outcome != Outcome.SUCCESS
            and found.reference == claim.provider_reference
            and spec.on_reversal is not None
        ):
            # The very object that succeeded is refused now (a refund that failed after
            # it succeeded): the provider took it back. Never an older, stale fact. Only
            # effects that can be reversed so declare it (a succeeded PaymentIntent cannot
            # fail; a snapshot read before it succeeded is stale).
            return _reversed(claim, found, spec, actor)
        if found.outcome != Outcome.SUCCESS:
            logger.info(
                "operation %s step %s is done (%s); an older refusal %s changes nothing",
                op.key,
                claim.step,
                claim.provider_reference,
                found.reference,
            )
            return "stale"
        if claim.provider_reference and found.reference != claim.provider_reference:
            return _contradiction(
                claim,
                actor,
                f"a second success {found.reference} beside {claim.provider_reference}: "
                "double charge",
            )
        if Operation.objects.filter(pk=op.pk).filter(stranded_operations()).exists():
            _move(
                op,
                OperationState.RETRYING,
                actor,
                "claims settled; resuming",
                on_resume=spec.on_resume,
                resume=True,
            )
        return "already_settled"
    if found.outcome == Outcome.SUCCESS:
        return _contradiction(
            claim, actor, f"{found.reference} succeeded for a step recorded failed"
        )
    return "already_settled"


def _reversed(claim: StepClaim, found: EffectResult, spec: HandlerSpec, actor: str) -> str:
    """Record once that the provider reversed a done step, and let the handler undo its writes.

    The claim stays done (the effect did happen); a local claim of its own,
    `<step>:reversed`, makes the reversal happen once however often the
    provider says so. The handler's `on_reversal` runs in the same transaction
    and undoes what the operation wrote so far (its later steps, if they have
    not run yet, see the reversal claim and write nothing). An alert either way.
    """
    op = claim.operation
    status = str(found.data.get("status") or found.outcome)
    reason = f"the provider reversed {claim.step} {found.reference} (now {status})"
    hook = spec.on_reversal
    assert hook is not None  # _against_settled sends only handlers that declare one
    with transaction.atomic():
        # No lock on the operation: a worker running its later steps holds the entity's
        # row (the hook's lock) and then the operation's; the claim's unique key decides.
        recorded = fence.insert_local_claim_in_tx(
            op, reversal_step(claim.step), owner=actor, result=found.as_result()
        )
        if recorded is None:
            return "already_settled"  # told before: reversed once
        hook(op, found)
        fence.record_event_in_tx(
            op,
            step=claim.step,
            from_state=op.state,
            to_state=op.state,
            actor=actor,
            reason=f"{reason}; its effect was undone"[:1000],
        )
    alerts.error("operation %s: %s; its effect was undone", op.key, reason)
    return "reversed"


def _contradiction(claim: StepClaim, actor: str, reason: str) -> str:
    """Alert and park the operation in needs_review; no claim changes."""
    op = claim.operation
    if _worker_runs(op):
        return "busy"  # it may not leave RUNNING under a live lease: bring it again later
    reason = f"provider contradicts {claim.step} ({claim.state}): {reason}"[:500]
    alerts.error("operation %s needs review: %s", op.key, reason)
    state = Operation.objects.values_list("state", flat=True).get(pk=op.pk)
    if state == OperationState.SUCCEEDED:
        return "alerted"  # final: the alert is all there is to do
    _move(op, OperationState.NEEDS_REVIEW, actor, reason)
    return "needs_review"


def _move(
    op: Operation,
    state: OperationState,
    actor: str,
    reason: str,
    *,
    on_failure=None,
    on_resume=None,
    resume: bool = False,
) -> None:
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if fence.lease_alive(locked, fence.clock_of(locked)):
            return  # a worker runs it now and will see the settled claim itself
        if locked.state == OperationState.SUCCEEDED:
            return
        if locked.state == state and not resume:
            return  # nothing changes: the trail records changes only
        was_failed = locked.state == OperationState.FAILED
        fields: dict[str, Any] = {"next_attempt_at": fence.clock_of(locked)} if resume else {}
        if state in (OperationState.NEEDS_REVIEW, OperationState.FAILED):
            fields["last_error"] = reason  # the desk shows why
        fence.release_in_tx(locked, state, actor=actor, reason=reason, **fields)
        if on_failure is not None and state == OperationState.FAILED and not was_failed:
            on_failure(locked)
        if on_resume is not None and resume and was_failed:
            on_resume(locked)
        if resume:
            # Ahead of new work: the provider's outcome is known, money may be taken already.
            dispatch_on_commit(locked, first=True)
