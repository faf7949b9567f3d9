"""The operators' desk: every decision a person takes on an operation, as a service.

The admin's buttons call these functions and so do the tests; nothing else
edits operations on an operator's behalf. Each service checks the user's
permission, locks the operation (SELECT ... FOR UPDATE) so that two operators
serialise, re-checks the state under that lock, writes an audit row with the
actor `operator:<username>` and the reason, and raises a DeskError (an
InvalidTransition) when the state forbids the action. The second of two
concurrent operators therefore gets a clear refusal, and nothing happens twice.

Provider look-ups happen before the transaction opens (no transaction is held
across an HTTP call); what they showed is re-checked under the lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.contrib.auth.models import PermissionsMixin
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import F, Max
from django.db.models.functions import Now

from payments.conf import payments_settings
from payments.desk.display import when
from payments.desk.evidence import system_label
from payments.desk.rules import (
    DeskActions,
    DeskError,
    ReasonRequired,
    available_actions,
    check_entity_reopenable,
    check_new_attempt,
    check_no_live_lease,
    check_payment_method,
    check_reference_unused,
    check_resume,
    next_attempt_key,
    settleable_claim,
    verified_success,
)
from payments.engine import exchanges, fence, recovery
from payments.engine.dispatch import dispatch_on_commit
from payments.engine.effects import EffectResult, StillInProgress
from payments.engine.handlers import HandlerSpec, get_handler
from payments.engine.outcomes import Outcome
from payments.engine.steps import (
    claim_system,
    past_grace,
    replay_allowed,
    replay_deadline,
    view_of,
)
from payments.engine.systems import ExternalSystem
from payments.exceptions import InvalidTransition
from payments.models import ClaimLook, ClaimState, Operation, OperationState, StepClaim

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

logger = logging.getLogger("payments.desk.services")
alerts = logging.getLogger("payments.alerts")

RECONCILE_PERMISSION = "payments.reconcile_operation"
NEW_ATTEMPT_PERMISSION = "payments.start_new_attempt"

__all__ = [
    "DeskActions",
    "DeskError",
    "ReasonRequired",
    "available_actions",
    "mark_step_failed",
    "MarkedFailed",
    "mark_step_succeeded",
    "next_attempt_key",
    "query_provider",
    "resume",
    "start_new_attempt",
]


def actor_of(user: AbstractBaseUser) -> str:
    """Return the audit actor of an operator."""
    return f"operator:{user.get_username()}"


# --- query the provider ----------------------------------------------------------


@dataclass(frozen=True)
class QueryOutcome:
    """What querying the provider did to one operation."""

    operation_id: int
    key: str
    outcome: str  # a reconcile outcome ("done", "failed", ...) or "nothing_to_settle"
    state_before: str
    state_after: str


@dataclass
class QueryReport:
    """The outcome of `query_provider` for each selected operation, in selection order."""

    rows: list[QueryOutcome] = field(default_factory=list)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for row in self.rows:
            counts[row.outcome] = counts.get(row.outcome, 0) + 1
        return ", ".join(
            f"{n} {outcome.replace('_', ' ')}" for outcome, n in sorted(counts.items())
        )


#: How long one "Query ... now" asks the systems before it reports the rest not asked: under
#: a web server's request timeout (gunicorn's default is 30 s), however slowly a system
#: answers in an incident. Checked between operations (one may take its requests' timeouts).
QUERY_BUDGET_SECONDS = 10.0
#: The outcome of an operation a query had no time left to ask about (nothing was sent).
NOT_ASKED = "not_asked"

#: States in which a worker may still run the operation: a query there only reads.
WORKER_STATES = frozenset({OperationState.PENDING, OperationState.RUNNING, OperationState.RETRYING})


def query_provider(operation_ids: list[int], *, user: AbstractBaseUser) -> QueryReport:
    """Ask the provider what happened to the selected operations' unsettled steps.

    Operations no worker will run (uncertain, failed, needs review) go through
    the reconciler: stored reference, else a replay with the same key, else a
    consistent list; never a new key. Operations a worker may still run
    (pending, running, retrying) are only *read* (retrieve or list, no
    replay, nothing settled): a replay there could execute a charge beside the
    worker's own attempt; the worker records what happened. One under a live
    lease is refused, naming who holds it and until when. Each operation asked
    about gets one audit row saying the operator asked and what came back; once
    QUERY_BUDGET_SECONDS have passed the rest are not asked (NOT_ASKED), with no row,
    as is one held by a worker, and one with nothing to settle for which nothing was sent.
    """
    require_permission(user, RECONCILE_PERMISSION)
    ids = sorted({int(i) for i in operation_ids})
    if not ids:
        raise DeskError("select at least one operation", action="query_provider")
    actor = actor_of(user)
    # The ones looked at longest ago first: a press after a query that ran out of time asks
    # those it did not reach, not the same first few again.
    ops = {
        op.pk: op
        for op in Operation.objects.filter(pk__in=ids)
        .annotate(db_now=Now(), last_look=Max("claims__look__last_look_at"))
        .order_by(F("last_look").asc(nulls_first=True), "pk")
    }
    outcome_of: dict[int, str] = {}
    # The requests each operation's lookups sent that no settled step's row took: its
    # "queried the provider" row carries them (one recording per operation).
    sent_for: dict[int, list[dict[str, Any]] | None] = {}
    held: set[int] = set()  # under a worker's live lease: not asked
    started = time.monotonic()
    for op_id, listed in ops.items():
        if outcome_of and time.monotonic() - started > QUERY_BUDGET_SECONDS:  # one is asked
            outcome_of[op_id] = NOT_ASKED
            continue
        if fence.lease_alive(listed, fence.clock_of(listed)):
            held.add(op_id)
            outcome_of[op_id] = (
                f"held by {listed.lease_owner} until {when(listed.lease_expires_at)}; not queried"
            )
            continue
        with exchanges.recording():
            if listed.state in WORKER_STATES:
                outcome_of[op_id] = recovery.look_up(listed, actor=actor)
            else:
                left = max(QUERY_BUDGET_SECONDS - (time.monotonic() - started), 0.0)
                # The first operation is always asked whole; the next within what is left.
                outcome_of[op_id] = _reconciled(
                    listed, actor, time_budget=left if outcome_of else None
                )
            sent_for[op_id] = exchanges.take()
    result = QueryReport()
    for op_id in ids:
        if op_id not in ops:
            continue
        outcome = outcome_of[op_id]
        # Not asked (held, out of time), or nothing waited, and nothing sent: a press that
        # changed and learned nothing writes no audit row (fifteen presses wrote fifteen).
        quiet = op_id in held or outcome in ("nothing_to_settle", NOT_ASKED)
        if quiet and not sent_for.get(op_id):
            state = ops[op_id].state
            result.rows.append(QueryOutcome(op_id, ops[op_id].key, outcome, state, state))
            continue
        with transaction.atomic():
            op = fence.locked_operation_in_tx(op_id)
            fence.record_event_in_tx(
                op,
                from_state=op.state,
                to_state=op.state,
                actor=actor,
                reason=f"queried the provider: {outcome.replace('_', ' ')}"[:1000],
                requests=sent_for.get(op_id) or [],
            )
        result.rows.append(QueryOutcome(op.pk, op.key, outcome, ops[op_id].state, op.state))
    logger.info("operator queried the provider for %s operations: %s", len(ids), result.summary())
    return result


def _reconciled(op: Operation, actor: str, *, time_budget: float | None = None) -> str:
    """Reconcile one operation no worker will run, as the reconciler does; its outcome.
    `time_budget`: no claim of it is started once spent (then NOT_ASKED)."""
    claims = StepClaim.objects.filter(operation=op).count()
    report = recovery.reconcile(
        actor=actor, operation_ids=[op.pk], batch_size=max(claims, 1), time_budget=time_budget
    )
    by_key = {key: outcome for outcome, keys in report.outcomes.items() for key in keys}
    outcome = by_key.get(op.key, "nothing_to_settle")
    return NOT_ASKED if outcome == "left_for_next_round" else outcome


# --- resume ----------------------------------------------------------------------


def _resume_in_tx(op: Operation, *, actor: str, reason: str) -> None:
    """Make the locked operation due now with a fresh budget of attempts; enqueue on commit."""
    fence.release_in_tx(
        op,
        OperationState.RETRYING,
        actor=actor,
        reason=reason,
        next_attempt_at=fence.clock_of(op),
        attempts=0,
        last_error="",
    )
    dispatch_on_commit(op)


def resume(operation: Operation | int, *, user: AbstractBaseUser, reason: str) -> Operation:
    """Run the operation again with the SAME key (retrying, due now, enqueued on commit).

    Safe because every step replays its claim: a done step returns its stored
    result, a released claim is retried with its stored idempotency key (the
    provider replays a charge that already happened). Refused when:
    - it succeeded, or is queued already (pending, retrying: the sweeper
      re-delivers a lost job), or a worker holds a live lease;
    - a step is uncertain: running it again could not tell more than the
      provider can; query the provider or mark the step after checking;
    - it failed because the provider refused a step (a decline stays a
      decline with the same key: start a new attempt instead);
    - it failed and its order moved on (paid, or another attempt runs).
    A failed operation gets a fresh budget of attempts and its order goes back
    to processing, so that no second checkout can start beside it.
    """
    require_permission(user, RECONCILE_PERMISSION)
    reason = required_reason(reason)
    actor = actor_of(user)
    with transaction.atomic():
        op = fence.locked_operation_in_tx(_pk(operation))
        claims = _locked_claims_in_tx(op)
        check_resume(op, claims)
        if op.state == OperationState.FAILED:
            _reopen_entity_in_tx(op)
        _resume_in_tx(op, actor=actor, reason=f"resumed: {reason}")
    logger.info("operation %s resumed by an operator", op.key)
    return op


# --- settle a step by hand -------------------------------------------------------


def mark_step_succeeded(
    operation: Operation | int,
    step: str,
    *,
    reference: str,
    user: AbstractBaseUser,
    reason: str,
) -> StepClaim:
    """Record an unsettled step as done with the provider's reference, then resume.

    The reference is checked with the provider first: the charge must exist,
    be succeeded, carry this operation's key (and step) in its metadata and
    the claim's amount and currency. A reference that another claim already
    carries is refused: one charge pays for one step.
    """
    require_permission(user, RECONCILE_PERMISSION)
    reason = required_reason(reason)
    reference = (reference or "").strip()
    actor = actor_of(user)
    op = Operation.objects.get(pk=_pk(operation))
    if not reference:
        raise DeskError("the provider reference is required", operation_key=op.key)
    spec = get_handler(op.kind)
    claim = settleable_claim(op, list(op.claims.all()), step, spec)
    if claim.provider_reference and claim.provider_reference != reference:
        raise DeskError(
            f"step {step} already carries reference {claim.provider_reference}, not {reference}",
            operation_key=op.key,
        )
    check_reference_unused(op, claim, reference)
    with exchanges.collected() as sent:  # the check's requests: the decision's audit row
        intent = verified_success(op, claim, spec, reference)
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        row = _unchanged_claim_in_tx(claim)
        settleable_claim(locked, _locked_claims_in_tx(locked), step, spec)
        check_reference_unused(locked, row, reference)
        if locked.state == OperationState.FAILED:
            _reopen_entity_in_tx(locked)
        row = _taken_by_operator_in_tx(row, actor, f"to mark it succeeded: {reason}")
        settled = fence.settle_claim(
            row,
            ClaimState.DONE,
            actor=actor,
            reason=f"marked succeeded ({reference}): {reason}",
            reference=reference,
            result={"reference": reference, **intent, "settled_by": actor},
            requests=sent,
        )
        _resume_in_tx(
            locked, actor=actor, reason=f"step {step} marked succeeded; resuming: {reason}"
        )
    logger.info("operation %s step %s marked succeeded by an operator", op.key, step)
    return settled


def _refuse_while_in_flight(claim: StepClaim, step: str) -> None:
    """Refuse to fail a step while the provider still executes a request under its key:
    that request may yet take the money (or give it back) whatever is read now."""
    since = (
        ClaimLook.objects.filter(claim_id=claim.pk)
        .values_list("in_flight_since", flat=True)
        .first()
    )
    if since is not None:
        raise DeskError(
            f"a request under step {step}'s key is still in flight at {system_label(claim)} "
            f"(since {since:%Y-%m-%d %H:%M:%S} UTC): it may still succeed; the fence settles it "
            f"when {system_label(claim)} answers. Nothing was marked failed",
            action="mark_failed",
        )


@dataclass(frozen=True)
class MarkedFailed:
    """What `mark_step_failed` did. `found_succeeded`: the provider showed the step
    succeeded, so it was recorded done instead (and the operation resumes), `detail`
    saying so; else the step was marked failed as asked (or the provider's own refusal
    failed it). Either way the action is over and audited: an outcome, not an error."""

    claim: StepClaim
    found_succeeded: bool = False
    detail: str = ""


def mark_step_failed(
    operation: Operation | int, step: str, *, user: AbstractBaseUser, reason: str
) -> MarkedFailed:
    """Record an unsettled step as failed and fail the operation (its failure hook runs).

    A step marked failed must not have charged, or the charge would stand
    outside the fence, and a new attempt would charge the order again. So the
    provider decides, by reads that cannot lag, and is made to keep to it:
    - while the provider keeps the step's idempotency key (and no worker may
      run the operation), the request is replayed with that same key: the
      provider answers what it did (and a request that never reached it runs
      now, as the operation intended). A success settles the step done and the
      operation resumes: the outcome says so (`found_succeeded`);
    - then the operator takes the claim and the step's effect voids it
      (`void`): an intent is cancelled at the provider, so that it can never
      be charged; one that succeeded refuses the cancel, and the step is
      recorded done instead (the operation resumes, nothing is marked failed:
      `found_succeeded` again);
    - without an object at the provider (the consistent list by creation
      window is empty), "not found" counts only once RECONCILE_GRACE has
      passed since the last request sent under the key, whoever sent it.
    """
    require_permission(user, RECONCILE_PERMISSION)
    reason = required_reason(reason)
    actor = actor_of(user)
    op = Operation.objects.get(pk=_pk(operation))
    spec = get_handler(op.kind)
    claim = settleable_claim(op, list(op.claims.all()), step, spec)
    _refuse_while_in_flight(claim, step)
    asked_before = fence.last_request_at(claim)  # a later one: this press's own replay
    if op.state not in WORKER_STATES and not claim.provider_reference and replay_allowed(claim):
        recovery.reconcile(actor=actor, operation_ids=[op.pk])
        claim.refresh_from_db()
        _refuse_while_in_flight(claim, step)
        if claim.state == ClaimState.DONE:
            return MarkedFailed(
                claim,
                found_succeeded=True,
                detail=f"{system_label(claim)} shows step {step} succeeded "
                f"({claim.provider_reference}): "
                "it is recorded as done and the operation resumes; nothing was marked failed",
            )
        if claim.state == ClaimState.FAILED:
            logger.info("operation %s step %s: the provider refused it", op.key, step)
            return MarkedFailed(claim)  # the provider's own refusal failed the operation
        op.refresh_from_db()
        claim = settleable_claim(op, list(op.claims.all()), step, spec)
    # The operator owns the claim while the provider is asked and told: no worker,
    # reconciler or event settles it meanwhile (they find it leased).
    claim = _taken_by_operator(claim, actor, f"to mark it failed: {reason}")
    # What the provider was asked (replays, a cancel, lookups): on the row written next.
    sent: list[dict[str, Any]] = []
    try:
        with exchanges.collected() as sent:
            now = spec.effect(step, op).void(view_of(claim))
    except StillInProgress as exc:
        fence.release_claim(
            claim, actor=actor, reason="mark failed refused: still in progress", requests=sent
        )
        raise DeskError(
            f"step {step} is still in progress at {system_label(claim)} ({exc}): it may still "
            "succeed, so it cannot be marked failed now; nothing was changed",
            operation_key=op.key,
        ) from exc
    except Exception as exc:  # provider down: nothing is decided on a guess
        fence.release_claim(
            claim,
            actor=actor,
            reason=f"mark failed refused: {type(exc).__name__}",
            requests=sent,
        )
        raise DeskError(
            f"could not check step {step} with {system_label(claim)} ({type(exc).__name__}); "
            "nothing was changed",
            operation_key=op.key,
        ) from exc
    system = claim_system(claim)
    if now is not None or system.reads:  # a system without reads showed nothing: none noted
        fence.note_provider_view(
            claim, now, source=f"mark failed by {actor}", actor=actor, requests=sent
        )
    if now is not None and now.outcome == Outcome.SUCCESS:
        _settle_done_and_resume(op, claim, spec, now, actor=actor, reason=reason, requests=sent)
        claim.refresh_from_db()
        return MarkedFailed(
            claim,
            found_succeeded=True,
            detail=f"{system_label(claim)} shows step {step} succeeded ({now.reference}) and "
            "refused to cancel it: it is recorded as done and the operation resumes; nothing "
            "was marked failed",
        )
    if now is None and not past_grace(claim):
        fence.release_claim(
            claim, actor=actor, reason="mark failed refused: within the grace", requests=sent
        )
        grace = payments_settings().reconcile_grace // 60
        last = fence.last_request_at(claim)
        who = system_label(claim)
        if last > asked_before:  # pressing again would replay again, and wait again
            raise DeskError(
                f"step {step} is not found at {who}, but this check replayed the request "
                f"under its key at {last:%Y-%m-%d %H:%M:%S %Z} and got no decisive answer "
                f"({claim.error or 'none'}): that replay may still be executed, so not found "
                f"counts only {grace} min after it, and pressing again replays it again. It "
                f"settles once {who} answers a replay (succeeded or refused); or it can be "
                f"marked failed {grace} min after the last request once its key is no longer "
                f"replayed ({when(replay_deadline(claim))}); nothing was changed",
                operation_key=op.key,
            )
        raise DeskError(
            f"step {step} is not found at {who}, but a request under its key was sent "
            f"at {last:%Y-%m-%d %H:%M:%S %Z}, less than {grace} min ago: it may still be "
            "executed. Try again after the grace period; nothing was changed",
            operation_key=op.key,
        )
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        check_no_live_lease(locked)  # a worker may have leased it while the provider was asked
        row = _unchanged_claim_in_tx(claim)
        settled = fence.settle_claim(
            row,
            ClaimState.FAILED,
            actor=actor,
            reason=f"marked failed ({_voided(now, system)}): {reason}",
            reference=now.reference if now is not None else None,
            result=now.as_result() if now is not None else _unseen(system),
            error=f"marked failed by {actor} ({_voided(now, system)}): {reason}",
            requests=sent,
        )
        if locked.state != OperationState.FAILED:
            fence.release_in_tx(
                locked,
                OperationState.FAILED,
                actor=actor,
                reason=f"step {step} marked failed ({_voided(now, system)}): {reason}",
                last_error=f"step {step} marked failed by {actor} ({_voided(now, system)})",
            )
            if spec.on_failure is not None:
                spec.on_failure(locked)
    logger.info("operation %s step %s marked failed by an operator", op.key, step)
    return MarkedFailed(settled)


def _unseen(system: ExternalSystem) -> dict[str, str]:
    """The result of a step marked failed with nothing seen at its system: "not found" by a
    consistent read, or (a system without reads) the operator's reading of its report."""
    if system.reads:
        return {"status": "not_found"}
    return {
        "status": "marked_failed",
        "evidence": f"the operator's reading of {system.label}'s report",
    }


def _voided(now: EffectResult | None, system: ExternalSystem) -> str:
    """What the system showed when a step was marked failed, in a few words."""
    if now is None and not system.reads:
        return f"{system.label} offers no look-up: the operator's reading of its report"
    if now is None:
        return f"not at {system.label}, past the grace since the last request"
    status = str(now.data.get("status") or now.outcome)
    return f"{now.reference} {status} at {system.label}".strip()


def _settle_done_and_resume(
    op: Operation,
    claim: StepClaim,
    spec: HandlerSpec,
    found: EffectResult,
    *,
    actor: str,
    reason: str,
    requests: list[dict[str, Any]],
) -> None:
    """Record the operator-held claim done with what the provider showed (its `requests`
    on the audit row); resume the operation."""
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        check_no_live_lease(locked)
        row = _unchanged_claim_in_tx(claim)
        if locked.state == OperationState.FAILED:
            _reopen_entity_in_tx(locked)
        fence.settle_claim(
            row,
            ClaimState.DONE,
            actor=actor,
            reason=f"the provider shows {found.reference} succeeded: {reason}",
            reference=found.reference,
            result=found.as_result(),
            requests=requests,
        )
        _resume_in_tx(
            locked, actor=actor, reason=f"step {claim.step} succeeded at the provider; resuming"
        )


# --- a new attempt, with a new key -----------------------------------------------


def start_new_attempt(
    operation: Operation | int,
    *,
    user: AbstractBaseUser,
    reason: str,
    payment_method: str | None = None,
    charge_declined_again: bool = False,
) -> Operation:
    """Start a NEW operation for the same intent with a new derived key, linked by retry_of.

    The handler writes it (`desk.new_attempt`: for a checkout, another charge,
    optionally with another payment method; for a refund, the same refund).
    Its key is named after the first attempt's (`next_attempt_key`). After the
    provider declined the payment method, a method must be given, and the
    declined one is taken only with `charge_declined_again` (the customer says
    it will work now): a blank would charge the declined card again.

    A new key may charge again, so it is only allowed when the old operation
    failed and no external step of it may have charged: every external claim
    failed or absent (none uncertain, claimed or done), no new attempt exists
    yet, and the order is open for checkout again (payment failed).
    """
    require_permission(user, RECONCILE_PERMISSION)
    require_permission(user, NEW_ATTEMPT_PERMISSION)
    reason = required_reason(reason)
    actor = actor_of(user)
    _check_earlier_attempts_failed_at_provider(Operation.objects.get(pk=_pk(operation)), actor)
    with transaction.atomic():
        op = fence.locked_operation_in_tx(_pk(operation))
        spec = get_handler(op.kind)
        claims = _locked_claims_in_tx(op)
        check_new_attempt(op, claims, spec)
        check_payment_method(
            op, claims, spec, payment_method, charge_declined_again=charge_declined_again
        )
        new_key = next_attempt_key(op)
        new_attempt = spec.desk.new_attempt if spec.desk is not None else None
        if new_attempt is None:  # check_new_attempt refused it already; say so again
            raise DeskError(f"{op.kind} operations declare no new attempt", operation_key=op.key)
        options = {"payment_method": payment_method} if payment_method else {}
        try:
            new, created = new_attempt(op, new_key, actor, options)
        except InvalidTransition as exc:  # the business refused (order not open, limit)
            raise DeskError(str(exc), operation_key=op.key, action="new_attempt") from exc
        if not created:
            raise DeskError(f"key {new_key} is already used", operation_key=op.key)
        fence.record_event_in_tx(
            new, to_state=new.state, actor=actor, reason=f"new attempt of {op.key}: {reason}"
        )
        fence.record_event_in_tx(
            op,
            from_state=op.state,
            to_state=op.state,
            actor=actor,
            reason=f"new attempt {new.key} started: {reason}",
        )
    logger.info("operation %s: new attempt %s started by an operator", op.key, new.key)
    return new


def _check_earlier_attempts_failed_at_provider(op: Operation, actor: str) -> None:
    """Refuse a new key while the provider shows a success for any earlier attempt of the entity.

    A claim settled failed *by the provider* (a decline, with its reference)
    is evidence; one failed without a provider answer (given up after refusals,
    or marked failed by a person) is asked again, by reference or a consistent
    list, before a new key may charge the same order.
    """
    spec = get_handler(op.kind)
    earlier = StepClaim.objects.filter(
        operation__kind=op.kind,
        operation__entity_type=op.entity_type,
        operation__entity_id=op.entity_id,
        step__in=list(spec.effects),
        state=ClaimState.FAILED,
        provider_reference="",
    ).select_related("operation")
    for claim in earlier:
        try:
            with exchanges.collected() as sent:
                found = spec.effect(claim.step, claim.operation).find(view_of(claim))
        except Exception as exc:  # provider down: no new key on a guess
            raise DeskError(
                f"could not check the earlier attempt {claim.operation.key} with the provider "
                f"({type(exc).__name__}); no new attempt was started",
                operation_key=op.key,
                action="new_attempt",
            ) from exc
        fence.note_provider_view(
            claim, found, source=f"new attempt check by {actor}", actor=actor, requests=sent
        )
        if found is not None and found.outcome == Outcome.SUCCESS:
            alerts.error(
                "operation %s step %s was settled failed but the provider shows %s succeeded",
                claim.operation.key,
                claim.step,
                found.reference,
            )
            raise DeskError(
                f"the provider shows the earlier attempt {claim.operation.key} succeeded "
                f"({found.reference}) although it is recorded failed: a new key would charge "
                "twice. It needs review",
                operation_key=op.key,
                action="new_attempt",
            )


# --- helpers that run inside the caller's transaction ----------------------------


def _reopen_entity_in_tx(op: Operation) -> None:
    """Run a failed operation's entity back to where it runs again. In the caller's transaction.

    The handler's `desk.lock_entity` serialises with the API's requests (for a
    checkout: no second checkout can start while this one runs again), then
    its `refuse_rerun` decides and its `on_resume` undoes what on_failure did.
    """
    spec = get_handler(op.kind)
    if spec.desk is not None:
        spec.desk.lock_entity(op)
    check_entity_reopenable(op)
    if spec.on_resume is not None:
        spec.on_resume(op)


def _taken_by_operator(claim: StepClaim, actor: str, why: str) -> StepClaim:
    """Make the operator the claim's owner in a transaction of its own; refuse if it is held."""
    with transaction.atomic():
        check_no_live_lease(fence.locked_operation_in_tx(claim.operation_id))
        return _taken_by_operator_in_tx(claim, actor, why)


def _taken_by_operator_in_tx(row: StepClaim, actor: str, why: str) -> StepClaim:
    """Make the operator the claim's owner, so that only they settle it (in the caller's tx)."""
    lease = payments_settings().claim_lease
    taken = fence.take_over_claim(row, owner=actor, lease_seconds=lease, why=why)
    if taken is None:  # settleable_claim refused live claims under the same lock
        raise DeskError(f"a worker holds step {row.step} now", operation_key=row.operation.key)
    return taken


def _locked_claims_in_tx(op: Operation) -> list[StepClaim]:
    """Return the operation's claims locked FOR UPDATE. Runs inside the caller's transaction."""
    return list(StepClaim.objects.select_for_update().filter(operation=op).order_by("pk"))


def _unchanged_claim_in_tx(claim: StepClaim) -> StepClaim:
    """Lock the claim and refuse if it changed since the provider was asked (in the caller's tx)."""
    row = StepClaim.objects.select_for_update().select_related("operation").get(pk=claim.pk)
    if (row.state, row.provider_reference, row.updated_at) != (
        claim.state,
        claim.provider_reference,
        claim.updated_at,
    ):
        raise DeskError(
            f"step {row.step} changed while the provider was asked (now {row.state}); look again",
            operation_key=row.operation.key,
        )
    return row


# --- small helpers ---------------------------------------------------------------


def require_permission(user: AbstractBaseUser, permission: str) -> None:
    """Raise PermissionDenied naming `permission` unless an active staff user holds it."""
    staff = user.is_active and getattr(user, "is_staff", False)
    if not (staff and isinstance(user, PermissionsMixin) and user.has_perm(permission)):
        raise PermissionDenied(f"{permission} is required")


def required_reason(reason: str) -> str:
    """Return the reason stripped (at most 1,000 characters); raise ReasonRequired if blank."""
    cleaned = (reason or "").strip()
    if not cleaned:
        raise ReasonRequired("a reason is required for this decision")
    return cleaned[:1000]


def _pk(operation: Operation | int) -> int:
    return operation.pk if isinstance(operation, Operation) else int(operation)
