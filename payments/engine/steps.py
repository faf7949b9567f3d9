"""The external-step protocol: claim, call with the stored key, record; reconcile when unsure.

    claim   INSERT step_claim ... ; COMMIT          (fence.claim_step)
    call    effect.perform(request, idempotency_key)
    record  UPDATE step_claim SET done, reference   (fence.settle_claim)

Used by the runtime for a running handler and by recovery for a claim left
uncertain. No transaction is held open across a call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from rq.timeouts import BaseTimeoutException

from payments.conf import payments_settings
from payments.engine import exchanges, fence, systems, telemetry
from payments.engine.effects import ClaimView, EffectResult, ExternalEffect, StillInProgress
from payments.engine.failpoints import AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, failpoint
from payments.engine.outcomes import Outcome
from payments.engine.systems import ExternalSystem, system_of
from payments.exceptions import (
    ConfigurationError,
    StepBusy,
    StepConflict,
    StepNeedsReview,
    StepRefused,
    StepTransient,
    StepUncertain,
)
from payments.models import ClaimState, LookShowed, Operation, StepClaim

if TYPE_CHECKING:
    from payments.engine.unit import WorkUnit

logger = logging.getLogger("payments.engine.steps")
alerts = logging.getLogger("payments.alerts")


def view_of(claim: StepClaim) -> ClaimView:
    """Return what an effect may know of `claim`."""
    return ClaimView(
        operation_key=claim.operation.key,
        step=claim.step,
        idempotency_key=claim.idempotency_key,
        reference=claim.provider_reference,
        request=claim.request or {},
        first_request_at=claim.claimed_at,
        last_request_at=fence.last_request_at(claim),
    )


def claim_system(claim: StepClaim) -> ExternalSystem:
    """The external system the claim's step calls: the one its effect named when the claim
    was made, else (a claim older than the column) its handler's effect's: the class's
    `system_for(operation)` when it serves several systems (a shop paying through one of
    two providers), else its SYSTEM."""
    found = step_system(claim.system, claim.operation.kind, claim.step, claim.operation)
    if found is None:
        raise ConfigurationError(f"no handler is registered for {claim.operation.kind!r}")
    return found


def claim_system_named(name: str, kind: str, step: str) -> ExternalSystem | None:
    """`claim_system` from a claim's columns (its system, its operation's kind, its step),
    for a count that reads no operation; None for a system or a kind no longer known (a
    removed package's leftovers)."""
    try:
        return step_system(name, kind, step, None)
    except ConfigurationError:
        return None


def step_system(
    name: str, kind: str, step: str, operation: Operation | None
) -> ExternalSystem | None:
    """The one rule of both: the claim's recorded system, else its step's effect's (its
    `system_for(operation)` when the operation is at hand), None for an unknown kind."""
    if name:
        return systems.system_named(name)
    from payments.engine.handlers import registered_handlers  # handlers import this module

    spec = registered_handlers().get(kind)
    if spec is None:
        return None
    effect = spec.effects.get(step)
    system_for = getattr(effect, "system_for", None)
    if system_for is not None and operation is not None:
        return systems.system_named(system_for(operation))
    return system_of(effect)


def replay_deadline(claim: StepClaim) -> datetime:
    """The uncertainty clock: the last moment a same-key replay of the claim is safe.

    Its key's first use plus its system's key retention, less a margin
    (payments.engine.systems): past it the system may have forgotten the key
    and would execute the request again.
    """
    return systems.replay_deadline(claim_system(claim), claim.claimed_at)


def replay_allowed(claim: StepClaim) -> bool:
    """Tell whether the claim's system still keeps its key (a replay cannot act anew)."""
    return bool(fence.db_now() < replay_deadline(claim))


def _past(moment: Any) -> bool:
    """Tell whether RECONCILE_GRACE has passed since `moment` (the database's clock)."""
    grace = timedelta(seconds=payments_settings().reconcile_grace)
    return bool(fence.db_now() - moment > grace)


def past_grace(claim: StepClaim) -> bool:
    """Tell whether RECONCILE_GRACE has passed since the last request under the claim's key.

    Counted from the last request sent (by a worker, the reconciler or the
    desk), not from the claim: a same-key replay can execute a request that
    never reached the provider, and what it did is not seen at once.
    """
    grace = timedelta(seconds=payments_settings().reconcile_grace)
    return fence.db_now() - fence.last_request_at(claim) > grace


@telemetry.traced("external")
def run_external_step(
    operation: Operation,
    step: str,
    effect: ExternalEffect,
    *,
    owner: str,
    outcomes: WorkUnit | None = None,
    build: bool = True,
    claimed_with_lease: StepClaim | None = None,
) -> dict[str, Any]:
    """Run one external step under its claim and return its recorded result.

    Without `build` the claim is known to exist: its stored request is the one
    sent, and the effect's request is not built again. `claimed_with_lease`: the
    step's claim, inserted and committed with this run's lease
    (fence.acquire_lease's `first_claim`): nothing is claimed here.

    With `outcomes` (a handler's run), a first call's success is recorded in
    that open transaction (`WorkUnit.record_outcome`), not in one of its own.
    Raises StepBusy when another worker holds the claim, and a StepError
    subclass when the step did not complete.
    """
    lease = payments_settings().claim_lease
    if claimed_with_lease is not None:
        return call_effect(claimed_with_lease, effect, actor=owner, outcomes=outcomes, first=True)
    claimed = fence.claim_step(
        operation,
        step,
        owner=owner,
        lease_seconds=lease,
        request=effect.build_request() if build else {},
        system=system_of(effect).name,
    )
    claim = claimed.claim
    if claimed.created:
        return call_effect(claim, effect, actor=owner, outcomes=outcomes, first=True)
    if claim.state == ClaimState.DONE:
        telemetry.note(outcome=telemetry.SKIPPED, transaction=telemetry.NONE)
        logger.info("step %s/%s already done; replaying its result", operation.key, step)
        return claim.result or {}
    if claim.state == ClaimState.FAILED:
        telemetry.note(transaction=telemetry.NONE)
        raise StepRefused("refused earlier", operation_key=operation.key, step=step)
    taken = fence.take_over_claim(claim, owner=owner, lease_seconds=lease)
    if taken is None:
        raise StepBusy(operation_key=operation.key, step=step, until=claim.lease_expires_at)
    if taken.state == ClaimState.FAILED:
        raise StepRefused("refused earlier", operation_key=operation.key, step=step)
    if taken.state == ClaimState.DONE:
        telemetry.note(outcome=telemetry.SKIPPED, transaction=telemetry.NONE)
        return taken.result or {}
    # Released after a transient failure, or left behind by a dead worker, or
    # uncertain: settle it without ever using a new key.
    return reconcile_step(taken, effect, actor=owner)


@telemetry.traced("external")
def reconcile_step(
    claim: StepClaim,
    effect: ExternalEffect,
    *,
    actor: str,
    allow_replay: bool = True,
    looking: bool = False,
) -> dict[str, Any]:
    """Settle a claim whose outcome is unknown: reference, else same-key replay, else a list.

    A replay may execute a call that never reached the provider, so it is only
    allowed while the operation still wants the effect (not once it failed).

    `looking` (the reconciler, the desk's query): a replay the provider could not
    answer (its key still in flight there: `409 ..._in_use`; a timeout; a 5xx) is
    evidence, counted on the claim without an audit row, and the consistent list
    is read all the same. A worker (not looking) reads the list only when the key
    is in flight (a success there settles the step) and otherwise retries later.
    """
    if claim.provider_reference or not allow_replay or not replay_allowed(claim):
        return _settle_from_lookup(claim, effect, actor=actor)
    try:
        result = call_effect(claim, effect, actor=actor, quiet=looking)
    except StepUncertain:
        # The provider replayed a stored error, or the replay's answer was lost
        # too: only a lookup can tell more now.
        claim.refresh_from_db()
        return _settle_from_lookup(claim, effect, actor=actor)
    except StepTransient as exc:
        if not (looking or exc.in_flight):
            raise
        # A request in flight decides its own outcome: until it ends (or the grace after
        # it began has passed), only a success read elsewhere settles the claim.
        since = fence.in_flight_since(claim) if exc.in_flight else None
        waiting = exc.in_flight and (since is None or not _past(since))
        claim.refresh_from_db()
        replay = (exc.in_flight, f"same-key replay: {exc}")
        if looking:
            return _settle_from_lookup(claim, effect, actor=actor, in_flight=waiting, replay=replay)
        # A worker: the list may show what the request in flight did (a success settles the
        # step now, the evidence is kept either way); else it retries later, as before.
        try:
            return _settle_from_lookup(claim, effect, actor=actor, in_flight=True, replay=replay)
        except (StepUncertain, StepTransient):
            raise exc from None
    # What the provider answered to the same-key replay, for the desk's "at the provider".
    shown = {k: v for k, v in result.items() if k != "reference"}
    fence.note_provider_view(
        claim,
        EffectResult(Outcome.SUCCESS, reference=str(result.get("reference", "")), data=shown),
        source="same-key replay",
        actor=actor,
    )
    return result


@telemetry.traced("external", call=True)
@exchanges.recorded
def call_effect(
    claim: StepClaim,
    effect: ExternalEffect,
    *,
    actor: str,
    outcomes: WorkUnit | None = None,
    first: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Call the provider with the claim's stored request and key; record what came back
    (a success in `outcomes`, when given: see run_external_step).

    A `first` call's time is the claim's own; any later one is recorded first
    (fence.note_request_sent), since the grace before "not found" counts from it.
    `quiet` (a look by the reconciler or the desk): an answer that changes nothing
    (the claim stays as it was) writes no audit row; the caller counts the look.
    """
    op_key, step = claim.operation.key, claim.step
    sent_before = claim.last_request_at
    if not first:
        fence.note_request_sent(claim, actor=actor)
    failpoint(AFTER_CLAIM_COMMIT, step)
    try:
        answer = effect.perform(claim.request or {}, claim.idempotency_key)
    except BaseTimeoutException as exc:
        # The job's own time is up mid-call: the call may have run. Record that
        # and stop here (no lookup), so the job ends inside its lease.
        fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=actor, error=type(exc).__name__)
        raise
    except Exception as exc:  # classified below; an unclassified error may follow a send
        outcome = getattr(exc, "outcome", Outcome.UNCERTAIN)
        code = str(getattr(exc, "code", "") or "")
        # The provider's request id, when it answered: what its support asks for first.
        request_id = getattr(exc, "request_id", None)
        reason = f"{type(exc).__name__}: {exc}" + (f" [request {request_id}]" if request_id else "")
        reason = reason[:500]
        if outcome == Outcome.TRANSIENT:
            # Nothing was executed: the grace still counts from the request sent before.
            unsent: dict[str, Any] = {} if first else {"last_request_at": sent_before}
            fence.release_claim(claim, actor=actor, reason=reason, audited=not quiet, **unsent)
            error = StepTransient(reason, operation_key=op_key, step=step, provider_code=code)
            error.in_flight = bool(getattr(exc, "in_flight", False))
            raise error from exc
        if outcome == Outcome.CONFLICT:
            fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=actor, error=reason)
            # A look would replay the same request into the same refusal: a person decides.
            fence.hold_looks(claim, fence.CONFLICT_HOLD)
            raise StepConflict(reason, operation_key=op_key, step=step, provider_code=code) from exc
        if outcome == Outcome.PERMANENT:
            fence.settle_claim(claim, ClaimState.FAILED, actor=actor, error=reason)
            raise StepRefused(reason, operation_key=op_key, step=step, provider_code=code) from exc
        # An object still in progress (a pending refund) names itself: keep its reference.
        reference = str(getattr(exc, "reference", "") or "") or None
        if reference is not None and not quiet:
            # The system accepted a worker's request and answered an object in progress
            # (Adyen's received refund): killed here, that answer is lost as after any accept.
            failpoint(AFTER_PROVIDER_ACCEPT, step)
        if quiet and claim.state == ClaimState.UNCERTAIN and reference is None:
            fence.release_claim(claim, actor=actor, reason=reason, audited=False)
        else:
            fence.settle_claim(
                claim, ClaimState.UNCERTAIN, actor=actor, error=reason, reference=reference
            )
        raise StepUncertain(reason, operation_key=op_key, step=step, provider_code=code) from exc
    failpoint(AFTER_PROVIDER_ACCEPT, step)
    return _record(claim, answer, actor=actor, outcomes=outcomes)


def _record(
    claim: StepClaim, answer: EffectResult, *, actor: str, outcomes: WorkUnit | None = None
) -> dict[str, Any]:
    result = answer.as_result()
    telemetry.note(reference=answer.reference)
    if answer.outcome == Outcome.SUCCESS:
        if outcomes is not None:  # a first call's answer, in the handler's transaction
            outcomes.record_outcome(
                claim, ClaimState.DONE, actor=actor, reference=answer.reference, result=result
            )
            return result
        # Settled after a lost answer (a replay, a read): the trail names what decided it.
        fence.settle_claim(
            claim,
            ClaimState.DONE,
            actor=actor,
            reference=answer.reference,
            result=result,
            reason=f"the provider shows {answer.reference} succeeded",
        )
        return result
    code = str(answer.data.get("code", ""))
    fence.settle_claim(
        claim,
        ClaimState.FAILED,
        actor=actor,
        reference=answer.reference,
        result=result,
        error=f"refused: {code}",
    )
    raise StepRefused(
        f"refused: {code}", operation_key=claim.operation.key, step=claim.step, provider_code=code
    )


@exchanges.recorded
def _settle_from_lookup(
    claim: StepClaim,
    effect: ExternalEffect,
    *,
    actor: str,
    in_flight: bool = False,
    replay: tuple[bool, str] | None = None,
) -> dict[str, Any]:
    """Settle the claim by a consistent read, or raise what stops it (StepUncertain, ...).

    `in_flight`: a request under the claim's key is still being executed at the
    provider; what the read shows may still change, so only a success (final)
    settles the claim, and nothing it shows goes to review meanwhile. `replay`:
    what a same-key replay just before was answered (in flight?, its words),
    counted with this read as one look.
    """
    op_key, step = claim.operation.key, claim.step

    def look(showed: LookShowed, detail: str) -> None:
        held = replay is not None and replay[0]
        if held and showed == LookShowed.UNREADABLE:
            showed = LookShowed.IN_FLIGHT  # it answered the replay: reachable, busy
        words = "; ".join(part for part in (replay[1] if replay else "", detail) if part)
        fence.note_look(
            claim,
            showed,
            actor=actor,
            source="replay and list" if replay else "consistent read",
            detail=words,
            in_flight=None if replay is None else held,
        )

    system = claim_system(claim)
    if not system.reads:
        # Nothing to read at the system; what its events told may be kept on our side (a
        # notification stored while a worker held the claim): the effect's find says so.
        try:
            known = effect.find(view_of(claim))
        except Exception:  # in progress, or what it keeps could not be read: nothing known
            logger.info("step %s/%s: its effect's find told nothing", claim.operation.key, step)
            known = None
        if known is None:
            return _without_reads(
                claim, system, actor=actor, replayed=replay is not None, look=look
            )
    try:
        found = known if not system.reads else effect.find(view_of(claim))
    except StillInProgress as exc:  # there, neither done nor refused: never "not found"
        telemetry.note(transaction=telemetry.NONE)
        reason = f"still in progress at the provider ({exc})"[:500]
        shown = exc.shown()
        if shown is not None:  # the object it showed, pending: the desk shows it
            fence.note_provider_view(claim, shown, source="reconciler", actor=actor)
        look(LookShowed.IN_PROGRESS, str(exc))
        if claim.state != ClaimState.UNCERTAIN or (exc.reference and not claim.provider_reference):
            fence.settle_claim(
                claim,
                ClaimState.UNCERTAIN,
                actor=actor,
                error=reason,
                reference=exc.reference or None,
            )
        if past_grace(claim) and not in_flight:
            raise StepNeedsReview(
                f"{reason}, past the grace period", operation_key=op_key, step=step
            ) from exc
        raise StepUncertain(reason, operation_key=op_key, step=step) from exc
    except Exception as exc:  # provider down while reconciling: stay as we are, until the grace
        telemetry.note(transaction=telemetry.NONE)
        reason = f"lookup failed: {type(exc).__name__}"
        look(LookShowed.UNREADABLE, f"read: {type(exc).__name__}: {exc}")
        if past_grace(claim) and not in_flight:
            # Unknown for longer than the grace period, whatever the reason: a person decides.
            if claim.state != ClaimState.UNCERTAIN:
                fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=actor, error=reason)
            raise StepNeedsReview(
                f"{reason}; outcome unknown past the grace period",
                operation_key=op_key,
                step=step,
            ) from exc
        raise StepTransient(reason, operation_key=op_key, step=step) from exc
    fence.note_provider_view(claim, found, source="reconciler", actor=actor)
    if found is None:
        look(LookShowed.NOT_FOUND, "not in the consistent list")
    else:
        look(LookShowed.OBJECT, f"{found.reference} {found.data.get('status', '')}".strip())
    if found is not None:
        # One provider success settles one step; a refusal may name an object an earlier
        # step succeeded with (a capture refused on the authorisation's cancelled intent).
        other = fence.claim_carrying(found.reference, besides=claim) if found.succeeded else None
        if other is not None:  # one provider object settles one step: never record it twice
            fence.hold_looks(claim, f"the provider's {found.reference} already settles {other}")
            alerts.error(
                "lookup for %s/%s found %s, which already settles %s",
                op_key,
                step,
                found.reference,
                other,
            )
            raise StepNeedsReview(
                f"the provider's {found.reference} already settles {other}",
                operation_key=op_key,
                step=step,
            )
        if in_flight and not found.succeeded:
            # What the request in flight may still change: its own answer will tell.
            _still_uncertain(claim, actor, "a request under its key is still in flight")
            raise StepUncertain(
                f"the provider shows {found.reference} {found.data.get('status', 'refused')} "
                "while a request under its key is still in flight",
                operation_key=op_key,
                step=step,
            )
        return _record(claim, found, actor=actor)
    if in_flight:
        _still_uncertain(claim, actor, "a request under its key is still in flight")
        raise StepUncertain(
            "not found at the provider while a request under its key is still in flight",
            operation_key=op_key,
            step=step,
        )
    if past_grace(claim):
        if claim.state != ClaimState.UNCERTAIN:
            fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=actor, error="not found")
        raise StepNeedsReview(
            "not found at the provider (consistent list) a grace period after the last request "
            "under its key",
            operation_key=op_key,
            step=step,
        )
    _still_uncertain(
        claim, actor, "not found yet (a request under its key was sent within the grace period)"
    )
    raise StepUncertain("not found at the provider yet", operation_key=op_key, step=step)


def _without_reads(
    claim: StepClaim,
    system: ExternalSystem,
    *,
    actor: str,
    replayed: bool,
    look: Callable[[LookShowed, str], None],
) -> NoReturn:
    """Keep a claim on a system that offers no read uncertain while a replay may still tell.

    Nothing can be read (Adyen's Checkout API has no look-up): a same-key replay
    within the key's retention, the system's event, or a person with its report
    settles the step. The grace period does not apply (no list can show the object
    later); the replay deadline does: past it no replay is safe, and a person
    decides, with the evidence and the deadline it missed.
    """
    op_key, step = claim.operation.key, claim.step
    deadline = replay_deadline(claim)
    look(
        LookShowed.UNREADABLE if replayed else LookShowed.NO_READ,
        f"{system.label} offers no look-up",
    )
    _still_uncertain(claim, actor, f"{system.label} offers no look-up")
    if fence.db_now() >= deadline:
        fence.hold_looks(
            claim,
            f"{system.label} offers no look-up and its replay window ended at "
            f"{deadline.isoformat(timespec='seconds')}: a replay could act again",
        )
        raise StepNeedsReview(
            f"{system.label} offers no look-up and the key's replay window ended at "
            f"{deadline.isoformat(timespec='seconds')}; settle it from {system.label}'s report",
            operation_key=op_key,
            step=step,
        )
    raise StepUncertain(
        f"{system.label} offers no look-up: a same-key replay until "
        f"{deadline.isoformat(timespec='seconds')}, or its event, settles it",
        operation_key=op_key,
        step=step,
    )


def _still_uncertain(claim: StepClaim, actor: str, error: str) -> None:
    """Make the claim uncertain, audited, unless it is already (then nothing is written)."""
    if claim.state != ClaimState.UNCERTAIN:
        fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=actor, error=error)
