"""The desk's queries: annotations of operations, follow-ups, stale leases, money per state."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from django.db.models import (
    BigIntegerField,
    Case,
    Count,
    F,
    IntegerField,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce, Greatest, Lower
from django.urls import reverse
from django.utils import timezone

from payments.desk.display import reference_link, when
from payments.engine.fence import RELEASED_AFTER_TRANSIENT
from payments.engine.handlers import registered_handlers
from payments.engine.systems import system_of
from payments.engine.transitions import WITHDRAWN
from payments.models import (
    UNFINISHED_OPERATION_STATES,
    ClaimState,
    Operation,
    OperationEvent,
    OperationState,
    ProviderEvent,
    StepClaim,
)
from payments.money import format_totals

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations


class StateSince(TypedDict):
    """The annotation `with_state_since` adds."""

    state_since: datetime


def with_state_since(
    queryset: QuerySet[Operation],
) -> QuerySet[WithAnnotations[Operation, StateSince]]:
    """Annotate `state_since`: when the operation entered its current state."""
    entered = (
        OperationEvent.objects.filter(operation=OuterRef("pk"), step="", to_state=OuterRef("state"))
        .filter(~Q(from_state=F("to_state")))  # a note in the same state does not restart it
        .order_by("-created_at", "-id")
        .values("created_at")[:1]
    )
    return queryset.annotate(state_since=Coalesce(Subquery(entered), F("updated_at")))


class WaitingSince(StateSince):
    """The annotations `with_waiting_since` adds."""

    waiting_since: datetime


#: The states an operation waits in for the reconciler or a person: going from one to the
#: other (uncertain, then under review) is one wait, not a new one.
WAITING_STATES = (OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW)


def with_waiting_since(
    queryset: QuerySet[Operation],
) -> QuerySet[WithAnnotations[Operation, WaitingSince]]:
    """Annotate `state_since` and `waiting_since`: for an operation in WAITING_STATES, when
    it first entered one of them since it was last in any other state; else `state_since`.
    Each a look through the audit rows' index on the operation, as `with_state_since`."""
    left = (
        OperationEvent.objects.filter(operation=OuterRef(OuterRef("pk")), step="")
        .exclude(to_state__in=WAITING_STATES)
        .order_by("-created_at", "-id")
        .values("created_at")[:1]
    )
    began = (
        OperationEvent.objects.filter(
            operation=OuterRef("pk"), step="", to_state__in=WAITING_STATES
        )
        .filter(created_at__gt=Subquery(left))
        .order_by("created_at", "id")
        .values("created_at")[:1]
    )
    waiting = Case(When(state__in=WAITING_STATES, then=Subquery(began)))
    return with_state_since(queryset).annotate(waiting_since=Coalesce(waiting, F("state_since")))


class LastReason(TypedDict):
    """The annotation `with_last_reason` adds."""

    last_reason: str | None


def with_last_reason(queryset: QuerySet[Any]) -> QuerySet[Any]:
    """Annotate `last_reason`: the reason of the operation's last audit row that gives one
    (what `last_error_of` shows when the operation recorded no error), in the same query."""
    last = (
        OperationEvent.objects.filter(operation=OuterRef("pk"))
        .exclude(reason="")
        .order_by("-created_at", "-id")
        .values("reason")[:1]
    )
    return queryset.annotate(last_reason=Subquery(last))


class ClaimAttempts(TypedDict):
    """The annotations `with_attempts` adds."""

    all_attempts: int
    lookups: int


def with_attempts(queryset: QuerySet[Any]) -> QuerySet[Any]:
    """Annotate `all_attempts`, the attempts at the work, and `lookups`, the look-ups since.

    An attempt is a request sent to the provider: the first under a step's
    key and each replay (`StepClaim.requests_sent`), for the busiest step; an
    operation without a provider step counts its runs. Every other take-over
    of a claim was a look-up (a reconciler's pass): counted apart, so one
    real call never reads as fifteen attempts.
    """
    external = StepClaim.objects.filter(operation=OuterRef("pk")).exclude(idempotency_key="")
    sent = external.order_by("-requests_sent").values("requests_sent")[:1]
    looked = (
        external.values("operation")
        .annotate(
            n=Sum(
                Greatest(F("attempts") - 1 - F("requests_sent"), Value(0)),
                output_field=IntegerField(),
            )
        )
        .values("n")
    )
    return queryset.annotate(
        all_attempts=Coalesce(Subquery(sent) + 1, F("attempts"), output_field=IntegerField()),
        lookups=Coalesce(Subquery(looked), Value(0), output_field=IntegerField()),
    )


def attempts_of(op: Operation) -> int:
    """The attempts at the work: annotated by `with_attempts`, else read from the claims."""
    annotated = getattr(op, "all_attempts", None)
    if annotated is not None:
        return int(annotated)
    external = [c for c in op.claims.all() if c.idempotency_key]
    return max(1 + c.requests_sent for c in external) if external else op.attempts


def lookups_of(op: Operation) -> int:
    """The look-ups made under the operation's claims (take-overs that sent nothing)."""
    annotated = getattr(op, "lookups", None)
    if annotated is not None:
        return int(annotated)
    external = [c for c in op.claims.all() if c.idempotency_key]
    return sum(max(c.attempts - 1 - c.requests_sent, 0) for c in external)


@dataclass(frozen=True)
class FirstError:
    """The first error a step recorded, and whether the engine then held its call in doubt."""

    text: str = ""
    #: The engine recorded a step uncertain at some point (no complete answer, a timeout, a
    #: take-over of a call in flight): the system may have acted on a request. Read from
    #: the claim's state, not from the error's class name, which is the system's own.
    may_have_run: bool = False


def first_error_of(op: Operation, step: str = "") -> FirstError:
    """The first error a step (`step`, else any) recorded: the audit keeps it, while
    `last_error` and the claim's `error` are overwritten by what came after."""
    events = OperationEvent.objects.filter(operation=op)
    first = (
        (events.filter(step=step) if step else events.exclude(step=""))
        .exclude(reason__in=("", "claimed"))
        .exclude(to_state__in=(ClaimState.DONE, WITHDRAWN))
        .exclude(actor__startswith="operator:")
        .exclude(reason__startswith="taken over from", to_state=F("from_state"))
        .order_by("created_at", "id")
        .values_list("reason", "to_state")
        .first()
    )
    if first is None:
        return FirstError()
    reason, _ = first
    # Held uncertain at any time (a release after a refusal may come first, then a timeout):
    # a request under the key may have run.
    in_doubt = (
        OperationEvent.objects.filter(operation=op, to_state=ClaimState.UNCERTAIN)
        .exclude(step="")
        .exists()
    )
    return FirstError(reason, may_have_run=in_doubt)


def not_found_kind(first: FirstError, last_error: str) -> str:
    """Say which "not found" it is, from the first error: never reached, or answer lost."""
    if "not found" not in last_error:
        return ""
    if first.may_have_run:
        return (
            "charged and its answer lost? The first request got no complete answer: the "
            "provider may have acted on it, so a look-up by reference is the safe next step"
        )
    if first.text.startswith(RELEASED_AFTER_TRANSIENT):
        return (
            "never reached the provider: the first request was refused before it ran "
            "(a 5xx, a 429 or a refused connection), and nothing under its key was found"
        )
    return "nothing under its key was found at the provider"


def business_kinds() -> list[str]:
    """The kinds registered as operations (a checkout, a refund, a capture), not follow-ups."""
    return sorted(kind for kind, spec in registered_handlers().items() if spec.consumer is None)


def follow_up_kinds() -> list[str]:
    """The kinds registered as message handlers (the follow-ups of a paid order)."""
    return sorted(kind for kind, spec in registered_handlers().items() if spec.consumer is not None)


def external_kinds() -> list[str]:
    """The kinds whose handlers call an external system (a step under a claim and a key)."""
    return sorted(kind for kind, spec in registered_handlers().items() if spec.effects)


def moneyless_kinds() -> list[str]:
    """The kinds whose external steps all call systems that move no money (each system's
    declaration, `moves_money`): an amount in their params is not money at stake."""
    return sorted(
        kind
        for kind, spec in registered_handlers().items()
        if spec.effects and not any(system_of(e).moves_money for e in spec.effects.values())
    )


def follow_up_q() -> Q:
    """Follow-ups that only write the database: a message handler's, or one a parent step
    wrote whose kind calls no external system. One that calls a system (an export) can be
    uncertain or need review: the desk counts and lists it like any operation."""
    local = Q(parent__isnull=False) & ~Q(kind__in=external_kinds())
    return local | Q(kind__in=follow_up_kinds())


def follow_ups_not_succeeded(most: int) -> list[int]:
    """The ids of the follow-ups unfinished or failed, the newest `most` of each: what Needs
    attention counts as not succeeded, read as its counts are, through the partial indexes
    (payments_op_unfinished, payments_op_failed). Ids, not a condition: ORed, or under the
    list's ORDER BY id DESC LIMIT, the planner walks the primary key back through every
    succeeded row when fewer than a page match (the usual case: a few, or none)."""
    follow_ups = (
        Operation.objects.filter(follow_up_q()).order_by("-pk").values_list("pk", flat=True)
    )
    unfinished = follow_ups.filter(state__in=UNFINISHED_OPERATION_STATES)
    return [*unfinished[:most], *follow_ups.filter(state=OperationState.FAILED)[:most]]


#: How far back the desk's summaries count failed operations: failed is final, and every
#: decline of a year stays failed; the changelist's filter lists them all.
FAILED_WINDOW = timedelta(hours=24)


def recently_failed_q(now: datetime | None = None) -> Q:
    """Operations that failed within FAILED_WINDOW (a range of the failed ones' index)."""
    since = (now or timezone.now()) - FAILED_WINDOW
    return Q(state=OperationState.FAILED, updated_at__gte=since)


def stale_q(now: datetime | None = None) -> Q:
    """Running operations whose lease has run out: their worker died or hangs."""
    return Q(state=OperationState.RUNNING, lease_expires_at__lt=now or timezone.now())


def last_error_of(op: Operation) -> str:
    """The operation's last error, else the reason of its last audit row that gives one."""
    if op.last_error:
        return op.last_error
    last = (
        OperationEvent.objects.filter(operation=op)
        .exclude(reason="")
        .order_by("-created_at", "-id")
        .values_list("reason", flat=True)
        .first()
    )
    return last or ""


# --- queries of the desk ------------------------------------------------------------------


#: The most provider events listed on an operation's page (the newest).
PROVIDER_EVENTS_SHOWN = 50


def provider_events_of(op: Operation) -> list[dict[str, Any]]:
    """The provider events that touched `op` (webhooks and catch-up), oldest first, for its page."""
    rows = ProviderEvent.objects.filter(operation=op).order_by("-created", "-id")
    return [
        {
            "id": row.id,
            "type": row.type,
            "object": reference_link(row.object_id),
            "created": when(row.created),
            "received": when(row.received_at),
            "handled": when(row.handled_at),
            "outcome": row.outcome or "-",
        }
        for row in reversed(rows[:PROVIDER_EVENTS_SHOWN])
    ]


def money_by_state_and_kind(
    queryset: QuerySet[Operation],
) -> dict[str, dict[str, list[tuple[str, int]]]]:
    """Sum the params' amounts per state, kind and currency: {state: {kind: [(currency, n)]}}.

    Only operations whose params carry an integer amount count (a checkout or a
    refund does; a kind without money does not, nor one whose systems move none: an
    invoice's total is not money at stake). A refund's amount gives money back, a
    checkout's takes it: they are never added together.
    """
    rows = (
        queryset.exclude(kind__in=moneyless_kinds())
        .annotate(amount_text=KT("params__amount"), currency=Lower(KT("params__currency")))
        .filter(amount_text__regex=r"^[0-9]{1,18}$")
        .exclude(currency__isnull=True)
        .values("state", "kind", "currency")
        .annotate(total=Sum(Cast("amount_text", BigIntegerField())))
        .order_by("state", "kind", "currency")
    )
    totals: dict[str, dict[str, list[tuple[str, int]]]] = defaultdict(dict)
    for row in rows:
        by_kind = totals[row["state"]].setdefault(row["kind"], [])
        by_kind.append((row["currency"], int(row["total"] or 0)))
    return dict(totals)


def totals_by_kind(by_kind: dict[str, list[tuple[str, int]]], *, labelled: bool) -> list[str]:
    """One line per kind ("€25.00 checkout", "€6.00 refund"); without the kind unless `labelled`."""
    if not by_kind:
        return ["-"]
    return [
        f"{format_totals(totals)} {kind}" if labelled else format_totals(totals)
        for kind, totals in sorted(by_kind.items())
    ]


def counts_by_state(business: QuerySet[Operation], now: datetime | None = None) -> dict[str, int]:
    """Unfinished operations per state, and those failed within FAILED_WINDOW.

    Each set read through its partial index (unfinished, failed): never every
    operation, however long the history.
    """
    unfinished = business.filter(state__in=UNFINISHED_OPERATION_STATES)
    counts = dict(unfinished.values_list("state").annotate(n=Count("pk")))
    counts[OperationState.FAILED.value] = business.filter(recently_failed_q(now)).count()
    return counts


def desk_counts() -> list[dict[str, Any]]:
    """What the admin's home page shows of the desk: unfinished payments per state, and the
    payments that failed within FAILED_WINDOW."""
    business = Operation.objects.exclude(follow_up_q())
    now = timezone.now()
    counts = counts_by_state(business, now)
    changelist = reverse("admin:payments_operation_changelist")
    rows = [
        {"state": s, "label": state_label(s), "count": counts.get(s.value, 0),
         "url": f"{changelist}?state__exact={s.value}"}
        for s in OperationState
        if s != OperationState.SUCCEEDED
    ]  # fmt: skip
    unfinished = business.filter(state__in=UNFINISHED_OPERATION_STATES)
    rows.append(
        {"state": "stale", "label": "Stale (lease expired)",
         "count": unfinished.filter(stale_q(now)).count(), "url": f"{changelist}?lease=stale"}
    )  # fmt: skip
    return rows


def window_words() -> str:
    """FAILED_WINDOW in the desk's words: "24 h"."""
    return f"{int(FAILED_WINDOW.total_seconds() // 3600)} h"


def state_label(state: OperationState) -> str:
    """A state's label on the desk's summaries; failed says its window."""
    if state == OperationState.FAILED:
        return f"{state.label} (last {window_words()})"
    return str(state.label)
