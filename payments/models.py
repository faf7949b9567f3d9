"""Records of the payments app: the business (Order, Invoice) and the fence.

The fence is three tables: Operation (one business intent), StepClaim (the
UNIQUE(operation, step) row inserted before a side effect) and OperationEvent
(the audit trail). Writes go through `payments.engine.fence`; nothing else edits them.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone
from rest_framework_api_key.models import AbstractAPIKey

from payments.engine.writes import writing

#: UNIQUE(tenant, scope, key). It kept the name it had over (client, scope, key) before
#: migration 0028: a previous release's INSERT ... ON CONFLICT ON CONSTRAINT names it.
OPERATION_KEY_CONSTRAINT = "payments_operation_client_scope_key_uniq"
#: Operation.tenant's length; the JSON API's clients are API_CLIENT_TENANT + their id.
TENANT_MAX_LENGTH = 64
API_CLIENT_TENANT = "client:"


class FenceWriteRefused(RuntimeError):
    """A fence row was to be written outside payments.engine.fence; nothing was written."""


def _refuse_outside_fence(model: type[models.Model], what: str) -> None:
    if not writing():
        raise FenceWriteRefused(
            f"{model.__name__}.{what} outside payments.engine.fence: fence rows change only "
            "through the fence (and its transition table)"
        )


class FenceQuerySet(models.QuerySet):
    """Reads as usual; writes only inside the fence (payments.engine.writes)."""

    def update(self, **kwargs: Any) -> int:
        _refuse_outside_fence(self.model, "update()")
        return super().update(**kwargs)

    def delete(self) -> tuple[int, dict[str, int]]:
        _refuse_outside_fence(self.model, "delete()")
        return super().delete()

    def bulk_create(self, objs: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_outside_fence(self.model, "bulk_create()")
        return super().bulk_create(objs, *args, **kwargs)

    def bulk_update(self, objs: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_outside_fence(self.model, "bulk_update()")
        return super().bulk_update(objs, *args, **kwargs)


class FenceModel(models.Model):
    """A fence row: written by payments.engine.fence only (save and delete refuse elsewhere)."""

    objects = FenceQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        _refuse_outside_fence(type(self), "save()")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_outside_fence(type(self), "delete()")
        return super().delete(*args, **kwargs)


CLAIM_UNIQUE_CONSTRAINT = "payments_stepclaim_operation_step_uniq"


class OperationState(models.TextChoices):
    PENDING = "pending", "Pending"  # written, waiting for its first run
    RUNNING = "running", "Running"  # a worker holds the lease
    RETRYING = "retrying", "Retrying"  # a transient failure; due again at next_attempt_at
    SUCCEEDED = "succeeded", "Succeeded"  # every step done (final)
    FAILED = "failed", "Failed"  # refused for good or retries exhausted (final)
    UNCERTAIN = "uncertain", "Uncertain"  # an effect may have happened; reconcile
    NEEDS_REVIEW = "needs_review", "Needs review"  # a person must decide


FINAL_OPERATION_STATES = frozenset({OperationState.SUCCEEDED, OperationState.FAILED})
#: Every other state: what the recovery loop reads, through partial indexes over these only.
UNFINISHED_OPERATION_STATES = [s for s in OperationState if s not in FINAL_OPERATION_STATES]
#: States in which a worker may take the operation (with an expired lease for RUNNING).
RUNNABLE_OPERATION_STATES = frozenset(
    {OperationState.PENDING, OperationState.RETRYING, OperationState.RUNNING}
)


class ApiClient(models.Model):
    """A client of the JSON API: its operations and idempotency keys are its own."""

    name = models.CharField(max_length=100, unique=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    #: The declared external system its payments go through ("provider": PROVIDER_*); each
    #: operation records it when created, so a change applies to new payments only.
    payment_system = models.CharField(max_length=50, default="provider")

    def __str__(self) -> str:
        return self.name

    @property
    def tenant(self) -> str:
        """The namespace of its operations' keys (Operation.tenant)."""
        return f"{API_CLIENT_TENANT}{self.pk}"

    @classmethod
    def of_tenant(cls, tenant: str) -> ApiClient | None:
        """The client whose namespace `tenant` is; None for another tenant or a deleted client."""
        client_id = api_client_id(tenant)
        return None if client_id is None else cls.objects.filter(pk=client_id).first()


def api_client_id(tenant: str) -> int | None:
    """The id in an API client's tenant ("client:12" -> 12, as ApiClient.tenant writes it:
    no sign, no leading zero, at most 18 digits); None for any other tenant."""
    number = tenant.removeprefix(API_CLIENT_TENANT)
    if number == tenant or not number.isascii() or not number.isdigit() or len(number) > 18:
        return None
    return int(number) if number == str(int(number)) and int(number) > 0 else None


def tenant_of(client: ApiClient | None) -> str:
    """The tenant of `client`'s operations: its `tenant`, or "" without a client (a tool's)."""
    return client.tenant if client is not None else ""


class ClientApiKey(AbstractAPIKey):
    """A key of an API client: stored hashed, shown once, with a visible prefix; revocable.

    Rotation without downtime: add a new key, move the client to it, revoke the old one.
    """

    client = models.ForeignKey(ApiClient, on_delete=models.PROTECT, related_name="keys")

    class Meta(AbstractAPIKey.Meta):
        verbose_name = "client API key"
        verbose_name_plural = "client API keys"


class KeyScope(models.TextChoices):
    """Whose namespace an operation key lives in: UNIQUE(scope, key), so the two never collide."""

    CLIENT = "client", "Client"  # chosen by the caller (the API's Idempotency-Key)
    DERIVED = "derived", "Derived"  # made by the system: a follow-up or a new attempt of a parent


class Operation(FenceModel):
    """One business intent, e.g. "check out order 42", keyed for idempotency."""

    KEY_CONSTRAINT = OPERATION_KEY_CONSTRAINT

    key = models.CharField(max_length=255)
    scope = models.CharField(max_length=16, choices=KeyScope, default=KeyScope.CLIENT)
    #: The namespace its key lives in, supplied by the project that creates it: the
    #: JSON API's client ("client:<id>", ApiClient.tenant), a project's own customer or
    #: account, or "" (the system's own, a project with one namespace). Two tenants' keys
    #: never meet, and each step's provider idempotency key is derived with it.
    tenant = models.CharField(max_length=TENANT_MAX_LENGTH, blank=True, db_default="")
    kind = models.CharField(max_length=64)
    entity_type = models.CharField(max_length=64)
    entity_id = models.CharField(max_length=64)
    params = models.JSONField(default=dict)
    fingerprint = models.CharField(max_length=64)
    state = models.CharField(max_length=20, choices=OperationState, default=OperationState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=255, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    job_id = models.CharField(max_length=64, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    retry_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="retries",
        db_index=False,  # Meta.indexes: only the rows that have one
    )
    #: The operation whose step wrote this one (a follow-up); None for a client's intent.
    parent = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="follow_ups",
        db_index=False,  # Meta.indexes: only the rows that have one
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    #: When retention purged its claims, audit rows and provider events (payments.engine.
    #: retention); the row stays, so that its key is never taken again.
    purged_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "scope", "key"], name=OPERATION_KEY_CONSTRAINT
            ),
        ]
        # Every index is written on each insert and on each state change (an update of
        # an indexed column writes a new entry in all of them): only what a query needs.
        indexes = [
            # Over unfinished operations only (migration 0014): what the recovery loop reads.
            models.Index(
                fields=["state", "next_attempt_at"],
                name="payments_op_unfinished",
                condition=Q(state__in=UNFINISHED_OPERATION_STATES),
            ),
            # Failed ones whose claims may still resume them (the stranded pass, E010).
            models.Index(
                fields=["updated_at"],
                name="payments_op_failed",
                condition=Q(state=OperationState.FAILED),
            ),
            # Succeeded ones by when they succeeded (migration 0020): the desk's chart reads
            # the last day's range; written once per operation, when it succeeds.
            models.Index(
                fields=["updated_at"],
                name="payments_op_succeeded",
                condition=Q(state=OperationState.SUCCEEDED),
            ),
            models.Index(fields=["entity_type", "entity_id"], name="payments_op_entity"),
            # A retry's first attempt, a follow-up's parent: most rows have none.
            models.Index(
                fields=["retry_of"],
                name="payments_op_retry_of",
                condition=Q(retry_of__isnull=False),
            ),
            models.Index(
                fields=["parent"], name="payments_op_parent", condition=Q(parent__isnull=False)
            ),
            # Final operations whose history is still kept: what the retention purge walks.
            models.Index(
                fields=["id"],
                name="payments_op_unpurged",
                condition=Q(purged_at__isnull=True, state__in=sorted(FINAL_OPERATION_STATES)),
            ),
        ]
        permissions = [
            ("reconcile_operation", "Can reconcile operations (query provider, resume, settle)"),
            ("start_new_attempt", "Can start a new payment attempt with a new key"),
        ]

    def __str__(self) -> str:
        return self.key


class ClaimState(models.TextChoices):
    CLAIMED = "claimed", "Claimed"  # inserted before the effect; owner holds a lease
    DONE = "done", "Done"  # the effect happened; result and reference stored
    FAILED = "failed", "Failed"  # the effect was refused for good
    UNCERTAIN = "uncertain", "Uncertain"  # the effect may have happened; reconcile


#: Claims whose outcome is not recorded yet: what the reconciler reads.
UNSETTLED_CLAIM_STATES = [ClaimState.CLAIMED, ClaimState.UNCERTAIN]
#: The error of a claim the fence gave up on after every try of its step was refused before
#: it executed (payments.engine.fence says it; its partial index is the desk's way to the
#: operations an outage failed before anything ran).
GAVE_UP_BEFORE_RUNNING = "gave up: "


class StepClaim(FenceModel):
    """The fence: one row per (operation, step), inserted before the effect."""

    UNIQUE_CONSTRAINT = CLAIM_UNIQUE_CONSTRAINT

    operation = models.ForeignKey(
        Operation,
        on_delete=models.PROTECT,
        related_name="claims",
        db_index=False,  # the unique (operation, step) index leads with operation_id
    )
    step = models.CharField(max_length=64)
    state = models.CharField(max_length=20, choices=ClaimState, default=ClaimState.CLAIMED)
    idempotency_key = models.CharField(max_length=255, blank=True)
    provider_reference = models.CharField(max_length=255, blank=True)  # Meta.indexes
    request = models.JSONField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    #: What the provider showed at the last lookup (query, reconciler, fence_audit):
    #: status, amount, currency, reference, checked_at, source. An observation, not a state.
    provider_view = models.JSONField(null=True, blank=True)
    #: The provider's object a look saw for this step (provider_view's reference, kept when
    #: a later look sees none), so that the desk's search finds it while the step is not
    #: settled (`provider_reference` is what it is settled with). Evidence: nothing decides
    #: by it. A database default: a previous release's INSERT still works.
    seen_reference = models.CharField(max_length=255, blank=True, default="", db_default="")
    #: Times a worker acted under this claim (the first call, then each take-over).
    attempts = models.PositiveIntegerField(default=0)
    #: Requests sent again under the claim's key after the first (replays, not look-ups):
    #: the desk shows 1 + this as the attempts at the work, and the rest of `attempts`
    #: as look-ups. A database default: a previous release's INSERT still works.
    requests_sent = models.PositiveIntegerField(default=0, db_default=0)
    #: The external system the step calls (payments.engine.systems), as its effect named it
    #: when the claim was made: its key retention and words. Empty: a local step, or a
    #: claim older than the column (its handler's effect tells).
    system = models.CharField(max_length=64, blank=True, default="", db_default="")
    claimed_by = models.CharField(max_length=255)
    claimed_at = models.DateTimeField()
    #: When the last request under the claim's idempotency key was sent (worker, reconciler
    #: or desk), by the database's clock: "not found" counts only a grace after it.
    #: NULL on claims older than the column, and on claims of steps without a provider call.
    last_request_at = models.DateTimeField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    settled_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["operation", "step"], name=CLAIM_UNIQUE_CONSTRAINT),
        ]
        # Written on each insert and each state change, as the operation's: no index on
        # the idempotency key (nothing looks a claim up by it but the admin's search,
        # which matches case-insensitively and could not use one).
        indexes = [
            # Over unsettled claims only (migration 0014): what the reconciler reads.
            models.Index(
                fields=["claimed_at"],
                name="payments_claim_unsettled",
                condition=Q(state__in=UNSETTLED_CLAIM_STATES),
            ),
            # One index for both lookups by reference: equality (webhooks, the desk) and
            # prefix (`pi_`, `re_`), which a default-collation btree cannot serve. Over the
            # claims that carry a reference only (migration 0025): a local step's claim, and
            # an external one until its answer, write no entry. An equality lookup implies
            # the condition; an IN list does only up to 100 items without '' (PostgreSQL's
            # proof gives up past that), and a prefix never: those state it, with
            # `.exclude(provider_reference="")`, to read through the index.
            models.Index(
                fields=["provider_reference"],
                name="payments_claim_ref_given",
                opclasses=["varchar_pattern_ops"],
                condition=~Q(provider_reference=""),
            ),
            # What a look saw (migration 0030), for the desk's search by reference (an
            # equality). Over the claims a look found an object for only: a checkout that
            # never needed a look writes no entry.
            models.Index(
                fields=["seen_reference"],
                name="payments_claim_seen_ref",
                condition=~Q(seen_reference=""),
            ),
            # The claims the fence gave up on before anything ran (migration 0031): what
            # Needs attention and the operations list find outage cases of any age through,
            # however many operations failed otherwise (declines). A few rows per outage.
            models.Index(
                fields=["operation"],
                name="payments_claim_gave_up",
                condition=Q(state=ClaimState.FAILED, error__startswith=GAVE_UP_BEFORE_RUNNING),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.operation_id}:{self.step}"


class LookShowed(models.TextChoices):
    """What one look at a claim's outcome showed (a replay, a retrieve, a list, an event)."""

    OBJECT = "object", "The provider's object"  # what it showed is in the claim's provider_view
    NOT_FOUND = "not_found", "Not found"  # a consistent read found nothing (yet)
    IN_PROGRESS = "in_progress", "In progress at the provider"  # neither done nor refused
    IN_FLIGHT = "in_flight", "A request under its key is still in flight"  # a 409 ..._in_use
    UNREADABLE = "unreadable", "The provider could not be read"  # timeout, 5xx, refused socket
    #: The system offers no read (payments.engine.systems.Read): only a same-key replay
    #: within its key's retention, its event, or a person with its report can tell.
    NO_READ = "no_read", "Nothing to read: the system offers no look-up"


#: Looks that learned nothing because the provider did not answer: an incident's marks.
INCIDENT_LOOKS = (LookShowed.IN_FLIGHT, LookShowed.UNREADABLE)


class ClaimLook(FenceModel):
    """The evidence of a claim's unknown outcome: the fence's looks at it, and when the next is.

    A look that learns nothing new changes this row (counters, last and next
    look), never the audit trail: the trail records changes of state. The
    object the provider showed stays on the claim (`StepClaim.provider_view`);
    this row says how the last look went and what the engine waits for. One
    row per claim, written only by the fence (`payments.engine.fence.note_look`);
    a claim that never needed a look has none.
    """

    claim = models.OneToOneField(
        StepClaim, on_delete=models.CASCADE, primary_key=True, related_name="look"
    )
    #: Looks at the outcome so far: replays that could not tell, reads, queries.
    looks = models.PositiveIntegerField(default=0)
    #: Looks in a row that showed the same (`showed`): the wait before the next grows with it.
    streak = models.PositiveIntegerField(default=0)
    showed = models.CharField(max_length=20, choices=LookShowed)
    #: The provider's own words of the last look: the error and request id, or what it showed.
    detail = models.TextField(blank=True)
    #: Who looked, and how (a same-key replay, a list, the desk's query, an event).
    actor = models.CharField(max_length=255, blank=True)
    source = models.CharField(max_length=40, blank=True)
    first_look_at = models.DateTimeField()
    last_look_at = models.DateTimeField()
    #: When the reconciler looks again (NULL: at its next round).
    next_look_at = models.DateTimeField(null=True, blank=True)
    #: Since when the provider answers "a request under this key is in flight" (NULL: not now).
    in_flight_since = models.DateTimeField(null=True, blank=True)
    #: Since when looks at this claim go unanswered (NULL: the last one was answered).
    unread_since = models.DateTimeField(null=True, blank=True)
    #: Why a look cannot settle it (a contradiction, a key conflict): the reconciler stops
    #: looking and a person decides. Empty: it keeps looking, even under review.
    hold = models.TextField(blank=True)

    def __str__(self) -> str:
        return f"{self.claim_id}: {self.showed} x{self.looks}"


class OperationEvent(FenceModel):
    """An audit row: one state change of an operation or of one of its steps."""

    operation = models.ForeignKey(Operation, on_delete=models.PROTECT, related_name="events")
    step = models.CharField(max_length=64, blank=True)
    from_state = models.CharField(max_length=20, blank=True)
    to_state = models.CharField(max_length=20)
    actor = models.CharField(max_length=255)
    reason = models.TextField(blank=True)
    #: The provider requests that led to this change, as the actor sent them: method, path,
    #: HTTP status (None: no answer), request id, idempotency key (payments.engine.
    #: exchanges). Written in the row's own statement; NULL when none was sent.
    requests = models.JSONField(null=True, blank=True)
    #: Not indexed: every read of the audit is one operation's rows (its own index).
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        target = f"{self.operation_id}:{self.step}" if self.step else str(self.operation_id)
        return f"{target} {self.from_state or '-'} -> {self.to_state}"


class FenceAuditRun(models.Model):
    """The result of one `fence_audit` run, shown on the admin's Needs attention page."""

    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    window_start = models.DateTimeField()
    exit_code = models.PositiveSmallIntegerField()
    #: Counts, and the first findings of each kind (never the whole list).
    summary = models.JSONField(default=dict)
    #: The end of the last day audited: `fence_audit --since last` starts there.
    #: NULL when no day was (the provider could not be read at the first).
    checkpoint = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-finished_at"]

    def __str__(self) -> str:
        return f"audit {self.finished_at:%Y-%m-%d %H:%M} exit {self.exit_code}"


class ProviderEvent(models.Model):
    """One event the provider pushed (a signed webhook) or listed (`sync_provider_events`).

    Stored as received, acknowledged at once, handled later by a job behind the
    inbox (consumer `provider-events`, message id = the event id): `handled_at`
    is empty until that job committed. `operation` and `outcome` say what the
    event did (the desk lists an operation's events). Written by
    `payments.webhooks` only.
    """

    id = models.CharField(primary_key=True, max_length=255)  # the provider's evt_...
    type = models.CharField(max_length=100)
    #: When the provider created the event (its clock), not when it reached us.
    created = models.DateTimeField()
    payload = models.JSONField()
    #: The provider object the event is about (pi_..., re_..., ch_...).
    object_id = models.CharField(max_length=255, blank=True, db_index=True)
    received_at = models.DateTimeField(default=timezone.now)
    handled_at = models.DateTimeField(null=True, blank=True)
    #: What handling it did: done, failed, already_settled, stale, busy, needs_review, ...
    outcome = models.CharField(max_length=40, blank=True)
    operation = models.ForeignKey(
        Operation,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="provider_events",
    )

    class Meta:
        ordering = ["created", "id"]
        indexes = [
            models.Index(fields=["handled_at", "received_at"], name="payments_event_pending"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.type}"
