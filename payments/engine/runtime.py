"""Run an operation's handler under the fence, and map each outcome to a state.

    lease    take the operation (no other live worker runs it)
    steps    the handler's named steps; completed ones replay their stored result
    settle   succeeded | failed | retrying (transient) | uncertain | needs_review

The runtime owns its transactions; the job that calls it only passes ids.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from enum import StrEnum
from typing import Any

from django.db import connection, transaction

from payments.conf import payments_settings
from payments.engine import fence
from payments.engine.dispatch import HINT_FIELDS, HINT_META_KEY
from payments.engine.failpoints import BEFORE_GIVE_UP, failpoint
from payments.engine.handlers import (
    GIVE_UP_STEP,
    NOT_READ,
    HandlerSpec,
    Run,
    entity_models,
    get_handler,
)
from payments.engine.systems import system_of
from payments.exceptions import (
    ConfigurationError,
    RetriesExhausted,
    RetryLater,
    StepBusy,
    StepConflict,
    StepNeedsReview,
    StepRefused,
    StepTransient,
    StepUncertain,
)
from payments.models import (
    ClaimState,
    Operation,
    OperationState,
    StepClaim,
)

logger = logging.getLogger("payments.engine.runtime")
alerts = logging.getLogger("payments.alerts")


class RunResult(StrEnum):
    """What became of an operation after one run: the job's return value."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    #: Another worker holds it, or a step is busy: it is looked at again later.
    DEFERRED = "deferred"
    #: An effect may have happened: the reconciler asks the system.
    UNCERTAIN = "uncertain"
    NEEDS_REVIEW = "needs_review"


def _tell_needs_review(op: Operation, exc: Exception) -> None:
    alerts.error("operation %s needs review: %s", op.key, getattr(exc, "step", exc))


def _tell_conflict(op: Operation, exc: Exception) -> None:
    alerts.error("operation %s: idempotency conflict at step %s", op.key, getattr(exc, "step", ""))


def _tell_uncertain(op: Operation, exc: Exception) -> None:
    logger.warning(
        "operation %s uncertain at step %s; reconciling", op.key, getattr(exc, "step", "")
    )


def _tell_cannot_run(op: Operation, exc: Exception) -> None:
    alerts.error("operation %s cannot run: %s", op.key, exc)


#: Errors that end a run in a state someone takes it from (a person, the reconciler),
#: first match wins: the error, that state, and how it is told.
ENDINGS: tuple[
    tuple[type[Exception], OperationState, Callable[[Operation, Exception], None]], ...
] = (
    (StepNeedsReview, OperationState.NEEDS_REVIEW, _tell_needs_review),
    (StepConflict, OperationState.NEEDS_REVIEW, _tell_conflict),
    (StepUncertain, OperationState.UNCERTAIN, _tell_uncertain),
    # The handler's own declaration is wrong: a person fixes it.
    (ConfigurationError, OperationState.NEEDS_REVIEW, _tell_cannot_run),
)


def execute(operation_id: int, *, worker_id: str, job: Any = None) -> str:
    """Run the operation's handler once; return what became of it.

    Returns a RunResult, or "skipped:<state>" for an operation no worker may run now.
    Raises RetryLater (RQ retries the job after its backoff) or RetriesExhausted (the
    job goes to the failed registry) once a failed attempt is counted.
    """
    leased = fence.acquire_lease(
        operation_id,
        owner=worker_id,
        seconds=payments_settings().claim_lease,
        entities=entity_models(),
        first_claim=_first_claim(operation_id, worker_id, job),
    )
    op = leased.operation
    if not leased.acquired:
        logger.info("operation %s not run: %s", op.key, _why_not(op))
        if op.state == OperationState.RUNNING:
            return RunResult.DEFERRED  # another worker's live lease: look again when it ends
        return f"skipped:{op.state}"
    try:
        spec = get_handler(op.kind)
        spec.check_entity(op)  # an entity of another type than the handler's: its caller's bug
    except ConfigurationError as exc:  # e.g. a kind renamed by a deploy: a person decides
        _finish(op, OperationState.NEEDS_REVIEW, worker_id, str(exc))
        _tell_cannot_run(op, exc)
        return RunResult.NEEDS_REVIEW
    run = Run(
        op,
        worker_id,
        spec,
        claimed_at_lease=leased.claimed_steps,
        prefetched_entity=(
            NOT_READ if spec.entity is None else leased.entities.get(spec.entity, NOT_READ)
        ),
        first_claim=leased.first_claim,
    )
    if spec.on_give_up is not None and _compensating(op, leased.claimed_steps):
        return _compensate(run, op.last_error or "gave up earlier")
    try:
        _run_handler(spec, run)
    except Exception as exc:  # what the error makes of the operation: a state, or RQ's retry
        # Before the error is weighed: a claim this run still holds would count as a call
        # that may have run, though nothing was sent under it.
        run.withdraw_first_claim()
        return _after_error(exc, run, job)
    # The release joins the handler's open transaction: its last writes and the
    # operation's `succeeded` commit together, the COMMIT in the release's round trip
    # (with a claim made with the lease that the handler never used, withdrawn).
    try:
        run.unit.commit_with(lambda: _succeed(run))
    except StepBusy as exc:  # a queued claim or outcome, sent with the release, was refused
        run.withdraw_first_claim()  # rolled back with the unit, if any: on its own now
        _finish(op, OperationState.RETRYING, worker_id, str(exc), next_attempt_at=exc.until)
        return RunResult.DEFERRED
    except BaseException as exc:  # a database error, the job's timeout: nothing stays open
        run.unit.roll_back(f"leaving the lease failed ({type(exc).__name__})")
        run.withdraw_first_claim()
        raise
    run.first_claim = None  # withdrawn with the release, if it was there
    return RunResult.SUCCEEDED


def _succeed(run: Run) -> None:
    """The end of a run whose handler returned: its unused first claim withdrawn, then the
    release to `succeeded`, in the unit's transaction."""
    run.withdraw_first_claim(in_unit=True)
    _finish(run.operation, OperationState.SUCCEEDED, run.worker_id, "all steps done")


class _Queries:
    """A Django execute wrapper that refuses every query, and remembers that one was asked."""

    def __init__(self) -> None:
        self.asked = False

    def __call__(self, *args: Any) -> None:
        self.asked = True
        raise _QueryRefused


class _QueryRefused(Exception):
    """A query asked for while a first step's request is built before the lease."""


def _first_claim(operation_id: int, worker_id: str, job: Any) -> fence.FirstClaim | None:
    """The claim of the step the handler opens with (`opens_with`), to write with the lease:
    built from the job's hint of the operation (payments.engine.dispatch.operation_hint),
    or None.

    None where the job has no hint (an older release's, a redelivery's), the run is in a
    caller's transaction, the handler declares no `opens_with`, or building the request
    asks for a query (even one the effect caught; reading a field the hint does not hold
    is one): it is then built after the lease, as any. The lease's statement
    inserts it only if the leased row holds the hint's values (queries.sql,
    insert_claim_with_lease); a run that does not get to the step withdraws it
    (Run.withdraw_first_claim).
    """
    hint = job.meta.get(HINT_META_KEY) if job is not None else None
    if not isinstance(hint, dict) or set(hint) != set(HINT_FIELDS):
        return None
    if connection.in_atomic_block:  # a caller's transaction: the claim could not commit
        return None
    queries = _Queries()
    try:
        spec = get_handler(str(hint["kind"]))
        if spec.opens_with is None:
            return None
        hint = {**hint, "entity_id": str(hint["entity_id"])}  # as the row holds it
        # The hint's fields only: any other is deferred, and reading it asks a query.
        values = {"id": operation_id, **hint}
        names = _hint_columns()
        operation = Operation.from_db(connection.alias, names, [values[n] for n in names])
        spec.check_entity(operation)
        with connection.execute_wrapper(queries):
            effect = spec.effect(spec.opens_with, Run(operation, worker_id, spec))
            request = effect.build_request()
            system = system_of(effect).name
        if not queries.asked:
            return fence.first_claim(
                hint,
                spec.opens_with,
                request=request,
                system=system,
                lease_seconds=payments_settings().claim_lease,
            )
    except Exception:  # built again after the lease, where its error counts as the run's
        if not queries.asked:
            logger.warning(
                "operation %s: its first claim was not built before the lease",
                operation_id,
                exc_info=True,
            )
            return None
    # The effect asked for a query (refused, or caught by the effect itself).
    logger.info(
        "operation %s: %s's request asks for a query: built after the lease",
        operation_id,
        spec.opens_with,
    )
    return None


@functools.cache
def _hint_columns() -> list[str]:
    """The operation's id and HINT_FIELDS, in the order of its model's columns (from_db's)."""
    wanted = {"id", *HINT_FIELDS}
    return [f.attname for f in Operation._meta.concrete_fields if f.attname in wanted]


def _after_error(exc: Exception, run: Run, job: Any) -> RunResult:
    """What the handler's error makes of its operation, returned; or another attempt,
    raised to RQ (RetryLater, RetriesExhausted) once the failure is counted.

    A busy step waits; a refusal fails the operation (or compensates an earlier
    step's effect); an error of ENDINGS leaves it in that error's state; a transient
    error, or any other (a bug, a database error), is a counted attempt.
    """
    op, spec, worker_id = run.operation, run.spec, run.worker_id
    if isinstance(exc, StepBusy):
        _finish(op, OperationState.RETRYING, worker_id, str(exc), next_attempt_at=exc.until)
        return RunResult.DEFERRED
    if isinstance(exc, StepRefused):
        if _compensation_due(op, spec, worker_id):
            return _compensate(run, str(exc))
        _fail(op, spec, worker_id, str(exc))
        return RunResult.FAILED
    for error, state, tell in ENDINGS:
        if isinstance(exc, error):
            _finish(op, state, worker_id, str(exc))
            tell(op, exc)
            return RunResult(state)
    if isinstance(exc, StepTransient):
        last_try = op.attempts + 1 >= payments_settings().max_attempts
        if last_try and not exc.in_flight and _compensation_due(op, spec, worker_id):
            return _compensate(run, f"gave up after {op.attempts + 1} attempts: {exc}")
        raise _counted_failure(op, spec, worker_id, str(exc), job, step_error=exc)
    logger.error("operation %s: unexpected error in handler %s", op.key, op.kind, exc_info=exc)
    raise _counted_failure(op, spec, worker_id, f"{type(exc).__name__}: {exc}", job)


def _run_handler(spec: HandlerSpec, run: Run) -> None:
    """Call the handler; on any error, commit its open transaction before the error is handled.

    What the unit holds then is complete (a failing local step rolled itself
    back): the steps done before the failure stay done, as if each had
    committed. A commit that fails has rolled back and rewritten the recorded
    outcomes (payments.engine.unit); the handler's error is what is handled.
    A handler that returns after a local step's failure rolled back earlier
    steps (it caught the error) has not done them: UnitRolledBack, retried.
    """
    try:
        spec.func(run)
        run.unit.require_intact()
    except BaseException:
        try:
            if run.unit.intact:
                run.unit.commit()
        except Exception:
            logger.exception("operation %s: its open transaction did not commit", run.operation.key)
        raise


def _why_not(op: Operation) -> str:
    if op.state == OperationState.RUNNING:
        return f"leased by {op.lease_owner} until {op.lease_expires_at}"
    return f"state is {op.state}"


def _finish(
    op: Operation, state: OperationState, worker_id: str, reason: str, **fields: Any
) -> bool:
    """Leave RUNNING if this worker still holds the lease; return whether it did (one statement)."""
    if state in (OperationState.SUCCEEDED, OperationState.NEEDS_REVIEW, OperationState.UNCERTAIN):
        fields.setdefault("last_error", "" if state == OperationState.SUCCEEDED else reason)
    released = fence.release_held_lease(op, state, owner=worker_id, reason=reason[:500], **fields)
    if released is None:
        logger.warning("operation %s: lease lost before %s; left as is", op.key, state)
        return False
    return True


def _give_up_state_in_tx(
    op: Operation, spec: HandlerSpec, *, worker_id: str, in_flight: bool
) -> OperationState:
    """Where an operation goes when it stops trying. Runs inside the caller's transaction.

    FAILED only when no external effect happened or may have: money taken by
    an earlier step (its later steps keep failing) needs a person; an effect
    whose outcome is unknown needs the reconciler. A claim is in doubt unless
    it failed or THIS worker released it after a refusal: a claim its owner
    never released (an error between the provider's answer and the record),
    or one somebody else holds now, may have executed. Neither may fail the order.
    """
    external = list(StepClaim.objects.filter(operation=op, step__in=list(spec.effects)))
    if any(claim.state == ClaimState.DONE for claim in external):
        return OperationState.NEEDS_REVIEW
    if in_flight or any(_in_doubt(claim, worker_id) for claim in external):
        return OperationState.UNCERTAIN
    return OperationState.FAILED


def _in_doubt(claim: StepClaim, worker_id: str) -> bool:
    """Tell whether an external claim's call may have run unseen: neither settled nor released
    by this very worker after a refusal (uncertain, never released, or someone else's now)."""
    return claim.state not in (ClaimState.DONE, ClaimState.FAILED) and not fence.released_by(
        claim, worker_id
    )


def _compensation_due(op: Operation, spec: HandlerSpec, worker_id: str) -> bool:
    """Tell whether giving up now calls the handler's `on_give_up`: an earlier external step
    succeeded, and no other is in doubt (each failed, or released by this worker after a
    refusal). An effect that may have happened is the reconciler's, never compensated."""
    if spec.on_give_up is None:
        return False
    external = list(StepClaim.objects.filter(operation=op, step__in=list(spec.effects)))
    done = any(claim.state == ClaimState.DONE for claim in external)
    return done and not any(_in_doubt(claim, worker_id) for claim in external)


def _compensating(op: Operation, claimed: frozenset[str] | None) -> bool:
    """Tell whether the operation started its compensation before (its marker claim)."""
    if claimed is not None:
        return GIVE_UP_STEP in claimed
    return StepClaim.objects.filter(operation=op, step=GIVE_UP_STEP).exists()


def _compensate(run: Run, reason: str) -> RunResult:
    """Run the handler's `on_give_up` under the lease, then fail the operation.

    Its steps are steps of the operation like any other (own claims, own keys):
    a compensation interrupted here is found done, or reconciled, when the
    operation runs again. Until it completes the operation is not failed: it
    waits (busy), is reconciled (uncertain), or a person looks (anything else).
    """
    op, spec, worker_id = run.operation, run.spec, run.worker_id
    assert spec.on_give_up is not None
    logger.warning("operation %s gives up (%s); compensating", op.key, reason[:200])
    try:
        # Durable before the compensation's first call: a redelivery resumes it from here.
        run.local(GIVE_UP_STEP, lambda: {"reason": reason[:500]})
        spec.on_give_up(run)
        run.unit.commit()
    except StepBusy as exc:
        _finish(op, OperationState.RETRYING, worker_id, str(exc), next_attempt_at=exc.until)
        return RunResult.DEFERRED
    except StepTransient as exc:  # nothing executed: the compensation is tried again, later
        run.unit.commit()
        later = fence.db_now() + timedelta(seconds=payments_settings().backoff_before(99))
        _finish(op, OperationState.RETRYING, worker_id, f"{reason}; compensation: {exc}",
                next_attempt_at=later)  # fmt: skip
        return RunResult.DEFERRED
    except StepUncertain as exc:
        run.unit.roll_back("compensation uncertain")
        # last_error stays the give-up's reason: the next run compensates with it.
        _finish(
            op, OperationState.UNCERTAIN, worker_id, f"{reason}; compensation: {exc}",
            last_error=reason,
        )  # fmt: skip
        return RunResult.UNCERTAIN
    except Exception as exc:
        run.unit.roll_back(f"compensation failed ({type(exc).__name__})")
        why = f"{reason}; compensation did not complete: {type(exc).__name__}: {exc}"
        _finish(op, OperationState.NEEDS_REVIEW, worker_id, why)
        alerts.error("operation %s: compensation did not complete; a person decides", op.key)
        return RunResult.NEEDS_REVIEW
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if not fence.holds_lease_in_tx(locked, worker_id):
            return RunResult.DEFERRED
        why = f"{reason}; compensated"[:500]
        fence.release_in_tx(
            locked, OperationState.FAILED, actor=worker_id, reason=why, last_error=reason[:2000]
        )
        # The step that gave up was released after its refusals (by this worker, or by the
        # one whose compensation this run resumes: nothing else reaches here): it failed.
        _settle_released_in_tx(locked, spec, worker_id, reason)
        if spec.on_failure is not None:
            spec.on_failure(locked)
    logger.info("operation %s failed after compensation", op.key)
    return RunResult.FAILED


def _settle_released_in_tx(op: Operation, spec: HandlerSpec, worker_id: str, reason: str) -> None:
    """Settle failed the external claims released after a refusal (no lease: nothing ran).
    In the caller's transaction; a claim another actor holds now is left alone."""
    released = StepClaim.objects.filter(
        operation=op,
        step__in=list(spec.effects),
        state=ClaimState.CLAIMED,
        lease_expires_at__isnull=True,
    )
    lease = payments_settings().claim_lease
    for claim in released:
        taken = fence.take_over_claim(claim, owner=worker_id, lease_seconds=lease)
        if taken is not None and taken.state == ClaimState.CLAIMED:
            fence.settle_claim(
                taken,
                ClaimState.FAILED,
                actor=worker_id,
                error=f"{fence.GAVE_UP_BEFORE_RUNNING}{reason}"[:2000],
                reason="refused before executing; the operation compensated",
            )


def _fail(op: Operation, spec: HandlerSpec, worker_id: str, reason: str) -> None:
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if not fence.holds_lease_in_tx(locked, worker_id):
            return
        state = _give_up_state_in_tx(locked, spec, worker_id=worker_id, in_flight=False)
        fence.release_in_tx(locked, state, actor=worker_id, reason=reason[:500], last_error=reason)
        if state == OperationState.FAILED and spec.on_failure is not None:
            spec.on_failure(locked)
    if state == OperationState.NEEDS_REVIEW:
        alerts.error("operation %s: a step was refused after money was taken", op.key)
    logger.info("operation %s %s: %s", op.key, state, reason[:200])


def _counted_failure(
    op: Operation,
    spec: HandlerSpec,
    worker_id: str,
    reason: str,
    job: Any,
    step_error: StepTransient | None = None,
) -> RetryLater | RetriesExhausted:
    """Count a transient failure; return what hands the job back to RQ: the next attempt,
    or giving up (the caller raises it).

    Giving up fails the operation and settles the failing step's claim as
    failed only when every try was refused before anything executed (see
    _give_up_state_in_tx): not after a 409 (a same-key request may still
    succeed), not when an earlier call may have run, not after money was taken.
    """
    in_flight = step_error is not None and step_error.in_flight
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if not fence.holds_lease_in_tx(locked, worker_id):
            return RetryLater(op.key, locked.attempts + 1, "lease lost")
        failpoint(BEFORE_GIVE_UP)
        give_up_to = _give_up_state_in_tx(locked, spec, worker_id=worker_id, in_flight=in_flight)
        gave_up = fence.record_failed_attempt_in_tx(
            locked, actor=worker_id, reason=reason, give_up_to=give_up_to
        )
        if step_error is None:
            _mark_own_claims_in_doubt_in_tx(locked, spec, worker_id, reason)
        if gave_up and give_up_to == OperationState.FAILED:
            if spec.on_failure is not None:
                spec.on_failure(locked)
            if step_error is not None:
                _settle_refused_in_tx(locked, step_error.step, worker_id, reason)
    return next_try(locked, gave_up=gave_up, reason=reason, job=job)


def next_try(
    op: Operation, *, gave_up: bool, reason: str, job: Any
) -> RetryLater | RetriesExhausted:
    """What to raise to RQ after a counted failure: RetryLater, or RetriesExhausted (with an
    alert, and no RQ retry left) once the fence gave up."""
    if gave_up:
        alerts.error(
            "operation %s gave up after %s attempts (now %s); job sent to the failed registry",
            op.key,
            op.attempts,
            op.state,
        )
        if job is not None:
            job.retries_left = 0  # the DB counted the attempts: no further RQ retry
        return RetriesExhausted(op.key, op.attempts, reason[:200])
    return RetryLater(op.key, op.attempts, reason[:200])


def _mark_own_claims_in_doubt_in_tx(
    op: Operation, spec: HandlerSpec, worker_id: str, reason: str
) -> None:
    """After an unexpected error, settle this worker's unreleased external claims uncertain.

    The error came between claim and record (a deadlock, a statement timeout
    after the provider's 200): the call may have run. Saying so at once lets
    the reconciler look now instead of after the lease. Runs in the caller's tx.
    """
    held = StepClaim.objects.filter(
        operation=op,
        step__in=list(spec.effects),
        state=ClaimState.CLAIMED,
        claimed_by=worker_id,
        lease_expires_at__isnull=False,
    )
    for claim in held:
        fence.settle_claim(
            claim,
            ClaimState.UNCERTAIN,
            actor=worker_id,
            error=f"error before the outcome was recorded: {reason}"[:2000],
        )


def _settle_refused_in_tx(op: Operation, step: str, worker_id: str, reason: str) -> None:
    """Mark this worker's released claim failed after the last refused try (in the caller's tx).

    Only a claim this worker released (compare-and-set on owner and lease): a
    claim another actor took over since is theirs to settle.
    """
    claim = StepClaim.objects.filter(operation=op, step=step).first()
    if claim is not None and fence.released_by(claim, worker_id):
        fence.settle_claim(
            claim,
            ClaimState.FAILED,
            actor=worker_id,
            error=f"{fence.GAVE_UP_BEFORE_RUNNING}{reason}",
            reason="every attempt was refused before executing",
        )
