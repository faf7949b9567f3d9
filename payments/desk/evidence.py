"""What the fence has seen of an unsettled step, and what happens next: evidence, not verdicts.

Every look at an unknown outcome (a same-key replay, a consistent list, a
retrieve, the desk's query) is kept on the claim: the object the provider
showed (`StepClaim.provider_view`) and how the last look went (`ClaimLook`:
in flight, unreadable, not found, when, how often, when the next is). The
desk words both here, once, for the operation page, the query's answer, the
mark-failed button and Needs attention, and gives every unsettled case its
next step: an action that can settle it, or a stated wait with its reason and
its time. When the provider's answers fail for several operations at once,
`incident()` sums them up for one banner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import BigIntegerField, Exists, Min, OuterRef, Q, QuerySet, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.text import Truncator

from payments.conf import payments_settings
from payments.desk.display import when
from payments.desk.views.queries import business_kinds, money_by_state_and_kind, totals_by_kind
from payments.engine import fence, recovery
from payments.engine.handlers import registered_handlers
from payments.engine.steps import claim_system, replay_allowed, replay_deadline, step_system
from payments.engine.systems import ExternalSystem, Read, system_named, system_of
from payments.exceptions import ConfigurationError
from payments.models import (
    INCIDENT_LOOKS,
    UNSETTLED_CLAIM_STATES,
    ClaimLook,
    LookShowed,
    Operation,
    OperationState,
    StepClaim,
)
from payments.money import format_money

#: How many operations waiting on unanswered looks make an incident (one banner).
INCIDENT_AT_LEAST = 3


def look_of(claim: StepClaim) -> ClaimLook | None:
    """The claim's look row, or None when nobody looked yet."""
    try:
        return claim.look
    except ClaimLook.DoesNotExist:
        return None


def _grace() -> timedelta:
    return timedelta(seconds=payments_settings().reconcile_grace)


def system_words(claim: StepClaim) -> ExternalSystem:
    """The declaration of the system the claim's step calls, for its words (the default
    system's when the operation's kind is no longer registered)."""
    try:
        return claim_system(claim)
    except ConfigurationError:
        return system_of(None)


def system_label(claim: StepClaim) -> str:
    """How the desk names the system the claim's step calls ("the provider", "Adyen")."""
    return system_words(claim).label


def operation_label(op: Operation) -> str:
    """How the desk names the system(s) an operation's external steps call: one label
    ("Adyen", "the accounting system"), or "each step's system" for several."""
    from payments.engine.handlers import registered_handlers  # handlers import the engine

    spec = registered_handlers().get(op.kind)
    labels: list[str] = []
    for step in spec.effects if spec is not None else ():
        try:
            system = step_system("", op.kind, step, op) or system_of(None)
        except ConfigurationError:
            system = system_of(None)
        if system.label not in labels:
            labels.append(system.label)
    if not labels:
        return system_of(None).label
    return labels[0] if len(labels) == 1 else "each step's system"


def query_title(op: Operation) -> str:
    """The look-up button of an operation, in its system's words ("Query Adyen now")."""
    return f"Query {operation_label(op)} now"


def _reads(claim: StepClaim) -> tuple[Read, ...]:
    """The reads the claim's system offers."""
    return system_words(claim).reads


def seen_words(claim: StepClaim) -> str:
    """What the step's system last showed for it, in the words its declaration gives ("" when
    it showed nothing yet)."""
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    if not view:
        return ""
    at = when(view.get("checked_at"))
    system = system_words(claim)
    if view.get("status") == "not_found":
        return f"{system.label}'s consistent list at {at} shows no {object_noun(claim)} for it"
    status = str(view.get("status") or view.get("outcome") or "unknown").replace("_", " ")
    amount = format_money(view.get("amount"), view.get("currency"))
    reference = str(view.get("reference") or "its object")
    money = f", {amount}" if amount != "-" else ""
    return f"{system.label} at {at} shows {reference} {status}{money}"


def look_words(look: ClaimLook) -> str:
    """How the last look went, in the system's own words."""
    who = system_label(look.claim)
    if not look.looks and look.hold:  # held before any look (a worker's key conflict)
        return f"not looked up: held for a person: {look.hold}"
    count = f"looked {look.looks} time{'s' if look.looks != 1 else ''}"
    source = "" if look.showed == LookShowed.NO_READ else f" ({look.source or 'a look'})"
    last = f"last at {when(look.last_look_at)}{source}"
    showed = LookShowed(look.showed).label.lower() if look.showed else "nothing"
    if look.in_flight_since:
        showed = f"a request under its key is in flight at {who} since {when(look.in_flight_since)}"
    elif look.showed == LookShowed.UNREADABLE and look.unread_since:
        showed = f"{who} has not answered since {when(look.unread_since)}"
    elif look.showed == LookShowed.NO_READ:
        showed = f"{who} offers no look-up"
    detail = f": {look.detail}" if look.detail and look.detail != showed else ""
    return f"{count}, {last}: {showed}{detail}"


def step_effect(claim: StepClaim) -> Any:
    """The effect class of the claim's step (None for a kind or step no longer registered)."""
    from payments.engine.handlers import registered_handlers  # handlers import the engine

    spec = registered_handlers().get(claim.operation.kind)
    return spec.effects.get(claim.step) if spec is not None else None


def object_noun(claim: StepClaim) -> str:
    """What the step makes at its system, in the desk's words: a refund's step makes a
    "refund" (its effect's AUDITED) at the payment provider, whose objects are "payments"."""
    return str(getattr(step_effect(claim), "AUDITED", "") or system_words(claim).object_noun)


def mark_failed_words(claim: StepClaim) -> str:
    """What marking the step failed does at its system, from its effect's `VOIDS`: the
    payment intent is cancelled; a system whose objects cannot be called back only has it
    checked that nothing was made."""
    if getattr(step_effect(claim), "VOIDS", ""):
        return f"it cancels what {system_label(claim)} holds"
    return (
        f"{system_label(claim)} cannot call it back: it is marked failed only when "
        f"{system_label(claim)} shows nothing made under its key, or a refusal"
    )


def no_handler(op: Operation) -> str:
    """Why the desk can do nothing for an operation whose kind no handler registers."""
    return (
        f"no handler is registered for kind {op.kind!r} in this deploy (renamed or removed?): "
        "nothing can be looked up, resumed or settled from here until a handler for that kind "
        "is registered again; its steps and audit trail are below"
    )


def next_step(op: Operation, claim: StepClaim, look: ClaimLook | None) -> str:
    """What happens next to this unsettled step: a stated wait (reason, time) or an action."""
    if claim.state not in UNSETTLED_CLAIM_STATES:
        return ""
    if op.kind not in registered_handlers():  # nothing looks, replays or settles it
        words = no_handler(op)
        return f"Nothing happens next: {words}."
    who = system_label(claim)
    if look is not None and look.hold:
        return (
            f"Held for a person: {look.hold}. The fence no longer looks; check {who}'s "
            "dashboard or report, then mark the step succeeded (with its reference) or failed."
        )
    next_look = (
        when(look.next_look_at) if look is not None and look.next_look_at else "its next round"
    )
    review_at = fence.last_request_at(claim) + _grace()
    if look is not None and look.in_flight_since:
        review_at = max(review_at, look.in_flight_since + _grace())
    reads = _reads(claim)
    after = "by reads only" if reads else "by its event or a person only (it offers no look-up)"
    replay = (
        f" Same-key replays are allowed until {when(replay_deadline(claim))}; after that it "
        f"is settled {after}."
        if replay_allowed(claim)
        else f" {who[:1].upper() + who[1:]} may no longer keep its key: it is settled {after}."
    )
    if not reads and op.state != OperationState.NEEDS_REVIEW and claim.provider_reference:
        return (
            f"Waiting for {who}'s event: it answered with {claim.provider_reference}, whose "
            f"outcome only its event tells (it offers no look-up). Unsettled at "
            f"{when(replay_deadline(claim))}, it goes to review."
        )
    if not reads and op.state != OperationState.NEEDS_REVIEW:
        return (
            f"Waiting: {who} offers no look-up, so the fence replays the request under the same "
            f"key (next at {next_look}) until {when(replay_deadline(claim))}, and its event "
            "settles it as soon as it comes; then it goes to review." + replay
        )
    if op.state == OperationState.NEEDS_REVIEW:
        return (
            f"Under review for want of a decisive answer. The fence keeps looking (next look at "
            f"{next_look}) and settles it by itself when {who} shows the outcome; or "
            "decide now from the evidence: mark the step succeeded (with the reference "
            f"{who} shows) or failed ({mark_failed_words(claim)})." + replay
        )
    if look is not None and look.in_flight_since:
        return (
            f"Waiting: a request under its key is in flight at {who} since "
            f"{when(look.in_flight_since)}; asked again at {when(look.last_look_at)}; next look "
            f"at {next_look}. {_to_review(review_at, 'it is still unknown at')}." + replay
        )
    if look is not None and look.showed == LookShowed.UNREADABLE:
        return (
            f"Waiting: {who} has not answered since {when(look.unread_since)}; next look "
            f"at {next_look}. {_to_review(review_at, 'it is still unknown at')}, and the fence "
            "keeps looking after that." + replay
        )
    return (
        f"Waiting: the reconciler looks again at {next_look}. "
        f"{_to_review(review_at, 'nothing decisive is shown by')}." + replay
    )


def _to_review(review_at: datetime, unless: str) -> str:
    """When the step goes to review: "If <unless> <time> it goes to review", or, the grace
    period over, at the next look (a look makes the move), never a time already past."""
    if review_at <= fence.db_now():
        return (
            f"The grace period ended at {when(review_at)}: it goes to review at its next look, "
            "unless that look settles it"
        )
    return f"If {unless} {when(review_at)} it goes to review"


def evidence_html(op: Operation) -> str:
    """The evidence of each unsettled step (what was seen, how the looks went) and its next step."""
    claims = StepClaim.objects.filter(
        operation=op, state__in=UNSETTLED_CLAIM_STATES
    ).select_related("look")
    items = []
    for claim in claims.order_by("claimed_at", "pk"):
        claim.operation = op  # the page's: its kind names the step's system, no query
        look = look_of(claim)
        seen = seen_words(claim)
        system = system_words(claim)
        how = (
            look_words(look)
            if look is not None
            else f"not looked up yet: “{query_title(op)}” asks {system_label(claim)}"
        )
        items.append(
            (
                claim.step,
                seen[:1].upper() + seen[1:] + "."
                if seen
                else f"No {object_noun(claim)} seen at {system.label} yet.",
                how[:1].upper() + how[1:] + ".",
                next_step(op, claim, look),
            )
        )
    if not items:
        return ""
    return format_html(
        '<ul class="desk-evidence">{}</ul>',
        format_html_join(
            "",
            '<li><strong>Step {}</strong>: {} <span class="quiet">{}</span>'
            '<br><span class="desk-next-step">{}</span></li>',
            items,
        ),
    )


@dataclass
class Incident:
    """Operations whose looks the provider does not answer now, for one banner."""

    since: datetime
    operations: int
    #: Of `operations`, those with a request in flight at the provider; the others
    #: (`unreadable`) got no answer at their last look.
    in_flight: int
    unreadable: int
    #: Their money, one line per kind ("€25.00 checkout"), as the states' totals give it.
    money: list[str] = field(default_factory=list)
    next_look: datetime | None = None
    #: The systems that do not answer, by label ("the provider", "Adyen").
    systems: list[str] = field(default_factory=list)

    @property
    def who(self) -> str:
        """ "the provider", "Adyen and the accounting system" """
        return " and ".join(self.systems) or system_of(None).label


def incident() -> Incident | None:
    """The provider incident now: operations whose last look went unanswered, or None.

    Uncertain and under-review operations (the partial index over unfinished
    ones) with an unsettled step whose last look the provider did not answer
    (in flight or unreadable, not held for a person); an incident is at least
    INCIDENT_AT_LEAST of them. Every figure counts those operations, all of
    them: how many have a request in flight (the others are unanswered), their
    money per kind as the states' totals add it, the first and next looks.
    """
    unanswered = ClaimLook.objects.filter(
        Q(showed__in=INCIDENT_LOOKS) | Q(in_flight_since__isnull=False),
        claim__operation=OuterRef("pk"),
        claim__state__in=UNSETTLED_CLAIM_STATES,
        hold="",
    )
    waiting = Operation.objects.filter(
        state__in=(OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW)
    ).filter(Exists(unanswered))
    operations = waiting.count()
    if operations < INCIDENT_AT_LEAST:
        return None
    in_flight = waiting.filter(Exists(unanswered.filter(in_flight_since__isnull=False))).count()
    looks = ClaimLook.objects.filter(
        Q(showed__in=INCIDENT_LOOKS) | Q(in_flight_since__isnull=False),
        claim__operation__in=waiting.values("pk"),
        claim__state__in=UNSETTLED_CLAIM_STATES,
        hold="",
    )
    names = set(looks.order_by().values_list("claim__system", flat=True).distinct())
    first = looks.aggregate(
        unread=Min("unread_since"),
        flight=Min("in_flight_since"),
        looked=Min("first_look_at"),
        next=Min("next_look_at"),
    )
    since = min(d for d in (first["unread"], first["flight"], first["looked"]) if d is not None)
    return Incident(
        since=since,
        operations=operations,
        in_flight=in_flight,
        unreadable=operations - in_flight,
        money=money_at_stake(waiting),
        next_look=first["next"],
        systems=sorted({_label_of(name) for name in names}),
    )


def _label_of(name: str) -> str:
    """A recorded system's label; a claim older than the column, or a system no longer
    declared, reads as the default system's."""
    try:
        return system_named(name).label if name else system_of(None).label
    except ConfigurationError:
        return name


def money_at_stake(operations: QuerySet[Operation]) -> list[str]:
    """The operations' money, one line per kind as the states' totals give it ("€25.00
    checkout"): a refund's is never added to a charge's, a kind that moves none counts none."""
    by_kind: dict[str, dict[str, int]] = {}
    for kinds in money_by_state_and_kind(operations).values():
        for kind, totals in kinds.items():
            for currency, total in totals:
                by_kind.setdefault(kind, {})
                by_kind[kind][currency] = by_kind[kind].get(currency, 0) + total
    shown = {kind: sorted(totals.items()) for kind, totals in by_kind.items()}
    return [] if not shown else totals_by_kind(shown, labelled=len(business_kinds()) > 1)


def incident_html(found: Incident | None, *, list_url: str = "", need_a_person: int = 0) -> str:
    """The incident banner ("" when there is none). `need_a_person`: the operations the
    fence gave up on before anything ran (a page that lists them below says how many), which
    unlike the waiting ones will not settle by themselves."""
    if found is None:
        return ""
    money = " and ".join(found.money) or "no amount"
    link = format_html(' <a href="{}">See them</a>.', list_url) if list_url else ""
    if need_a_person:
        waits = "operation failed" if need_a_person == 1 else "operations failed"
        verb = "waits" if need_a_person == 1 else "wait"
        link = format_html(
            "{} {} {} before anything ran and {} for a person: a new attempt, where it is still "
            "wanted (in the cases below).",
            link,
            need_a_person,
            waits,
            verb,
        )
    # Looks that each wait out the system's timeouts fall behind: a next look already past
    # is due, not "at" a time gone by.
    if found.next_look is not None and found.next_look < timezone.now():
        next_look = format_html(
            "the next look has been due since {}: {}'s answers are slow",
            when(found.next_look),
            found.who,
        )
    else:
        next_look = format_html("next look at {}", when(found.next_look))
    return format_html(
        '<div class="desk-incident" role="alert" style="margin:0 0 12px;padding:10px 14px;'
        'border-left:6px solid #b02a37;background:#fdf1f2;color:#000;overflow-wrap:anywhere">'
        "<strong>Incident at {} since {}</strong>: "
        "{} operations wait for an answer ({} with a request in flight there, {} "
        "unanswered), {} at stake. The fence keeps looking ({}) and settles each "
        "one as soon as it is answered; nothing needs pressing for them.{}</div>",
        found.who,
        when(found.since),
        found.operations,
        found.in_flight,
        found.unreadable,
        money,
        next_look,
        link,
    )


#: A query's outcomes by what they did: settled something, read without deciding, not read,
#: or nothing to ask (a finished operation in the selection). A worker's live lease, or a
#: time budget spent, leaves an operation not read.
SETTLED_OUTCOMES = frozenset({"done", "failed", "reversed", "already_settled"})
NOT_READ_OUTCOMES = frozenset({"retry_later", "busy", "not_asked", "error", "no_handler"})
#: How a read-only look (recovery.look_up, of an operation a worker may still run) words a
#: step its system did not answer about.
LOOKUP_FAILED = f": {recovery.LOOKUP_FAILED} ("
NOTHING_OUTCOMES = frozenset({"nothing_to_settle"})
#: How `query_kind` names each, and how a bulk query's line starts.
QUERY_KINDS = {
    "settled": "Settled",
    "waiting": "Still waiting",
    "not-read": "Not read",
    "nothing": "Nothing to settle",
}


def query_kind(outcome: str) -> str:
    """Which of QUERY_KINDS a look-up's outcome is. Not read: its system did not answer
    (about any of the steps of a read-only look too), the look failed, no handler can ask,
    or a worker holds the operation under its live lease ("held by ... not queried")."""
    if outcome in SETTLED_OUTCOMES:
        return "settled"
    if outcome in NOT_READ_OUTCOMES or outcome.startswith("held by ") or LOOKUP_FAILED in outcome:
        return "not-read"
    if outcome in NOTHING_OUTCOMES:
        return "nothing"
    return "waiting"


def query_tally(outcomes: list[str]) -> str:
    """A bulk query's result in counts: "2 settled, 5 still waiting, 1 not read", then
    ", 3 with nothing to settle" when finished operations were among those selected."""
    kinds = [query_kind(o) for o in outcomes]
    tally = (
        f"{kinds.count('settled')} settled, {kinds.count('waiting')} still waiting, "
        f"{kinds.count('not-read')} not read"
    )
    nothing = kinds.count("nothing")
    return f"{tally}, {nothing} with nothing to settle" if nothing else tally


def after_query(operation_id: int) -> str:
    """What the last look at the operation's unsettled steps saw, and when the next is ("")."""
    claims = StepClaim.objects.filter(
        operation_id=operation_id, state__in=UNSETTLED_CLAIM_STATES
    ).select_related("look")
    words = []
    for claim in claims:
        look = look_of(claim)
        if look is None:
            continue
        said = f"{claim.step}: {LookShowed(look.showed).label.lower()}"
        if look.detail:
            said += f" ({Truncator(look.detail).chars(200)})"
        if look.next_look_at and not look.hold:
            said += f"; the fence looks again at {when(look.next_look_at)}"
        words.append(said)
    return "; ".join(words)


def why_waiting(operation_ids: list[int]) -> dict[int, str]:
    """Each operation's latest look at an unsettled step, in a line (the case lists' "why")."""
    looks = (
        ClaimLook.objects.filter(
            claim__operation_id__in=operation_ids, claim__state__in=UNSETTLED_CLAIM_STATES
        )
        .select_related("claim__operation")  # its kind names a legacy claim's system
        .order_by("last_look_at")
    )
    said: dict[int, str] = {}
    for look in looks:
        said[look.claim.operation_id] = f"{look.claim.step}: {look_line(look)}"
    return said


def look_line(look: ClaimLook) -> str:
    """The last look in one short line, for lists: what it showed, since when, the next look."""
    claim = look.claim
    who = system_label(claim)
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    if look.in_flight_since:
        shown = f"a request in flight at {who} since {when(look.in_flight_since)}"
    elif look.showed == LookShowed.UNREADABLE:
        shown = f"no answer from {who} since {when(look.unread_since)}"
    elif look.showed == LookShowed.NO_READ:
        shown = f"{who} offers no look-up; replays until {when(replay_deadline(claim))}"
    elif look.showed == LookShowed.OBJECT and view.get("reference"):
        status = str(view.get("status") or "").replace("_", " ")
        shown = f"{who} shows {view['reference']} {status}".strip()
    else:
        shown = LookShowed(look.showed).label.lower()
    count = f"{look.looks} look{'s' if look.looks != 1 else ''}"
    if look.hold:
        return f"{shown} ({count}; held for a person: {look.hold[:120]})"
    upcoming = f"; next look {when(look.next_look_at)}" if look.next_look_at else ""
    return f"{shown} ({count}{upcoming})"


def taken_not_settled() -> list[str]:
    """What the systems showed done for steps not settled yet, one line per kind, as the
    states' totals word it ("€74.50 checkout", "€6.00 refund": a refund is never added to
    a charge). Every such step counts: summed in the database by kind and currency, over
    the unsettled claims (their partial index), an amount that is not a whole number of
    minor units left out."""
    sums = (
        StepClaim.objects.filter(
            state__in=UNSETTLED_CLAIM_STATES,
            provider_view__status="succeeded",
            provider_view__currency__regex=r"\S",
            provider_view__amount__regex=r"^-?[0-9]{1,18}$",
        )
        .values("operation__kind", currency=KT("provider_view__currency"))
        .annotate(total=Sum(Cast(KT("provider_view__amount"), BigIntegerField())))
        .values_list("operation__kind", "currency", "total")
    )
    by_kind: dict[str, dict[str, int]] = {}
    for kind, currency, total in sums:  # one row per kind and currency
        by_kind.setdefault(kind, {})[currency] = int(total)
    if not by_kind:
        return []
    shown = {kind: sorted(totals.items()) for kind, totals in by_kind.items()}
    return totals_by_kind(shown, labelled=True)
