"""The fence core: operations, step claims and their audit trail.

It knows no HTTP, no business step, no admin screen and no view: handlers, the
admin desk, the API and the recovery code call into it. Functions whose name
ends in `_in_tx` (or whose docstring says so) run inside the caller's
transaction; the others own theirs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now

from payments.conf import payments_settings
from payments.engine import transitions
from payments.engine.effects import EffectResult
from payments.engine.failpoints import BEFORE_RECORD_COMMIT, failpoint
from payments.engine.writes import fence_writer
from payments.exceptions import InvalidTransition, NotClaimOwner, OperationConflict
from payments.models import (
    RUNNABLE_OPERATION_STATES,
    ApiClient,
    ClaimState,
    KeyScope,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)

logger = logging.getLogger("payments.engine.fence")

# --- keys and fingerprints -----------------------------------------------------


def fingerprint(kind: str, entity_type: str, entity_id: str, params: dict[str, Any]) -> str:
    """Hash what makes two requests the same intent (kind, entity, parameters)."""
    canonical = json.dumps(
        {"kind": kind, "entity": [entity_type, str(entity_id)], "params": params},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def derive_idempotency_key(operation_key: str, step: str, scope: str = KeyScope.CLIENT) -> str:
    """Derive the provider idempotency key of a step: stable, bounded, no attempt number.

    A derived operation's scope goes into the hash, so that a client key equal
    to a derived key can never share a provider idempotency key with it.
    """
    name = operation_key if scope == KeyScope.CLIENT else f"{scope}\x1e{operation_key}"
    digest = hashlib.sha256(f"{name}\x1f{step}".encode()).hexdigest()
    return f"fence_{digest[:48]}"


def follow_up_key(parent: Operation, kind: str) -> str:
    """Return the derived key of `parent`'s follow-up of `kind` (scope DERIVED)."""
    return f"{parent.pk}:{kind}"


def attempt_key(first: Operation, attempt: int) -> str:
    """Return the derived key of attempt `attempt` (2, 3, ...) of the first operation `first`."""
    return f"{first.pk}:attempt-{attempt}"


# --- who acts, and the clock -------------------------------------------------------


def actor_id(role: str) -> str:
    """Return an actor id unique to this process: role, host, pid and a random suffix.

    Claims and leases are owned by these ids; two processes never share one,
    so neither mistakes the other's live claim for its own.
    """
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@functools.cache
def process_actor(role: str, pid: int | None = None) -> str:
    """Return this process's actor id for `role` (one per process: cached by pid)."""
    return actor_id(role)


def clock_of(row: Operation | StepClaim) -> datetime:
    """Return the database's clock read with a locked row (its `db_now` annotation)."""
    return cast(datetime, cast(Any, row).db_now)


def db_now() -> datetime:
    """Return PostgreSQL's clock (the transaction's start inside one): the only clock for leases.

    Every host compares leases against the database's time, so a host whose
    clock drifts cannot take over a live lease or keep an expired one.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    return now


def unique_violation_of(exc: IntegrityError, constraint: str) -> bool:
    """Tell whether `exc` is a violation of exactly the named constraint."""
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None) == constraint


# --- audit -----------------------------------------------------------------------


@fence_writer
def record_event_in_tx(
    operation: Operation,
    *,
    to_state: str,
    actor: str,
    from_state: str = "",
    step: str = "",
    reason: str = "",
) -> OperationEvent:
    """Write one audit row. Runs inside the caller's transaction."""
    return OperationEvent.objects.create(
        operation=operation,
        step=step,
        from_state=from_state,
        to_state=to_state,
        actor=actor[:255],
        reason=reason,
    )


# --- operations ------------------------------------------------------------------


@fence_writer
def create_operation_in_tx(
    *,
    key: str,
    kind: str,
    entity_type: str,
    entity_id: str | int,
    params: dict[str, Any],
    actor: str,
    retry_of: Operation | None = None,
    parent: Operation | None = None,
    scope: str = KeyScope.CLIENT,
    client: ApiClient | None = None,
) -> tuple[Operation, bool]:
    """Create the operation for `key`, or return the existing one with the same fingerprint.

    Runs inside the caller's transaction, next to the business change that asks
    for it (the row is the durable outbox). Keys are scoped per API client and
    per scope: two clients' keys never meet. Returns (operation, created).
    Raises OperationConflict when the key exists with another fingerprint.
    """
    if not transaction.get_connection().in_atomic_block:
        raise InvalidTransition("create_operation_in_tx must run inside transaction.atomic()")
    entity_id = str(entity_id)
    fp = fingerprint(kind, entity_type, entity_id, params)
    try:
        with transaction.atomic():  # savepoint: a duplicate key must not abort the caller
            op = Operation.objects.create(
                key=key,
                scope=scope,
                client=client,
                parent=parent,
                kind=kind,
                entity_type=entity_type,
                entity_id=entity_id,
                params=params,
                fingerprint=fp,
                retry_of=retry_of,
            )
    except IntegrityError as exc:
        if not unique_violation_of(exc, Operation.KEY_CONSTRAINT):
            raise
        existing = Operation.objects.get(client=client, scope=scope, key=key)
        if existing.fingerprint != fp:
            raise OperationConflict(
                key,
                existing_kind=existing.kind,
                existing_entity=f"{existing.entity_type} {existing.entity_id}",
            ) from exc
        return existing, False
    record_event_in_tx(op, to_state=OperationState.PENDING, actor=actor, reason="created")
    return op, True


@fence_writer
def transition_in_tx(
    operation: Operation,
    to_state: OperationState,
    *,
    actor: str,
    reason: str = "",
    **fields: Any,
) -> None:
    """Move a locked operation to `to_state`, audited. Runs inside the caller's transaction.

    The caller holds the row (select_for_update) so the check and the write are one.
    """
    from_state = operation.state
    transitions.check_operation(operation.key, from_state, to_state)
    operation.state = to_state
    for name, value in fields.items():
        setattr(operation, name, value)
    operation.save(update_fields=["state", "updated_at", *fields])
    if from_state != to_state or reason:
        record_event_in_tx(
            operation, from_state=from_state, to_state=to_state, actor=actor, reason=reason
        )


@fence_writer
def record_dispatch_in_tx(operation_id: int, job_id: str) -> None:
    """Record the job id of a new delivery, by the DB's clock. Runs in the caller's transaction.

    Not a state change: the sweeper reads it to tell a live delivery from a lost one.
    """
    Operation.objects.filter(pk=operation_id).update(job_id=job_id, dispatched_at=Now())


def locked_operation_in_tx(operation_id: int) -> Operation:
    """Return the operation row locked FOR UPDATE. Runs inside the caller's transaction.

    The row carries `db_now`, the database's clock read in the same statement.
    """
    return Operation.objects.select_for_update().annotate(db_now=Now()).get(pk=operation_id)


def lease_alive(operation: Operation, now: datetime) -> bool:
    """Tell whether a worker holds the operation's lease at `now` (the database's clock)."""
    return (
        operation.state == OperationState.RUNNING
        and operation.lease_expires_at is not None
        and operation.lease_expires_at > now
    )


@dataclass(frozen=True)
class LeaseResult:
    """The answer of acquire_lease: the operation, and whether this worker now holds it."""

    operation: Operation
    acquired: bool


def acquire_lease(operation_id: int, *, owner: str, seconds: int) -> LeaseResult:
    """Take the operation's lease if it is runnable and no live lease is held."""
    with transaction.atomic():
        op = locked_operation_in_tx(operation_id)
        now = clock_of(op)
        leased_by_other = lease_alive(op, now) and op.lease_owner != owner
        if op.state not in RUNNABLE_OPERATION_STATES or leased_by_other:
            return LeaseResult(op, acquired=False)
        reason = "lease expired; taken over" if op.state == OperationState.RUNNING else ""
        transition_in_tx(
            op,
            OperationState.RUNNING,
            actor=owner,
            reason=reason,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=seconds),
            next_attempt_at=None,
        )
    return LeaseResult(op, acquired=True)


def release_in_tx(
    operation: Operation,
    to_state: OperationState,
    *,
    actor: str,
    reason: str = "",
    **fields: Any,
) -> None:
    """Leave RUNNING for `to_state` and drop the lease. Runs inside the caller's transaction."""
    transition_in_tx(
        operation,
        to_state,
        actor=actor,
        reason=reason,
        lease_owner="",
        lease_expires_at=None,
        **fields,
    )


def record_failed_attempt_in_tx(
    operation: Operation,
    *,
    actor: str,
    reason: str,
    give_up_to: OperationState = OperationState.FAILED,
) -> bool:
    """Count one failed attempt of the locked operation; return True when it gave up.

    Under MAX_ATTEMPTS the operation is RETRYING, due after the next backoff;
    at MAX_ATTEMPTS it goes to `give_up_to` (FAILED unless the caller knows an
    effect happened or may have). The lease is dropped either way. Runs inside
    the caller's transaction, on a row from locked_operation_in_tx (its clock).
    """
    attempt = operation.attempts + 1
    if attempt >= payments_settings().max_attempts:
        release_in_tx(
            operation,
            give_up_to,
            actor=actor,
            reason=f"gave up after {attempt} attempts: {reason}"[:500],
            attempts=attempt,
            last_error=reason,
        )
        return True
    delay = payments_settings().backoff_before(attempt)
    release_in_tx(
        operation,
        OperationState.RETRYING,
        actor=actor,
        reason=f"attempt {attempt} failed: {reason}"[:500],
        attempts=attempt,
        last_error=reason,
        next_attempt_at=clock_of(operation) + timedelta(seconds=delay),
    )
    return False


def holds_lease_in_tx(operation: Operation, owner: str) -> bool:
    """Tell whether `owner` still holds the lease of the locked operation."""
    return operation.state == OperationState.RUNNING and operation.lease_owner == owner


# --- claims --------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimResult:
    """The answer of a claim insert: the row, and whether this call inserted it."""

    claim: StepClaim
    created: bool


@fence_writer
def claim_step(
    operation: Operation,
    step: str,
    *,
    owner: str,
    lease_seconds: int,
    request: dict[str, Any] | None = None,
    provider_call: bool = True,
) -> ClaimResult:
    """Insert and COMMIT the claim of an external step; on conflict return the existing row.

    Must be called outside any transaction: the claim has to be durable before
    the external call it fences. `provider_call` derives and stores the
    provider idempotency key (not for effects that have none, like e-mail).
    """
    if transaction.get_connection().in_atomic_block:
        raise InvalidTransition("claim_step must commit before the external call; no atomic()")
    try:
        with transaction.atomic():
            now = db_now()
            claim = StepClaim.objects.create(
                operation=operation,
                step=step,
                state=ClaimState.CLAIMED,
                idempotency_key=derive_idempotency_key(operation.key, step, operation.scope)
                if provider_call
                else "",
                request=request,
                attempts=1,  # the claimant acts at once; each take-over adds one
                claimed_by=owner,
                claimed_at=now,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
            )
            record_event_in_tx(
                operation, step=step, to_state=ClaimState.CLAIMED, actor=owner, reason="claimed"
            )
    except IntegrityError as exc:
        if not unique_violation_of(exc, StepClaim.UNIQUE_CONSTRAINT):
            raise
        return ClaimResult(StepClaim.objects.get(operation=operation, step=step), created=False)
    return ClaimResult(claim, created=True)


@fence_writer
def insert_local_claim_in_tx(operation: Operation, step: str, *, owner: str) -> StepClaim:
    """Insert a `done` claim for a local step. Runs inside the transaction of the step's writes.

    A concurrent duplicate raises IntegrityError on the claim constraint, which
    rolls the whole transaction back: the step's writes happen once.
    """
    now = db_now()
    claim = StepClaim.objects.create(
        operation=operation,
        step=step,
        state=ClaimState.DONE,
        claimed_by=owner,
        claimed_at=now,
        settled_at=now,
        attempts=1,
    )
    record_event_in_tx(operation, step=step, to_state=ClaimState.DONE, actor=owner)
    return claim


@fence_writer
def store_local_result_in_tx(claim: StepClaim, result: dict[str, Any]) -> None:
    """Store a local step's result on its claim. Runs inside the step's transaction."""
    StepClaim.objects.filter(pk=claim.pk).update(result=result)


def _locked_claim_in_tx(claim_id: int) -> StepClaim:
    """Return the claim locked FOR UPDATE (not its operation), with its operation and `db_now`."""
    return (
        StepClaim.objects.select_for_update(of=("self",))
        .select_related("operation")
        .annotate(db_now=Now())
        .get(pk=claim_id)
    )


def _name(claim: StepClaim) -> str:
    return f"{claim.operation.key}/{claim.step}"


def _require_owner(row: StepClaim, actor: str) -> None:
    """Refuse a settle or release by anyone but the claim's current owner (compare-and-set)."""
    if row.claimed_by != actor:
        logger.error(
            "claim %s is held by %s; %s may not change it (state %s)",
            _name(row),
            row.claimed_by or "nobody",
            actor,
            row.state,
        )
        raise NotClaimOwner(name=_name(row), owner=row.claimed_by, actor=actor)


@fence_writer
def take_over_claim(
    claim: StepClaim, *, owner: str, lease_seconds: int, why: str = ""
) -> StepClaim | None:
    """Take a claim to act on it; return the fresh row, or None while another owner holds it.

    A settled row (done, failed) is returned as it is, untaken: the caller
    replays its result or refuses, and never calls again. A claimed row whose
    owner did not release it (the owner died, or its job was cut off, between
    claim and record) becomes uncertain: that call may have run. A row its
    owner released after a transient failure stays claimed: nothing ran.
    Runs in its own transaction, or inside the caller's (then as a savepoint).
    """
    with transaction.atomic():
        row = _locked_claim_in_tx(claim.pk)
        if row.state in (ClaimState.DONE, ClaimState.FAILED):
            return row
        live = (
            row.lease_expires_at is not None
            and row.lease_expires_at > clock_of(row)
            and row.claimed_by not in ("", owner)
        )
        if live:
            return None
        previous, from_state = row.claimed_by, row.state
        in_doubt = row.state == ClaimState.CLAIMED and row.lease_expires_at is not None
        to_state = ClaimState.UNCERTAIN if in_doubt else row.state
        transitions.check_claim(_name(row), from_state, to_state)
        row.state = to_state
        row.claimed_by = owner
        row.lease_expires_at = clock_of(row) + timedelta(seconds=lease_seconds)
        row.attempts += 1
        row.save(
            update_fields=["state", "claimed_by", "lease_expires_at", "attempts", "updated_at"]
        )
        if previous != owner or row.state != from_state:
            record_event_in_tx(
                row.operation,
                step=row.step,
                from_state=from_state,
                to_state=row.state,
                actor=owner,
                reason=f"taken over from {previous or 'nobody'}"
                + ("; its call may have run" if row.state != from_state else "")
                + (f": {why}" if why else ""),
            )
    return row


@fence_writer
def settle_claim(
    claim: StepClaim,
    state: ClaimState,
    *,
    actor: str,
    reason: str = "",
    reference: str | None = None,
    result: dict[str, Any] | None = None,
    error: str = "",
) -> StepClaim:
    """Record a claim's outcome (done, failed, uncertain) with its reference, audited.

    Only the claim's current owner may settle it (compare-and-set on owner and
    state, through the transition table): anyone else gets NotClaimOwner or
    IllegalTransition and the row stays as it was. Runs in its own
    transaction, or inside the caller's.
    """
    with transaction.atomic():
        row = _locked_claim_in_tx(claim.pk)
        transitions.check_claim(_name(row), row.state, state)
        _require_owner(row, actor)
        from_state = row.state
        row.state = state
        if reference:
            row.provider_reference = reference
        if result is not None:
            row.result = result
        row.error = error[:2000]
        row.lease_expires_at = None
        if state != ClaimState.UNCERTAIN:
            row.settled_at = clock_of(row)
        row.save()
        record_event_in_tx(
            row.operation,
            step=row.step,
            from_state=from_state,
            to_state=state,
            actor=actor,
            reason=reason or error[:500],
        )
        if state == ClaimState.DONE:
            failpoint(BEFORE_RECORD_COMMIT)
    return row


@fence_writer
def note_provider_view(claim: StepClaim, found: EffectResult | None, *, source: str) -> None:
    """Remember what the provider showed for a claim (None: not found). Not a state change."""
    view: dict[str, Any] = {"source": source, "checked_at": db_now().isoformat()}
    if found is None:
        view["status"] = "not_found"
    else:
        view.update({"outcome": str(found.outcome), "reference": found.reference, **found.data})
    StepClaim.objects.filter(pk=claim.pk).update(provider_view=view)
    claim.provider_view = view


@fence_writer
def release_claim(claim: StepClaim, *, actor: str, reason: str) -> None:
    """Drop a claim's lease after a transient failure: the next attempt may take it at once.

    Only its owner releases it; the owner stays recorded. Its state stays: a
    claimed row is then "released" (lease gone: nothing ran), an uncertain one
    stays uncertain (an earlier call may have run).
    """
    with transaction.atomic():
        row = _locked_claim_in_tx(claim.pk)
        if row.state not in (ClaimState.CLAIMED, ClaimState.UNCERTAIN):
            return
        _require_owner(row, actor)
        row.lease_expires_at, row.error = None, reason[:2000]
        row.save(update_fields=["lease_expires_at", "error", "updated_at"])
        record_event_in_tx(
            row.operation,
            step=row.step,
            from_state=row.state,
            to_state=row.state,
            actor=actor,
            reason=f"released after transient failure: {reason}"[:2000],
        )


def released_by(claim: StepClaim, owner: str) -> bool:
    """Tell whether `owner` claimed this step and released it after a refusal (nothing ran)."""
    return (
        claim.state == ClaimState.CLAIMED
        and claim.claimed_by == owner
        and claim.lease_expires_at is None
    )


def claim_carrying(reference: str, *, besides: StepClaim) -> str | None:
    """Name the other claim ("operation_key/step") that carries `reference`, if any."""
    if not reference:
        return None
    other = (
        StepClaim.objects.filter(provider_reference=reference)
        .exclude(pk=besides.pk)
        .select_related("operation")
        .first()
    )
    return None if other is None else f"{other.operation.key}/{other.step}"


def claim_expired(claim: StepClaim, now: datetime | None = None) -> bool:
    """Tell whether a CLAIMED row's owner is gone (lease released or run out, by the DB's clock)."""
    now = now or db_now()
    return claim.lease_expires_at is None or claim.lease_expires_at <= now
