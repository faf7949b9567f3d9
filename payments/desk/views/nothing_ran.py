"""The cases an outage leaves: operations failed before anything ran, and what the desk
does not list of them.

Every try of a step refused before it executed (a 5xx that did nothing, a
refused connection), the fence gave up: nothing happened at the system, and
nothing is uncertain, but a refund is still owed or a charge still wanted.
Needs attention lists those of the last FAILED_WINDOW, the newest
FAILED_BEFORE_RUNNING_MOST, and says what it leaves out (how many more, and
whether older ones exist): the window through the failed operations' index,
the older ones through the index of the claims that gave up: never the history.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Exists, OuterRef, Q, QuerySet

from payments.desk.views.queries import FAILED_WINDOW, recently_failed_q
from payments.engine.fence import GAVE_UP_BEFORE_RUNNING
from payments.models import ClaimState, Operation, OperationState, StepClaim

#: The most operations failed before running that Needs attention lists (the newest).
FAILED_BEFORE_RUNNING_MOST = 1000
#: How many more of them, past the ones listed, Needs attention counts (past it: "or more").
NOT_LISTED_COUNTED = 10_000


def failed_before_running_q() -> Q:
    """Failed operations whose fence gave up on a step whose every try was refused before it
    executed (an outage), no external step of them done, and no new attempt nor other
    operation of its kind for its entity asked for since (one not failed): nothing happened
    at the system, and the business's intent (a refund owed, a charge wanted) is not met. A
    case for a person: a new attempt, or leave it. Of any age: filter the rows first (a
    window of the failed ones' index), each one's claims then read through its own index.
    """
    gave_up = StepClaim.objects.filter(
        operation=OuterRef("pk"),
        state=ClaimState.FAILED,
        error__startswith=GAVE_UP_BEFORE_RUNNING,
    )
    # A step that did take effect (a hold later released by the compensation): something
    # ran, and a new attempt is not the plain answer; the operation's page says what ran.
    moved = StepClaim.objects.filter(operation=OuterRef("pk"), state=ClaimState.DONE).exclude(
        idempotency_key=""
    )
    retried = Operation.objects.filter(retry_of=OuterRef("pk"))
    # Asked again since under a new key, by the API or the desk's own form (not a "new
    # attempt", so no retry_of): the intent is being met; listing it would invite a second
    # refund of the same money.
    asked_again = Operation.objects.filter(
        kind=OuterRef("kind"),
        entity_type=OuterRef("entity_type"),
        entity_id=OuterRef("entity_id"),
        created_at__gt=OuterRef("created_at"),
    ).exclude(state=OperationState.FAILED)
    return (
        Q(state=OperationState.FAILED)
        & Q(Exists(gave_up))
        & ~Q(Exists(moved))
        & ~Q(Exists(retried))
        & ~Q(Exists(asked_again))
    )


def gave_up_ids() -> QuerySet[StepClaim, Any]:
    """The operation ids of the claims the fence gave up on before anything ran, read
    through their partial index (`payments_claim_gave_up`, a few per outage): where the
    cases of any age are looked for first, never the year's failed operations."""
    return StepClaim.objects.filter(
        state=ClaimState.FAILED, error__startswith=GAVE_UP_BEFORE_RUNNING
    ).values("operation_id")


def failed_before_running(
    now: datetime | None = None, among: QuerySet[Operation] | None = None
) -> list[int]:
    """The ids of the operations of `among` (all, by default) failed before running
    (`failed_before_running_q`) within FAILED_WINDOW, the newest FAILED_BEFORE_RUNNING_MOST:
    read from the recently failed ones (their partial index), never a scan of the claims (an
    EXISTS inside the cases' OR would be hashed over the whole table)."""
    recent = (among if among is not None else Operation.objects.all()).filter(
        recently_failed_q(now)
    )
    return list(
        recent.filter(failed_before_running_q())
        .order_by("-updated_at")
        .values_list("pk", flat=True)[:FAILED_BEFORE_RUNNING_MOST]
    )


@dataclass(frozen=True)
class NotListed:
    """The operations failed before running that `failed_before_running` leaves out."""

    #: Failed within FAILED_WINDOW past the newest listed, counted up to NOT_LISTED_COUNTED.
    more: int = 0
    #: One failed before FAILED_WINDOW (of any age).
    older: bool = False

    @property
    def more_words(self) -> str:
        """ "3 more", "10,000 or more"."""
        return (
            f"{self.more:,} or more" if self.more >= NOT_LISTED_COUNTED else f"{self.more:,} more"
        )


def failed_before_running_not_listed(
    among: QuerySet[Operation], now: datetime, *, listed: int
) -> NotListed:
    """What `failed_before_running(now, among)`, which listed `listed`, leaves out: the rest of
    the window (counted only when the list is full, and only so far), and whether an older one
    exists, of any age: looked for from the claims that gave up (`gave_up_ids`)."""
    more = 0
    if listed >= FAILED_BEFORE_RUNNING_MOST:
        window = among.filter(recently_failed_q(now)).filter(failed_before_running_q())
        counted = window.order_by().values("pk")[: listed + NOT_LISTED_COUNTED].count()
        more = counted - listed
    older = (
        among.filter(pk__in=gave_up_ids(), updated_at__lt=now - FAILED_WINDOW)
        .filter(failed_before_running_q())
        .exists()
    )
    return NotListed(more=more, older=older)
