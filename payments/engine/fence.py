"""The fence core: operations, step claims and their audit trail.

It knows no HTTP, no business step, no admin screen and no view: handlers, the
admin desk, the API and the recovery code call into it. Functions whose name
ends in `_in_tx` (or whose docstring says so) run inside the caller's
transaction; the others own theirs.

Its statements are the named blocks of payments/engine/sql/queries.sql;
payments.engine.driver sends them (prepared, pipelined) and reads their rows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn, cast

from django.db import DatabaseError, IntegrityError, connection, models, transaction
from django.db.models.functions import Now
from django.utils import timezone
from psycopg.sql import SQL, Identifier

from payments.conf import payments_settings
from payments.engine import driver, exchanges, transitions

# Re-exported (`X as X`): the engine's modules (unit, worker, handlers) ask the fence.
from payments.engine.driver import KEEP_CURSORS as KEEP_CURSORS
from payments.engine.driver import CommitWith as CommitWith
from payments.engine.driver import QueuedStatement
from payments.engine.driver import commit_with_next_statement as commit_with_next_statement
from payments.engine.driver import discard_queued as discard_queued
from payments.engine.driver import has_queued as has_queued
from payments.engine.driver import is_interruption as is_interruption
from payments.engine.effects import EffectResult
from payments.engine.failpoints import BEFORE_RECORD_COMMIT, failpoint
from payments.engine.signals import operation_state_changed
from payments.engine.sql import QUERIES
from payments.engine.writes import fence_writer
from payments.exceptions import (
    ConfigurationError,
    InvalidTransition,
    NotClaimOwner,
    OperationConflict,
    OutcomeRefused,
    StepDoneMeanwhile,
)
from payments.models import (
    API_CLIENT_TENANT,
    INCIDENT_LOOKS,
    RUNNABLE_OPERATION_STATES,
    TENANT_MAX_LENGTH,
    UNSETTLED_CLAIM_STATES,
    ClaimLook,
    ClaimState,
    KeyScope,
    LookShowed,
    Operation,
    OperationState,
    StepClaim,
    api_client_id,
)
from payments.models import GAVE_UP_BEFORE_RUNNING as _GAVE_UP

logger = logging.getLogger("payments.engine.fence")

# --- keys and fingerprints -----------------------------------------------------


#: How a step's release after a refusal begins its audit row: nothing ran at the system
#: (the desk's "not found" hint reads it).
RELEASED_AFTER_TRANSIENT = "released after transient failure"
#: How a claim's error begins when the fence gave up on its step after every try was
#: refused before it executed: nothing ran at the system (the desk lists the operation
#: as a case until a new attempt is asked for). Declared beside the claims' partial index
#: on it (payments.models), re-exported here.
GAVE_UP_BEFORE_RUNNING = _GAVE_UP
#: Why the looks at a claim stop after an idempotency conflict (the system refused the
#: step's key as used before with other parameters): a look replays the same request and
#: meets the same refusal; a person decides (the desk says so, "Held for a person"). Set by
#: payments.engine.steps where the conflict is met, for a worker and the reconciler alike.
CONFLICT_HOLD = (
    "idempotency conflict: the key was used with other parameters (a bug, never retried); "
    "check what the key made at the system"
)
#: What derive_idempotency_key puts between a key's tenant, scope, name and step.
KEY_SEPARATORS = ("\x1d", "\x1e", "\x1f")


def check_tenant(tenant: str) -> None:
    """Refuse a tenant that is not 0-64 printable ASCII characters (ValueError, naming it).

    The tenant goes into every step's provider idempotency key beside the
    operation's key, with control characters between them: a tenant holding
    one could derive another tenant's key.
    """
    if not isinstance(tenant, str):
        raise ValueError(f"an operation's tenant is a str, not {type(tenant).__name__}")
    if len(tenant) > TENANT_MAX_LENGTH or not all(" " < c <= "~" for c in tenant):
        raise ValueError(
            f"tenant {tenant!r}: at most {TENANT_MAX_LENGTH} printable ASCII characters, "
            "no spaces (e.g. 'hotel:42')"
        )
    if tenant.startswith(API_CLIENT_TENANT) and api_client_id(tenant) is None:
        raise ValueError(
            f"tenant {tenant!r}: {API_CLIENT_TENANT!r} is the JSON API's clients' prefix, "
            f"followed by a client's id ('{API_CLIENT_TENANT}12'); choose a prefix of your own"
        )


def fingerprint(kind: str, entity_type: str, entity_id: str, params: dict[str, Any]) -> str:
    """Hash what makes two requests the same intent (kind, entity, parameters)."""
    canonical = json.dumps(
        {"kind": kind, "entity": [entity_type, str(entity_id)], "params": params},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def derive_idempotency_key(
    operation_key: str, step: str, scope: str = KeyScope.CLIENT, tenant: str = ""
) -> str:
    """Derive the provider idempotency key of a step: stable, bounded, no attempt number.

    A derived operation's scope goes into the hash, so that a client key equal
    to a derived key can never share a provider idempotency key with it; the
    tenant goes in too, so that two shops using the same key (their own order
    numbers, say) never share one either. An API client's tenant is the
    "client:<id>" its id went in as before Operation.tenant existed, so every
    key derives as it did. A claim stores its key when it is inserted and every
    request under it sends that stored key: a claim made before the client went
    into the hash keeps the key it was made with.
    """
    digest = hashlib.sha256(f"{key_name(operation_key, scope, tenant)}\x1f{step}".encode())
    return f"fence_{digest.hexdigest()[:48]}"


def key_name(operation_key: str, scope: str = KeyScope.CLIENT, tenant: str = "") -> str:
    """An operation's key as its derived ids name it: prefixed with its scope when derived,
    and with its tenant when it has one (KEY_SEPARATORS between), so that no two
    operations' names meet (derive_idempotency_key, dispatch.message_id_for)."""
    name = operation_key if scope == KeyScope.CLIENT else f"{scope}\x1e{operation_key}"
    return f"{tenant}\x1d{name}" if tenant else name


def follow_up_key(parent: Operation, kind: str) -> str:
    """Return the derived key of `parent`'s follow-up of `kind` (scope DERIVED)."""
    return f"{parent.pk}:{kind}"


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
        cursor.execute(QUERIES["db_now"])
        (now,) = cursor.fetchone()
    return now


# --- sending the statements ---------------------------------------------------------
#
# A transition on a worker's path (take the lease, claim, settle, leave the lease,
# create) is ONE data-modifying statement of payments/engine/sql/queries.sql: the row
# lock, the compare-and-set, the change and its audit row travel together. Outside a
# transaction it is its own transaction (one round trip, committed when it returns; the
# lease shares its implicit transaction with the reads of its entity, `acquire_lease`);
# inside the caller's it joins it. payments.engine.driver sends them (prepared, in
# pipelines, with what is queued for the transaction) and reads their rows; here is
# what their answers mean.

#: Which statement of queries.sql each constant runs (the names the docs use).
RECORD_EVENT = QUERIES["record_event"]
CREATE_OPERATION = QUERIES["create_operation"]
ACQUIRE_LEASE = QUERIES["acquire_lease"]
RELEASE_HELD_LEASE = QUERIES["release_held_lease"]
SUCCEED_MESSAGE = QUERIES["succeed_message"]
DELIVER_MESSAGE = QUERIES["deliver_message"]
INSERT_CLAIM = QUERIES["insert_claim"]
INSERT_CLAIM_OR_FAIL = QUERIES["insert_claim_or_fail"]
INSERT_CLAIM_WITH_LEASE = QUERIES["insert_claim_with_lease"]
WITHDRAW_CLAIM = QUERIES["withdraw_claim"]
SETTLE_CLAIM = QUERIES["settle_claim"]
SETTLE_CLAIM_OR_REFUSE = QUERIES["settle_claim_or_refuse"]
NOTE_REQUEST_SENT = QUERIES["note_request_sent"]
#: The SQLSTATE payments_fence_refuse() raises (SETTLE_CLAIM_OR_REFUSE).
REFUSAL_SQLSTATE = "PF001"
#: The provider requests an audit row carries (payments.engine.exchanges): what was sent
#: in the caller's `recording()` block since the last row took them, unless given.
Requests = list[dict[str, Any]] | None


@fence_writer
def send_queued_in_tx() -> None:
    """Send the queued statements now (with the COMMIT asked for, `commit_with_next_statement`)."""
    if driver.owes_send():
        driver.execute(driver.this_thread(), [], _queued_failed)


def _queued_failed(exc: DatabaseError, queued: tuple[QueuedStatement, ...]) -> None:
    """Raise what a round trip that failed with `queued` statements in front means for the
    protocol; return when it is the database's error only (driver.OnFailure).

    Nothing after the failing statement ran, the COMMIT included.
    """
    if isinstance(exc, IntegrityError):
        if _is_claim_taken(exc):
            # Only a queued claim inserts without ON CONFLICT: another run committed the
            # step while this one ran it.
            step = _taken_step(exc, [claim.step for claim in queued])
            raise StepDoneMeanwhile(operation_key=queued[0].operation_key, step=step) from exc
        return
    settles = [q for q in queued if q.sql is SETTLE_CLAIM_OR_REFUSE]
    if settles and _is_refusal(exc):
        # A queued outcome settled nothing.
        detail = str(cast(Any, exc.__cause__).diag.message_primary)
        named = (q for q in settles if f" {q.operation_key}:{q.step} " in detail)
        refused = next(named, settles[0])
        raise OutcomeRefused(
            operation_key=refused.operation_key, step=refused.step, detail=detail
        ) from exc


def _is_claim_taken(exc: IntegrityError) -> bool:
    """Tell whether `exc` is a unique violation of the step claims (the step is claimed)."""
    diag = getattr(exc.__cause__, "diag", None)
    return diag is not None and diag.constraint_name == StepClaim.UNIQUE_CONSTRAINT


def _is_refusal(exc: DatabaseError) -> bool:
    """Tell whether `exc` is payments_fence_refuse()'s error (migration payments 0009)."""
    return getattr(exc.__cause__, "sqlstate", None) == REFUSAL_SQLSTATE


def _taken_step(exc: IntegrityError, steps: list[str]) -> str:
    """Which of `steps` the unique violation `exc` names (its detail), else the first."""
    # "Key (operation_id, step)=(12, invoice) already exists."
    detail = getattr(exc.__cause__, "diag", None)
    text = (detail.message_detail if detail is not None else None) or ""
    named = text[text.find("=(") + 2 : text.rfind(")")].partition(", ")[2]
    return named if named in steps else steps[0]


def _one(model: type[Any], sql: str, params: dict[str, Any]) -> Any:
    """Run one statement that returns at most one row of `model`; return it, or None."""
    return _rows(model, [(sql, params)])[0]


def _rows(model: type[Any], statements: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Run statements that each return at most one row of `model`, in one round trip (a
    pipeline: a failing one stops the rest); return each one's row or None."""
    return _rows_of([(model, sql, params) for sql, params in statements])


def _rows_of(statements: list[tuple[type[Any], str, dict[str, Any]]]) -> list[Any]:
    """`_rows` for statements that each return at most one row of their own model."""
    return driver.rows_of(statements, _queued_failed)


def _json(value: Any) -> str | None:
    """A JSON document for a `%s::jsonb` parameter (None stays SQL NULL)."""
    return None if value is None else json.dumps(value)


def _requests_json(requests: Requests) -> str | None:
    """An audit row's `requests`: those given, else the ones sent since the last row took
    them (exchanges.take); SQL NULL when there are none."""
    sent = requests if requests is not None else exchanges.take()
    return _json(exchanges.bounded(sent) if sent else None)


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
    requests: Requests = None,
) -> None:
    """Write one audit row. Runs inside the caller's transaction.

    Stamped with PostgreSQL's clock, as the one-statement transitions stamp
    theirs: the trail's order (created_at, id) never depends on which host
    wrote a row or how far its clock drifts. It carries `requests`, else the
    provider requests sent since the last row took them (exchanges.take).
    """
    with connection.cursor() as cursor:
        cursor.execute(
            RECORD_EVENT,
            {
                "operation": operation.pk,
                "step": step,
                "from_state": from_state,
                "to_state": to_state,
                "actor": actor[:255],
                "reason": reason,
                "requests": _requests_json(requests),
            },
        )


def _announce_change(kind: str, from_state: str, to_state: str) -> None:
    """Send `operation_state_changed` when the caller's transaction commits (at once
    outside one, where the statement has committed already); a same-state note sends
    nothing. A receiver's error is logged, never raised into the commit (robust)."""
    if from_state == to_state:
        return
    transaction.on_commit(
        functools.partial(
            operation_state_changed.send,
            sender=Operation,
            kind=kind,
            from_state=from_state,
            to_state=to_state,
        ),
        robust=True,
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
    tenant: str = "",
    job_id: str = "",
) -> tuple[Operation, bool]:
    """Create the operation for `key`, or return the existing one with the same fingerprint.

    Runs inside the caller's transaction, next to the business change that asks
    for it (the row is the durable outbox). Keys are scoped per tenant (the
    namespace the project supplies: an API client's `ApiClient.tenant`, its own
    customer's, or "") and per scope: two tenants' keys never meet. `job_id` records the delivery the
    caller will enqueue once the transaction commits (dispatch does that), in
    the same statement. Returns (operation, created).
    Raises OperationConflict when the key exists with another fingerprint.
    """
    (created,) = create_operations_in_tx(
        [
            NewOperation(
                key=key,
                kind=kind,
                entity_type=entity_type,
                entity_id=entity_id,
                params=params,
                actor=actor,
                retry_of=retry_of,
                parent=parent,
                scope=scope,
                tenant=tenant,
                job_id=job_id,
            )
        ]
    )
    return created


@dataclass(frozen=True)
class NewOperation:
    """What `create_operation_in_tx` takes, for creating several in one round trip."""

    key: str
    kind: str
    entity_type: str
    entity_id: str | int
    params: dict[str, Any]
    actor: str
    retry_of: Operation | None = None
    parent: Operation | None = None
    scope: str = KeyScope.CLIENT
    tenant: str = ""
    job_id: str = ""

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if any(separator in self.key for separator in KEY_SEPARATORS):
            raise ValueError(
                f"operation key {self.key!r} holds a control character that separates a "
                "derived key's parts (\\x1d, \\x1e, \\x1f): it could derive another "
                "tenant's or scope's idempotency key"
            )


@fence_writer
def create_operations_in_tx(new: list[NewOperation]) -> list[tuple[Operation, bool]]:
    """`create_operation_in_tx` for each of `new`, their statements in one round trip.

    The statements go in one pipeline, in order, each as it would go alone (a
    failing one stops those after it and aborts the transaction, as it would
    have one by one). A taken key is then looked up, as alone. Returns
    (operation, created) for each, in order. A key taken with other parameters
    raises OperationConflict and, in a batch of several, marks the innermost
    atomic block around it (the caller's transaction, or its savepoint) for
    rollback: unlike one by one, the statements after it ran.
    """
    if not transaction.get_connection().in_atomic_block:
        raise InvalidTransition("create_operation_in_tx must run inside transaction.atomic()")
    fingerprints = [
        fingerprint(one.kind, one.entity_type, str(one.entity_id), one.params) for one in new
    ]
    rows = _rows(
        Operation,
        [
            (
                CREATE_OPERATION,
                {
                    "key": one.key,
                    "scope": one.scope,
                    "tenant": one.tenant,
                    "parent": one.parent.pk if one.parent is not None else None,
                    "retry_of": one.retry_of.pk if one.retry_of is not None else None,
                    "kind": one.kind,
                    "entity_type": one.entity_type,
                    "entity_id": str(one.entity_id),
                    "params": _json(one.params),
                    "fingerprint": fp,
                    "job_id": one.job_id,
                    "actor": one.actor[:255],
                },
            )
            for one, fp in zip(new, fingerprints, strict=True)
        ],
    )
    try:
        return [
            (op, True) if op is not None else (_existing(one, fp), False)
            for one, fp, op in zip(new, fingerprints, rows, strict=True)
        ]
    except OperationConflict:
        if len(new) > 1:
            # The statements after the conflicting one ran too (one pipeline), which one
            # by one they would not have: none of the batch may commit, even if the
            # caller catches the conflict (the innermost atomic block rolls back).
            transaction.set_rollback(True)
        raise


def _existing(new: NewOperation, fp: str) -> Operation:
    """The operation holding `new`'s key (ON CONFLICT waited for a concurrent inserter to
    commit); OperationConflict if it was created with other parameters."""
    existing = Operation.objects.get(tenant=new.tenant, scope=new.scope, key=new.key)
    if existing.fingerprint != fp:
        raise OperationConflict(
            new.key,
            existing_kind=existing.kind,
            existing_entity=f"{existing.entity_type} {existing.entity_id}",
        )
    return existing


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
    _announce_change(operation.kind, from_state, to_state)


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
    #: The steps claimed when the lease was taken: a local step not among them runs its
    #: function first (payments.engine.handlers.Run.local). None when the lease was not
    #: taken, or was taken over from a worker that may still be running.
    claimed_steps: frozenset[str] | None = None
    #: The rows read with the lease (`entities`), by model: the operation's entity when it
    #: is of that model, else None. Empty when the lease was not taken.
    entities: dict[type[Any], Any] = field(default_factory=dict)
    #: The claim `first_claim` inserted with the lease, committed with it; None when it
    #: inserted nothing (no lease, the step claimed already, a hint the row disagrees with).
    first_claim: StepClaim | None = None


@dataclass(frozen=True)
class FirstClaim:
    """The claim of the step a handler opens with, to insert in the lease's round trip:
    INSERT_CLAIM_WITH_LEASE's parameters but the operation's id and the owner (`first_claim`
    builds it)."""

    step: str
    params: dict[str, Any]


def first_claim(
    hint: dict[str, Any], step: str, *, request: dict[str, Any], system: str, lease_seconds: int
) -> FirstClaim:
    """The claim of `step` with `request`, built from `hint` (the values of
    payments.engine.dispatch.HINT_FIELDS the request was built from): inserted with the
    lease only if the leased row holds the same values. Raises TypeError (ValueError) for
    a request or params JSON cannot hold."""
    return FirstClaim(
        step=step,
        params={
            "step": step,
            "idempotency_key": derive_idempotency_key(
                hint["key"], step, hint["scope"], hint["tenant"]
            ),
            "request": _json(request),
            "lease_seconds": lease_seconds,
            "system": system,
            **{name: hint[name] for name in ("key", "scope", "tenant", "kind", "entity_type")},
            "entity_id": str(hint["entity_id"]),
            "params": _json(hint["params"]),
            "retry_of_id": hint["retry_of_id"],
        },
    )


@fence_writer
def withdraw_claim(claim: StepClaim, *, owner: str, reason: str) -> bool:
    """Delete a claim made with the lease whose step the run did not get to (WITHDRAW_CLAIM):
    held by `owner`, its lease live, nothing sent; audited. Return whether it was; a claim
    in any other case stays as it is (its lease runs out, and it is taken over as any)."""
    params = {"id": claim.pk, "owner": owner[:255], "reason": reason[:2000]}
    return _one(StepClaim, WITHDRAW_CLAIM, params) is not None


#: Per model: the statement that reads the operation's entity when it is one of the
#: model's rows (queries.sql, read_entity, composed with the model's names), else nothing.
_READ_ENTITY: dict[type[Any], str] = {}


#: How read_entity tells that an operation's entity_id (text, at most 64 characters) can
#: be a key of each kind, and casts it: (the test, the cast), by entity_key_kind's answer.
ENTITY_KEYS: dict[str, tuple[str, str]] = {
    "integer": ("entity_id ~ '^-?[0-9]{1,18}$'", "entity_id::bigint"),
    "uuid": (
        "entity_id ~* '^[0-9a-f]{8}-?([0-9a-f]{4}-?){3}[0-9a-f]{12}$'",
        "entity_id::uuid",
    ),
    "text": ("true", "entity_id::text"),
}

#: The most characters an entity's key may have as text: Operation.entity_id's length.
ENTITY_KEY_LENGTH = 64


def entity_key_kind(model: type[Any]) -> str:
    """The kind of `model`'s primary key as an entity's (a key of ENTITY_KEYS).

    Integer keys (AutoField, BigAutoField, IntegerField...), UUIDField, and
    CharField / TextField / SlugField keys that fit in entity_id's 64
    characters. Raises ConfigurationError for any other (a date, a foreign
    key's composite...), naming the model and the field.
    """
    key = model._meta.pk
    while key is not None and key.is_relation:  # a parent's key (multi-table inheritance)
        key = key.target_field
    if isinstance(key, models.IntegerField):
        return "integer"
    if isinstance(key, models.UUIDField):
        return "uuid"
    if isinstance(key, models.CharField | models.TextField):
        if key.max_length is None or key.max_length > ENTITY_KEY_LENGTH:
            raise ConfigurationError(
                f"{model.__name__}'s primary key {key.name} may be longer than an entity's "
                f"{ENTITY_KEY_LENGTH} characters: give it max_length={ENTITY_KEY_LENGTH} or less"
            )
        return "text"
    raise ConfigurationError(
        f"{model.__name__}'s primary key {getattr(key, 'name', key)} "
        f"({type(key).__name__}) cannot be an entity's: use an integer, UUID or text key"
    )


def _read_entity_sql(model: type[Any]) -> str:
    sql = _READ_ENTITY.get(model)
    if sql is None:
        columns = [Identifier(f.column) for f in model._meta.concrete_fields]
        key_test, key = ENTITY_KEYS[entity_key_kind(model)]
        sql = _READ_ENTITY[model] = (
            SQL(QUERIES["read_entity"])
            .format(
                columns=SQL(", ").join(columns),
                table=Identifier(model._meta.db_table),
                pk=Identifier(model._meta.pk.column),
                key_test=SQL(key_test),  # a constant of ENTITY_KEYS, never input
                key=SQL(key),
            )
            .as_string()
        )
    return sql


def _lease_with(
    operation_id: int,
    owner: str,
    seconds: int,
    runnable: list[str],
    entities: tuple[type[Any], ...],
    first: FirstClaim | None = None,
) -> list[Any]:
    """ACQUIRE_LEASE, the reads of `entities` and the insert of `first`, in one pipeline:
    each one's row or None."""
    return _rows_of(
        [
            (
                Operation,
                ACQUIRE_LEASE,
                {
                    "id": operation_id,
                    "owner": owner[:255],
                    "seconds": seconds,
                    "from_states": runnable,
                    # Its own transaction only: a caller's may hold what a guarantee rests
                    # on, and a claim that fences a call commits with its WAL flushed.
                    "async_commit": first is None
                    and not transaction.get_connection().in_atomic_block,
                },
            ),
            *(
                (model, _read_entity_sql(model), {"id": operation_id, "entity_type": name})
                for model in entities
                for name in [model._meta.model_name]
            ),
            *(
                [
                    (
                        StepClaim,
                        INSERT_CLAIM_WITH_LEASE,
                        {**first.params, "operation": operation_id, "owner": owner[:255]},
                    )
                ]
                if first is not None
                else []
            ),
        ]
    )


@fence_writer
def acquire_lease(
    operation_id: int,
    *,
    owner: str,
    seconds: int,
    entities: tuple[type[Any], ...] = (),
    first_claim: FirstClaim | None = None,
) -> LeaseResult:
    """Take the operation's lease if it is runnable and no live lease is held.

    One statement (ACQUIRE_LEASE) in the happy path; when it takes nothing,
    one read tells the caller why (state, or another worker's live lease).
    Outside a transaction the lease commits without waiting for its WAL to
    be flushed (see ACQUIRE_LEASE in queries.sql: the claim that fences the
    call, committed synchronously after it, makes it durable).
    `entities` (models with an integer key) are read in the same round trip,
    after the lease in the same implicit transaction (it sees the lease): the
    operation's entity, if it is a row of one of them
    (payments.engine.handlers: `@handler(entity=...)`). If a read fails, the
    lease is taken alone (logged): no entity's read stops a lease.
    `first_claim` (outside a transaction only) is inserted last in that round trip
    and transaction (INSERT_CLAIM_WITH_LEASE), which then commits synchronously: the
    claim is durable before the call it fences, as claim_step's. It is inserted only
    with the lease and where the row agrees with the values it was built from
    (`LeaseResult.first_claim`, else None); if its statement fails, the lease is taken
    alone as after a failed read.
    Raises Operation.DoesNotExist for an unknown id.
    """
    if first_claim is not None and transaction.get_connection().in_atomic_block:
        raise InvalidTransition("a first claim must commit before the external call; no atomic()")
    runnable = [
        state
        for state in transitions.operation_sources(OperationState.RUNNING)
        if state in RUNNABLE_OPERATION_STATES
    ]
    try:
        op, *rows = _lease_with(operation_id, owner, seconds, runnable, entities, first_claim)
    except DatabaseError:
        if not entities and first_claim is None:
            raise
        # A read or the claim failed (a migration not run yet, a table locked past a
        # timeout): it rolled the lease back with it. Every kind's lease carries every
        # declared entity's read, so none may stop the others: take the lease alone, and
        # the handler reads its entity itself (Run.entity) and claims its step as any.
        logger.exception(
            "reading %s or claiming with the lease failed; taking the lease alone", entities
        )
        return acquire_lease(operation_id, owner=owner, seconds=seconds)
    claim = rows.pop() if first_claim is not None else None
    if op is not None:
        claimed = frozenset(op.__dict__.pop("claimed_steps"))
        op.__dict__.pop("commit_mode")
        # Taken over from a worker whose lease ran out: it may still be running,
        # so this run's local steps claim first (payments.engine.handlers.Run.local).
        taken_over = op.from_state == OperationState.RUNNING
        if claim is not None:
            claim.operation = op
        return LeaseResult(
            op,
            acquired=True,
            claimed_steps=None if taken_over else claimed,
            entities=dict(zip(entities, rows, strict=True)),
            first_claim=claim,
        )
    return LeaseResult(
        Operation.objects.annotate(db_now=Now()).get(pk=operation_id), acquired=False
    )


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


#: The columns a release may set besides the state and the lease.
RELEASE_FIELDS = frozenset({"last_error", "next_attempt_at", "attempts", "result"})


@fence_writer
def release_held_lease(
    operation: Operation,
    to_state: OperationState,
    *,
    owner: str,
    reason: str = "",
    **fields: Any,
) -> Operation | None:
    """Leave RUNNING for `to_state` if `owner` still holds the lease; return the row, or None.

    One statement (RELEASE_HELD_LEASE): the check that this worker still
    holds the lease, the change and its audit row. None: the lease was lost
    (run out and taken over), nothing changed. Own transaction, or the caller's.
    """
    transitions.check_operation(operation.key, OperationState.RUNNING, to_state)
    unknown = set(fields) - RELEASE_FIELDS
    if unknown:
        raise InvalidTransition(f"a release cannot set {sorted(unknown)}")
    # Each column a release may set is set only when given (its set_ flag): one statement
    # for every combination, prepared once.
    values: dict[str, Any] = {}
    for name in sorted(RELEASE_FIELDS):
        given = name in fields
        values[f"set_{name}"] = given
        value = fields.get(name)
        values[name] = _json(value) if name == "result" and given else value
    released = _one(
        Operation,
        RELEASE_HELD_LEASE,
        {
            "id": operation.pk,
            "owner": owner[:255],
            "to_state": to_state,
            "reason": reason,
            **values,
        },
    )
    if released is not None:
        _announce_change(released.kind, OperationState.RUNNING, to_state)
    return released


@fence_writer
def deliver_message_in_tx(
    operation_id: int, *, consumer: str, message_id: str, actor: str, reason: str
) -> Operation | None:
    """Record a message's inbox row and mark its operation succeeded; return it, locked.

    One statement (DELIVER_MESSAGE) for what record_message and
    succeed_message_in_tx do in two. None: the inbox row exists (a
    redelivery), nothing changed. Raises as succeed_message_in_tx does when
    the operation may not succeed (the caller's transaction rolls back, the
    inbox row with it). In the caller's transaction (inbox.handlers.inbox_guard).
    """
    op = _one(
        Operation,
        DELIVER_MESSAGE,
        {
            "consumer": consumer,
            "message_id": message_id,
            "handled_at": timezone.now(),
            "id": operation_id,
            "from_states": transitions.operation_sources(OperationState.SUCCEEDED),
            "actor": actor[:255],
            "reason": reason,
        },
    )
    if not op.__dict__.pop("recorded"):
        return None
    if op.pk is None:
        _refuse_success(operation_id)
    _announce_change(op.kind, op.from_state, OperationState.SUCCEEDED)
    return op


def _refuse_success(operation_id: int) -> NoReturn:
    """Raise why the operation may not succeed (IllegalTransition, or it changed meanwhile)."""
    current = Operation.objects.get(pk=operation_id)
    transitions.check_operation(current.key, current.state, OperationState.SUCCEEDED)
    raise InvalidTransition(f"operation {current.key} changed while it was delivered")


@fence_writer
def succeed_message_in_tx(operation_id: int, *, actor: str, reason: str) -> Operation:
    """Mark a message's operation succeeded and return it, locked. In the caller's transaction.

    One statement (SUCCEED_MESSAGE). Raises IllegalTransition when its state
    may not succeed (already succeeded, say): the caller's transaction rolls back.
    """
    op = _one(
        Operation,
        SUCCEED_MESSAGE,
        {
            "id": operation_id,
            "from_states": transitions.operation_sources(OperationState.SUCCEEDED),
            "actor": actor[:255],
            "reason": reason,
        },
    )
    if op is None:
        _refuse_success(operation_id)
    _announce_change(op.kind, op.from_state, OperationState.SUCCEEDED)
    return op


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


def _claim_params(
    operation: Operation,
    step: str,
    *,
    state: ClaimState,
    owner: str,
    reason: str,
    lease_seconds: int | None = None,
    idempotency_key: str = "",
    request: dict[str, Any] | None = None,
    result: dict[str, Any] | None = None,
    system: str = "",
) -> dict[str, Any]:
    """The parameters of INSERT_CLAIM and INSERT_CLAIM_OR_FAIL for one claim."""
    return {
        "system": system,
        "operation": operation.pk,
        "step": step,
        "state": state,
        "idempotency_key": idempotency_key,
        "request": _json(request),
        "result": _json(result),
        "owner": owner[:255],
        "lease_seconds": lease_seconds,
        "reason": reason,
    }


def _insert_claim(operation: Operation, params: dict[str, Any]) -> StepClaim | None:
    """Run INSERT_CLAIM with `_claim_params`; return the new claim (its operation attached),
    or None if taken."""
    claim = _one(StepClaim, INSERT_CLAIM, params)
    if claim is not None:
        claim.operation = operation
    return claim


def claim_step(
    operation: Operation,
    step: str,
    *,
    owner: str,
    lease_seconds: int,
    request: dict[str, Any] | None = None,
    provider_call: bool = True,
    system: str = "",
) -> ClaimResult:
    """Insert and COMMIT the claim of an external step; on conflict return the existing row.

    Must be called outside any transaction: the claim has to be durable before
    the external call it fences (the statement commits as it returns).
    `provider_call` derives and stores the provider idempotency key (not for
    effects that have none, like e-mail); `system` names the external system called.
    """
    if transaction.get_connection().in_atomic_block:
        raise InvalidTransition("claim_step must commit before the external call; no atomic()")
    return claim_step_in_tx(
        operation,
        step,
        owner=owner,
        lease_seconds=lease_seconds,
        request=request,
        provider_call=provider_call,
        system=system,
    )


@fence_writer
def claim_step_in_tx(
    operation: Operation,
    step: str,
    *,
    owner: str,
    lease_seconds: int,
    request: dict[str, Any] | None = None,
    provider_call: bool = True,
    system: str = "",
) -> ClaimResult:
    """`claim_step` in the caller's transaction, which must commit before the call it fences.

    For a handler's open transaction (payments.engine.unit): the claim commits
    with the writes before it, then the call is made.
    """
    claim = _insert_claim(
        operation,
        _claim_params(
            operation,
            step,
            state=ClaimState.CLAIMED,
            owner=owner,
            reason="claimed",
            # the claimant acts at once (attempts 1); each take-over adds one
            lease_seconds=lease_seconds,
            idempotency_key=derive_idempotency_key(
                operation.key, step, operation.scope, operation.tenant
            )
            if provider_call
            else "",
            request=request,
            system=system,
        ),
    )
    if claim is not None:
        return ClaimResult(claim, created=True)
    existing = StepClaim.objects.select_related("operation").get(operation=operation, step=step)
    return ClaimResult(existing, created=False)


@fence_writer
def insert_local_claim_in_tx(
    operation: Operation, step: str, *, owner: str, result: dict[str, Any] | None = None
) -> StepClaim | None:
    """Insert the `done` claim of a local step; None when the step is taken already.

    Runs inside the transaction of the step's writes: a concurrent duplicate
    waits on the claim's unique key (ON CONFLICT) and, once the first
    commits, gets None. Before the writes (no `result` yet, stored after
    them), or after them with their `result` in the same statement.
    """
    return _insert_claim(
        operation,
        _claim_params(
            operation, step, state=ClaimState.DONE, owner=owner, reason="", result=result
        ),
    )


@fence_writer
def queue_local_claim_in_tx(
    operation: Operation, step: str, *, owner: str, result: dict[str, Any]
) -> None:
    """Queue the `done` claim of a local step whose writes ran, with their `result`.

    For a step that had no claim when the run's lease was taken (its
    function ran first): no answer is needed before the run goes on, so
    the claim goes in the pipeline of the transaction's next fence statement
    (a claim before a call, the release), or with its COMMIT
    (`send_queued_in_tx`): no round trip of its own. The claim commits with
    the writes or not at all. If another run committed the step meanwhile
    (a lease taken over), the claim fails there, nothing behind it runs, and
    that statement raises StepDoneMeanwhile. Runs inside the caller's
    transaction; its rollback must `discard_queued()`.
    """
    params = _claim_params(
        operation, step, state=ClaimState.DONE, owner=owner, reason="", result=result
    )
    driver.queue("queue_local_claim_in_tx", operation.key, step, INSERT_CLAIM_OR_FAIL, params)


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
    requests: Requests = None,
) -> StepClaim:
    """Record a claim's outcome (done, failed, uncertain) with its reference, audited.

    The audit row carries the provider requests that told it (`requests`, else
    those sent since the last row took them: payments.engine.exchanges).

    Only the claim's current owner may settle it (compare-and-set on owner and
    state, through the transition table): anyone else gets NotClaimOwner or
    IllegalTransition and the row stays as it was. One statement
    (SETTLE_CLAIM): its own transaction, or the caller's.
    """
    if state == ClaimState.DONE:
        # Killed here, the outcome is not recorded: what a crash before the commit leaves.
        failpoint(BEFORE_RECORD_COMMIT, claim.step)
    params = _settle_params(claim, state, actor, reason, reference, result, error, requests)
    row = _settled(claim, params)
    if row is None:
        # Refused: say why, with the row as it is now (an illegal move, or another owner).
        current = StepClaim.objects.select_related("operation").get(pk=claim.pk)
        transitions.check_claim(_name(current), current.state, state)
        _require_owner(current, actor)
        raise NotClaimOwner(name=_name(current), owner=current.claimed_by, actor=actor)
    return row


@fence_writer
def settle_claim_again(
    claim: StepClaim,
    state: ClaimState,
    *,
    actor: str,
    reason: str = "",
    reference: str | None = None,
    result: dict[str, Any] | None = None,
    requests: Requests = None,
) -> StepClaim | None:
    """settle_claim for an outcome queued in a transaction that rolled back: written on
    its own now, or, when the claim is no longer the actor's to settle (taken over,
    settled meanwhile), nothing: None, with a warning (its owner settles it)."""
    params = _settle_params(claim, state, actor, reason, reference, result, "", requests)
    row = _settled(claim, params)
    if row is None:
        logger.warning(
            "outcome of %s:%s not written again after a rollback: the claim is no longer "
            "%s's to settle",
            claim.operation.key,
            claim.step,
            actor,
        )
    return row


def _settled(claim: StepClaim, params: dict[str, Any]) -> StepClaim | None:
    """SETTLE_CLAIM with `params` (_settle_params): the settled row, or None (refused)."""
    row = _one(StepClaim, SETTLE_CLAIM, params)
    if row is not None:
        row.operation = claim.operation
    return row


def _settle_params(
    claim: StepClaim,
    state: ClaimState,
    actor: str,
    reason: str,
    reference: str | None,
    result: dict[str, Any] | None,
    error: str,
    requests: Requests,
) -> dict[str, Any]:
    return {
        "id": claim.pk,
        "to_state": state,
        "from_states": transitions.claim_sources(state),
        "actor": actor[:255],
        "reference": reference or "",
        "set_result": result is not None,
        "result": _json(result),
        "error": error[:2000],
        "reason": reason or error[:500],
        "requests": _requests_json(requests),
    }


def queue_outcome_in_tx(
    claim: StepClaim,
    state: ClaimState,
    *,
    actor: str,
    reason: str = "",
    reference: str | None = None,
    result: dict[str, Any] | None = None,
    requests: Requests = None,
) -> None:
    """Queue a claim's outcome, known outside (a call answered, an e-mail sent), in the
    open transaction: settle_claim's change, sent ahead of its answer.

    Nothing waits for it: it goes in the pipeline of the transaction's next
    fence statement (the next claim before a call, the release), or with its
    COMMIT (`send_queued_in_tx`), in no round trip of its own, and commits
    with the transaction. If it settles nothing there (the claim was taken
    over, or settled by someone else meanwhile), that statement raises
    OutcomeRefused and nothing queued behind it runs, the COMMIT included.
    The caller writes the outcome again on its own (settle_claim_again) if the
    transaction rolls back (payments.engine.unit `record_outcome`). Runs inside
    the caller's transaction; its rollback must `discard_queued()`.
    """
    if state == ClaimState.DONE:
        # Killed here, the outcome is not recorded: what a crash before the commit leaves.
        failpoint(BEFORE_RECORD_COMMIT, claim.step)
    key, step = claim.operation.key, claim.step
    params = _settle_params(claim, state, actor, reason, reference, result, "", requests)
    params["refusal"] = (
        f"claim {key}:{step} was not settled {state} by {actor[:255]}: "
        "taken over, or settled by someone else meanwhile"
    )
    driver.queue("queue_outcome_in_tx", key, step, SETTLE_CLAIM_OR_REFUSE, params)


@fence_writer
def note_provider_view(
    claim: StepClaim,
    found: EffectResult | None,
    *,
    source: str,
    actor: str = "",
    requests: Requests = None,
) -> None:
    """Remember what the provider showed for a claim (None: not found). Not a state change.

    With who asked (`actor`) and the requests the lookup sent (`requests`, else
    exchanges.peek: they stay for the audit row a change of state writes next; a lookup
    that changes nothing has only this view, which the next lookup replaces).

    The object's reference is kept as `seen_reference` (a later look that sees none
    leaves it): the desk's search finds the step by it while it is not settled. It
    settles nothing; `provider_reference` is written only by settle_claim.
    """
    view: dict[str, Any] = {"source": source, "checked_at": db_now().isoformat()}
    if actor:
        view["actor"] = actor[:255]
    sent = requests if requests is not None else exchanges.peek()
    if sent:
        view["requests"] = exchanges.bounded(sent)
    seen: dict[str, str] = {}
    if found is None:
        view["status"] = "not_found"
    else:
        view.update({"outcome": str(found.outcome), "reference": found.reference, **found.data})
        if found.reference:
            seen["seen_reference"] = found.reference[:255]
    StepClaim.objects.filter(pk=claim.pk).update(provider_view=view, **seen)
    claim.provider_view = view
    if seen:
        claim.seen_reference = seen["seen_reference"]


#: The wait before the reconciler looks again at a claim whose look showed the same as the
#: one before: doubled with each such look, from the first to the most. A provider that
#: answers again is read within the most (every claim, whatever the grace).
LOOK_WAIT_FIRST = timedelta(seconds=5)
LOOK_WAIT_MOST = timedelta(seconds=60)


def look_wait(showed: str, streak: int) -> timedelta:
    """How long after a look the next one is due.

    A first look that the provider answered is looked at again at the next
    round (the grace decides); an unanswered one (in flight, unreadable), and
    any that showed the same as the looks before it, wait longer each time.
    """
    repeats = streak - 1 if showed in INCIDENT_LOOKS else streak - 2
    if repeats < 0:
        return timedelta(0)
    return min(LOOK_WAIT_FIRST * (2 ** min(repeats, 10)), LOOK_WAIT_MOST)


@fence_writer
def note_look(
    claim: StepClaim,
    showed: LookShowed,
    *,
    actor: str,
    source: str,
    detail: str = "",
    in_flight: bool | None = None,
) -> ClaimLook:
    """Record one look at a claim's outcome: counters and what it showed, no audit row.

    The audit trail records changes of state; a look that changed nothing is
    only counted here (looks, last and next look). `in_flight` says whether the
    provider holds a request under the key now (None: this look did not ask).
    An object the provider showed goes to the claim's provider_view
    (note_provider_view); this row keeps how the look went.
    """
    with transaction.atomic():
        now = db_now()
        look = ClaimLook.objects.select_for_update().filter(claim_id=claim.pk).first()
        if look is None:
            look = ClaimLook(claim_id=claim.pk, first_look_at=now, looks=0, streak=0)
        look.streak = look.streak + 1 if look.showed == showed else 1
        look.looks += 1
        look.showed = showed
        look.detail = detail[:2000]
        look.actor = actor[:255]
        look.source = source[:40]
        look.last_look_at = now
        if in_flight is not None:
            look.in_flight_since = (look.in_flight_since or now) if in_flight else None
        # A request in flight is waited for as an unanswered look is, whatever the list showed.
        waits_as = LookShowed.IN_FLIGHT if look.in_flight_since else showed
        look.next_look_at = now + look_wait(waits_as, look.streak)
        if showed == LookShowed.UNREADABLE:
            look.unread_since = look.unread_since or now
        elif showed != LookShowed.IN_FLIGHT:
            look.unread_since = None
        look.save()
    return look


def in_flight_since(claim: StepClaim) -> datetime | None:
    """Since when the provider has answered that a request under the claim's key is in
    flight (None: it did not, at the last look); now, for a claim never looked at."""
    look = ClaimLook.objects.filter(claim_id=claim.pk).only("in_flight_since").first()
    if look is None:
        return db_now()
    return look.in_flight_since or db_now()


@fence_writer
def hold_looks(claim: StepClaim, why: str) -> None:
    """Stop the reconciler's looks at a claim a look cannot settle (a contradiction)."""
    with transaction.atomic():
        now = db_now()
        look, _ = ClaimLook.objects.select_for_update().get_or_create(
            claim_id=claim.pk,
            defaults={"first_look_at": now, "last_look_at": now, "showed": LookShowed.OBJECT},
        )
        look.hold = why[:2000]
        look.next_look_at = None
        look.save(update_fields=["hold", "next_look_at"])


@fence_writer
def release_after_look(claim: StepClaim, *, actor: str) -> None:
    """Drop the lease `actor` took to look at an unsettled claim; no audit row (nothing changed).

    The next round, a worker or the desk may take it at once.
    """
    StepClaim.objects.filter(
        pk=claim.pk, claimed_by=actor, state__in=UNSETTLED_CLAIM_STATES
    ).update(lease_expires_at=None)


@fence_writer
def note_request_sent(claim: StepClaim, *, actor: str) -> None:
    """Record, and commit, that `actor` is about to send a request under the claim's key again.

    "Not found at the provider" counts only a grace period after the last
    request sent, whoever sent it: a request that never reached the provider
    is executed by a later same-key replay, and a lookup soon after that
    replay cannot see what it did yet. Must run outside a transaction (Django's
    durable atomic refuses to nest): the time commits before the request leaves.
    """
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        cursor.execute(NOTE_REQUEST_SENT, {"id": claim.pk, "actor": actor})
        row = cursor.fetchone()
    if row is None:
        raise InvalidTransition(f"{_name(claim)}: {actor} does not hold it; nothing is sent")
    claim.last_request_at = row[0]


def last_request_at(claim: StepClaim) -> datetime:
    """When the last request under the claim's key was sent (claims older than the column:
    when they were claimed)."""
    return claim.last_request_at or claim.claimed_at


_UNCHANGED: Any = object()


@fence_writer
def release_claim(
    claim: StepClaim,
    *,
    actor: str,
    reason: str,
    last_request_at: Any = _UNCHANGED,
    requests: Requests = None,
    audited: bool = True,
) -> None:
    """Drop a claim's lease after a transient failure: the next attempt may take it at once.

    Only its owner releases it; the owner stays recorded. Its state stays: a
    claimed row is then "released" (lease gone: nothing ran), an uncertain one
    stays uncertain (an earlier call may have run). `last_request_at` puts back
    the time of the request before one that was never sent (and takes it, and the
    take-over that sent it, off the counts of requests sent and of attempts). The audit row carries
    `requests` (else: record_event_in_tx's); a look that changed nothing (`audited`
    False: the reconciler's) writes none, its look is counted instead (note_look).
    """
    with transaction.atomic():
        row = _locked_claim_in_tx(claim.pk)
        if row.state not in (ClaimState.CLAIMED, ClaimState.UNCERTAIN):
            return
        _require_owner(row, actor)
        row.lease_expires_at, row.error = None, reason[:2000]
        fields = ["lease_expires_at", "error", "updated_at"]
        if last_request_at is not _UNCHANGED:
            # The request was never executed (nothing ran): neither its time nor its count
            # stays, so that the desk's attempts count only requests that could move money,
            # nor the take-over that sent it, which the desk would count as a look-up.
            row.last_request_at = claim.last_request_at = last_request_at
            row.requests_sent = claim.requests_sent = max(row.requests_sent - 1, 0)
            row.attempts = claim.attempts = max(row.attempts - 1, 1)
            fields.extend(["last_request_at", "requests_sent", "attempts"])
        row.save(update_fields=fields)
        if not audited:
            return
        record_event_in_tx(
            row.operation,
            step=row.step,
            from_state=row.state,
            to_state=row.state,
            actor=actor,
            reason=f"{RELEASED_AFTER_TRANSIENT}: {reason}"[:2000],
            requests=requests,
        )


def released_by(claim: StepClaim, owner: str) -> bool:
    """Tell whether `owner` claimed this step and released it after a refusal (nothing ran)."""
    return (
        claim.state == ClaimState.CLAIMED
        and claim.claimed_by == owner
        and claim.lease_expires_at is None
    )


def claim_carrying(reference: str, *, besides: StepClaim) -> str | None:
    """Name the other claim ("operation_key/step") settled done with `reference`, if any.

    One provider success settles one step. A failed claim may carry the same
    reference: an order's attempts share its PaymentIntent, and an attempt
    declined on it carries it as much as the one that succeeded.
    """
    if not reference:
        return None
    other = (
        StepClaim.objects.filter(provider_reference=reference, state=ClaimState.DONE)
        .exclude(pk=besides.pk)
        .select_related("operation")
        .first()
    )
    return None if other is None else f"{other.operation.key}/{other.step}"


def claim_expired(claim: StepClaim, now: datetime | None = None) -> bool:
    """Tell whether a CLAIMED row's owner is gone (lease released or run out, by the DB's clock)."""
    now = now or db_now()
    return claim.lease_expires_at is None or claim.lease_expires_at <= now
