"""Run an operation's handler under the fence, and map each outcome to a state.

    lease    take the operation (no other live worker runs it)
    steps    the handler's named steps; completed ones replay their stored result
    settle   succeeded | failed | retrying (transient) | uncertain | needs_review

The runtime owns its transactions; the job that calls it only passes ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction

from payments import fence, telemetry
from payments.conf import payments_setting
from payments.effects import DeliveryPolicy
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
    RUNNABLE_OPERATION_STATES,
    ClaimState,
    Operation,
    OperationState,
    StepClaim,
)
from payments.registry import HandlerSpec, get_handler
from payments.steps import run_external_step

logger = logging.getLogger("payments.runtime")
alerts = logging.getLogger("payments.alerts")


@dataclass
class Run:
    """What a handler gets: its operation and the three kinds of step."""

    operation: Operation
    worker_id: str
    spec: HandlerSpec

    @property
    def params(self) -> dict[str, Any]:
        return self.operation.params

    def external(self, step: str) -> dict[str, Any]:
        """Run an external step (claim committed before the call); return its result."""
        effect = self.spec.effect(step, self.operation)
        return run_external_step(self.operation, step, effect, owner=self.worker_id)

    @telemetry.traced("local")
    def local(self, step: str, func: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        """Run a local step: its claim and its writes commit together, once."""
        try:
            with transaction.atomic():
                claim = fence.insert_local_claim_in_tx(self.operation, step, owner=self.worker_id)
                result = func() or {}
                StepClaim.objects.filter(pk=claim.pk).update(result=result)
        except IntegrityError as exc:
            if not fence.unique_violation_of(exc, StepClaim.UNIQUE_CONSTRAINT):
                raise  # any other integrity error is a bug, not a duplicate
            existing = StepClaim.objects.get(operation=self.operation, step=step)
            telemetry.note(outcome=telemetry.SKIPPED, transaction=telemetry.ROLLBACK)
            logger.info("step %s/%s already done; skipped", self.operation.key, step)
            return existing.result or {}
        return result

    @telemetry.traced("side_effect")
    def side_effect(
        self, step: str, func: Callable[[], dict[str, Any] | None], *, policy: DeliveryPolicy
    ) -> dict[str, Any]:
        """Run an effect that cannot be looked up (plain e-mail) under its declared policy."""
        lease = payments_setting("CLAIM_LEASE")
        claimed = fence.claim_step(
            self.operation, step, owner=self.worker_id, lease_seconds=lease, provider_call=False
        )
        claim = claimed.claim
        resend = False
        if not claimed.created:
            if claim.state in (ClaimState.DONE, ClaimState.FAILED):
                telemetry.note(outcome=telemetry.SKIPPED, transaction=telemetry.NONE)
                return claim.result or {}
            taken = fence.take_over_claim(claim, owner=self.worker_id, lease_seconds=lease)
            if taken is not None and taken.state in (ClaimState.DONE, ClaimState.FAILED):
                return taken.result or {}  # settled meanwhile by another worker
            if taken is None:
                raise StepBusy(
                    operation_key=self.operation.key, step=step, until=claim.lease_expires_at
                )
            claim = taken
            if policy == DeliveryPolicy.AT_MOST_ONCE:
                result = {"sent": "unknown", "skipped": True, "policy": str(policy)}
                telemetry.note(outcome=telemetry.SKIPPED)
                logger.warning(
                    "step %s/%s may have run before; skipped (at most once)",
                    self.operation.key,
                    step,
                )
                fence.settle_claim(
                    claim,
                    ClaimState.DONE,
                    actor=self.worker_id,
                    result=result,
                    reason="outcome unknown; skipped under at-most-once",
                )
                return result
            resend = True
        try:
            result = dict(func() or {})
        except Exception as exc:  # the effect's own failure; the policy decides
            reason = f"{type(exc).__name__}: {exc}"[:500]
            if policy == DeliveryPolicy.AT_LEAST_ONCE:
                fence.release_claim(claim, actor=self.worker_id, reason=reason)
                raise StepTransient(reason, operation_key=self.operation.key, step=step) from exc
            result = {"sent": False, "error": type(exc).__name__, "policy": str(policy)}
            telemetry.note(outcome=telemetry.PERMANENT)
            logger.warning(
                "step %s/%s failed; not retried (at most once)", self.operation.key, step
            )
            fence.settle_claim(
                claim, ClaimState.DONE, actor=self.worker_id, result=result, reason=reason
            )
            return result
        result.update({"policy": str(policy), "resent": resend})
        fence.settle_claim(claim, ClaimState.DONE, actor=self.worker_id, result=result)
        return result


def execute(operation_id: int, *, worker_id: str, job: Any = None) -> str:
    """Run the operation's handler once; return what became of it.

    Raises RetryLater (RQ retries the job after its backoff) or
    RetriesExhausted (the job goes to the failed registry).
    """
    kind = Operation.objects.values_list("kind", flat=True).get(pk=operation_id)
    try:
        spec = get_handler(kind)
    except ConfigurationError as exc:  # e.g. a kind renamed by a deploy: a person decides
        return _unrunnable(operation_id, worker_id, str(exc))
    leased = fence.acquire_lease(
        operation_id, owner=worker_id, seconds=payments_setting("CLAIM_LEASE")
    )
    op = leased.operation
    if not leased.acquired:
        logger.info("operation %s not run: %s", op.key, _why_not(op))
        if op.state == OperationState.RUNNING:
            return "deferred"  # another worker's live lease: look again when it ends
        return f"skipped:{op.state}"
    try:
        spec.func(Run(op, worker_id, spec))
    except StepBusy as exc:
        _finish(op, OperationState.RETRYING, worker_id, str(exc), next_attempt_at=exc.until)
        return "deferred"
    except StepRefused as exc:
        _fail(op, spec, worker_id, str(exc))
        return "failed"
    except StepNeedsReview as exc:
        _finish(op, OperationState.NEEDS_REVIEW, worker_id, str(exc))
        alerts.error("operation %s needs review: %s", op.key, exc.step)
        return "needs_review"
    except StepConflict as exc:
        _finish(op, OperationState.NEEDS_REVIEW, worker_id, str(exc))
        alerts.error("operation %s: idempotency conflict at step %s", op.key, exc.step)
        return "needs_review"
    except StepUncertain as exc:
        _finish(op, OperationState.UNCERTAIN, worker_id, str(exc))
        logger.warning("operation %s uncertain at step %s; reconciling", op.key, exc.step)
        return "uncertain"
    except StepTransient as exc:
        _transient(op, spec, worker_id, str(exc), job, step_error=exc)
    except Exception as exc:  # a bug or a database error: bounded retries, then visible
        logger.exception("operation %s: unexpected error in handler %s", op.key, op.kind)
        _transient(op, spec, worker_id, f"{type(exc).__name__}: {exc}", job)
    _finish(op, OperationState.SUCCEEDED, worker_id, "all steps done")
    return "succeeded"


def _why_not(op: Operation) -> str:
    if op.state == OperationState.RUNNING:
        return f"leased by {op.lease_owner} until {op.lease_expires_at}"
    return f"state is {op.state}"


def _finish(
    op: Operation, state: OperationState, worker_id: str, reason: str, **fields: Any
) -> bool:
    """Leave RUNNING if this worker still holds the lease; return whether it did."""
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if not fence.holds_lease_in_tx(locked, worker_id):
            logger.warning("operation %s: lease lost before %s; left as is", op.key, state)
            return False
        if state in (OperationState.SUCCEEDED, OperationState.NEEDS_REVIEW):
            fields.setdefault("last_error", "" if state == OperationState.SUCCEEDED else reason)
        fence.release_in_tx(locked, state, actor=worker_id, reason=reason[:500], **fields)
    return True


def _unrunnable(operation_id: int, worker_id: str, reason: str) -> str:
    """Park an operation no handler can run in needs_review, with an alert."""
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(operation_id)
        if locked.state not in RUNNABLE_OPERATION_STATES:
            return f"skipped:{locked.state}"
        fence.release_in_tx(
            locked, OperationState.NEEDS_REVIEW, actor=worker_id, reason=reason, last_error=reason
        )
    alerts.error("operation %s cannot run: %s", locked.key, reason)
    return "needs_review"


def _give_up_state_in_tx(op: Operation, spec: HandlerSpec, *, in_flight: bool) -> OperationState:
    """Where an operation goes when it stops trying. Runs inside the caller's transaction.

    FAILED only when no external effect happened or may have: money taken by
    an earlier step (its later steps keep failing) needs a person; an effect
    whose outcome is unknown needs the reconciler. Neither may fail the order.
    """
    external = StepClaim.objects.filter(operation=op, step__in=list(spec.effects))
    if external.filter(state=ClaimState.DONE).exists():
        return OperationState.NEEDS_REVIEW
    if in_flight or external.filter(state=ClaimState.UNCERTAIN).exists():
        return OperationState.UNCERTAIN
    return OperationState.FAILED


def _fail(op: Operation, spec: HandlerSpec, worker_id: str, reason: str) -> None:
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if not fence.holds_lease_in_tx(locked, worker_id):
            return
        state = _give_up_state_in_tx(locked, spec, in_flight=False)
        if state == OperationState.UNCERTAIN:
            state = OperationState.FAILED  # the refused step settled; others are not in doubt
        fence.release_in_tx(locked, state, actor=worker_id, reason=reason[:500], last_error=reason)
        if state == OperationState.FAILED and spec.on_failure is not None:
            spec.on_failure(locked)
    if state == OperationState.NEEDS_REVIEW:
        alerts.error("operation %s: a step was refused after money was taken", op.key)
    logger.info("operation %s %s: %s", op.key, state, reason[:200])


def _transient(
    op: Operation,
    spec: HandlerSpec,
    worker_id: str,
    reason: str,
    job: Any,
    step_error: StepTransient | None = None,
) -> None:
    """Count a transient failure; schedule the next attempt or give up. Always raises.

    Giving up fails the operation and settles the failing step's claim as
    failed only when every try was refused before anything executed (see
    _give_up_state_in_tx): not after a 409 (a same-key request may still
    succeed), not when an earlier call may have run, not after money was taken.
    """
    in_flight = step_error is not None and step_error.in_flight
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        if not fence.holds_lease_in_tx(locked, worker_id):
            raise RetryLater(op.key, locked.attempts + 1, "lease lost")
        give_up_to = _give_up_state_in_tx(locked, spec, in_flight=in_flight)
        gave_up = fence.record_failed_attempt_in_tx(
            locked, actor=worker_id, reason=reason, give_up_to=give_up_to
        )
        if gave_up and give_up_to == OperationState.FAILED:
            if spec.on_failure is not None:
                spec.on_failure(locked)
            if step_error is not None:
                _settle_refused_in_tx(locked, step_error.step, worker_id, reason)
    retry_or_give_up(locked, gave_up=gave_up, reason=reason, job=job)


def retry_or_give_up(op: Operation, *, gave_up: bool, reason: str, job: Any) -> None:
    """Raise to RQ after a counted failure: RetryLater, or RetriesExhausted with an alert."""
    if gave_up:
        alerts.error(
            "operation %s gave up after %s attempts (now %s); job sent to the failed registry",
            op.key,
            op.attempts,
            op.state,
        )
        if job is not None:
            job.retries_left = 0  # the DB counted the attempts: no further RQ retry
        raise RetriesExhausted(op.key, op.attempts, reason[:200])
    raise RetryLater(op.key, op.attempts, reason[:200])


def _settle_refused_in_tx(op: Operation, step: str, worker_id: str, reason: str) -> None:
    """Mark a released claim failed after the last transient try. Runs inside the caller's tx."""
    claim = StepClaim.objects.filter(operation=op, step=step, state=ClaimState.CLAIMED).first()
    if claim is not None:
        fence.settle_claim(
            claim,
            ClaimState.FAILED,
            actor=worker_id,
            error=f"gave up: {reason}",
            reason="every attempt was refused before executing",
        )
