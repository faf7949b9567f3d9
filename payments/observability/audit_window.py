"""`fence_audit` over a window of any length in the memory of one day.

The window is audited one day at a time: that day's payments and refunds are
listed at the system (its declared `ledger`: one listing each, by `created`), that day's claims
read through the primary key (a range of ids found by bisection: a claim's
id grows with its `claimed_at`), judged by `audit` and `audit_refunds`, and
only totals and the first findings are kept. After each day the checkpoint
moves to that day's end, so that a run stopped half-way is resumed by the
next `--since last` where it stopped.

What a day cannot see: two successes for one order on different days (each
day's is fenced by its own claim: the per-step check still finds a second
success for one step, as its claim carries the other reference), and a
payment's refunds spread over several days (each day's are judged against
the whole charge).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q

from payments.engine.history import first_id_from
from payments.engine.systems import DEFAULT_SYSTEM, Ledger, LedgerEntry
from payments.models import StepClaim
from payments.observability.audit import AuditResult, RefundAuditResult, audit, audit_refunds

#: Payments and refunds are listed this much beyond each day on both sides: the
#: provider's clock and ours differ, and a claim of the day must find its object.
CLOCK_MARGIN = timedelta(minutes=5)
DAY = timedelta(days=1)
#: The findings of each kind kept in the stored summary (and printed); the counts are whole.
TOP_FINDINGS = 50

FINDING_KINDS = (
    "double_charges",
    "double_charged_entities",
    "unfenced",
    "unknown_references",
    "stale_uncertain",
)
REFUND_FINDING_KINDS = ("double_refunds", "over_refunds", "unfenced", "unknown_references")


def days(start: datetime, end: datetime) -> Iterator[tuple[datetime, datetime]]:
    """[start, end) in consecutive spans of at most one day."""
    while start < end:
        yield start, min(start + DAY, end)
        start += DAY


def first_claim_id_from(moment: datetime) -> int:
    """An id splitting the claims at `moment` (payments.engine.history: ids grow with
    `claimed_at`, a bisection of the primary key instead of a scan)."""
    return first_id_from(StepClaim, "claimed_at", moment)


def claims_of(start: datetime, end: datetime) -> Q:
    """Claims claimed in [start, end), through a range of the primary key."""
    first = first_claim_id_from(start - CLOCK_MARGIN)
    after = first_claim_id_from(end + CLOCK_MARGIN)
    return Q(id__gte=first, id__lt=after, claimed_at__gte=start, claimed_at__lt=end)


@dataclass
class Findings:
    """A count per kind of finding, and the first TOP_FINDINGS of each."""

    counts: dict[str, int] = field(default_factory=dict)
    top: dict[str, list[Any]] = field(default_factory=dict)

    def add(self, kind: str, items: list[Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + len(items)
        kept = self.top.setdefault(kind, [])
        kept.extend(items[: max(0, TOP_FINDINGS - len(kept))])

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class WindowAudit:
    """What the days of a window added up to."""

    charges: Findings = field(default_factory=Findings)
    refunds: Findings = field(default_factory=Findings)
    provider_successes: int = 0
    done_claims: int = 0
    provider_refunds: int = 0
    done_refund_claims: int = 0
    intents_listed: int = 0
    refunds_listed: int = 0
    days: int = 0
    #: reference -> "operation_key/step", for the kept findings only.
    steps: dict[str, str] = field(default_factory=dict)
    #: Findings that money given back can settle (double charges, unfenced payments), in
    #: the order found: (kind, item, references), judged when read (`_judged`), once every
    #: day's refunds are in.
    pending: list[tuple[str, Any, list[str]]] = field(default_factory=list)
    #: What each payment of a pending finding charged, and its succeeded refunds by id (listed
    #: on its day or a later one, as a refund follows its payment; by id, since a refund in
    #: the margin between two days is listed on both).
    charged: dict[str, int] = field(default_factory=dict)
    refunds_of_pending: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: "operation_key/step" of the pending findings' references (the summary keeps those of
    #: the references it shows only).
    pending_steps: dict[str, str] = field(default_factory=dict)

    def _judged(self) -> tuple[Findings, list[str], list[Any]]:
        """The charges' findings, the pending ones judged by the refunds listed so far, and
        the payments refunded in full that were findings (not findings any more), and the
        double-charged entities those settled (the order page still marks the duplicate). A
        double charge is open while more than one of its payments keeps money; an unfenced
        payment while it keeps any."""
        findings = Findings(
            dict(self.charges.counts), {k: list(v) for k, v in self.charges.top.items()}
        )
        refunded: dict[str, int] = defaultdict(int)
        for paid, amount in self.refunds_of_pending.values():
            refunded[paid] += amount
        back: dict[str, None] = {}  # in the order found, once each
        entities: list[Any] = []
        for kind, item, references in self.pending:
            # A payment of no known amount keeps its finding (nothing to give back in full).
            kept = [r for r in references if refunded.get(r, 0) < max(self.charged.get(r, 0), 1)]
            if len(kept) > (1 if kind != "unfenced" else 0):
                findings.add(kind, [item])
                continue
            back.update((r, None) for r in references if r not in kept)
            if kind == "double_charged_entities":
                entities.append(item)
        return findings, list(back), entities

    @property
    def findings(self) -> int:
        return self._judged()[0].total + self.refunds.total

    @property
    def clean(self) -> bool:
        return self.findings == 0

    def add_day(self, day: DayAudit) -> None:
        """Add one day's results (only the findings about the day's own objects: one
        listed in the margin is the neighbouring day's)."""
        self.days += 1
        self.intents_listed += day.intents_listed
        self.refunds_listed += day.refunds_listed
        self.provider_successes += day.provider_successes
        self.done_claims += day.charges.done_claims
        self.provider_refunds += day.refunds.provider_refunds
        self.done_refund_claims += day.refunds.done_claims
        found, owned = day.charges.as_dict(), day.owned
        pending: list[tuple[str, Any, list[str]]] = []
        for kind in ("double_charges", "double_charged_entities"):
            items: list[dict[str, Any]] = found[kind]  # type: ignore[assignment]
            pending += [
                (kind, d, list(d["references"])) for d in items if owned(min(d["references"]))
            ]
        pending += [("unfenced", r, [r]) for r in day.charges.unfenced if owned(r)]
        self.pending += pending
        self.charged.update({r: day.charged.get(r, 0) for _, _, refs in pending for r in refs})
        self.refunds_of_pending.update(
            {rid: paid for rid, paid in day.succeeded_refunds.items() if paid[0] in self.charged}
        )
        self.charges.add("unknown_references", day.charges.unknown_references)
        judged = day.refunds.as_dict()
        for kind in REFUND_FINDING_KINDS:
            self.refunds.add(kind, list(judged[kind]))  # type: ignore[call-overload]
        named = set(_references([v for items in self.charges.top.values() for v in items]))
        self.steps.update({r: w for r, w in day.charges.steps.items() if r in named})
        mine = {r for _, _, refs in pending for r in refs}
        self.pending_steps.update({r: w for r, w in day.charges.steps.items() if r in mine})

    def add_stale(self, stale: list[str]) -> None:
        """The uncertain claims past the grace period, judged once for the whole run."""
        self.charges.add("stale_uncertain", stale)

    def as_summary(self) -> dict[str, Any]:
        """The stored summary: counts, and the first findings of each kind."""
        charges, back, entities = self._judged()  # once: `findings` and `clean` judge again
        findings = charges.total + self.refunds.total
        shown = {*back[:TOP_FINDINGS]}
        shown.update(_references([v for items in charges.top.values() for v in items]))
        steps = {**self.steps, **{r: w for r, w in self.pending_steps.items() if r in shown}}
        return {
            "clean": findings == 0,
            "findings": findings,
            "provider_successes": self.provider_successes,
            "done_claims": self.done_claims,
            **{kind: charges.top.get(kind, []) for kind in FINDING_KINDS},
            "counts": {kind: charges.counts.get(kind, 0) for kind in FINDING_KINDS},
            # Payments that were findings and were given back in full: not findings.
            "refunded_in_full": back[:TOP_FINDINGS],
            "refunded_in_full_count": len(back),
            "refunded_in_full_entities": entities[:TOP_FINDINGS],
            "steps": dict(sorted(steps.items())),
            "refunds": {
                "clean": self.refunds.total == 0,
                "findings": self.refunds.total,
                "provider_refunds": self.provider_refunds,
                "done_claims": self.done_refund_claims,
                **{kind: self.refunds.top.get(kind, []) for kind in REFUND_FINDING_KINDS},
                "counts": {kind: self.refunds.counts.get(kind, 0) for kind in REFUND_FINDING_KINDS},
            },
            "intents_listed": self.intents_listed,
            "refunds_listed": self.refunds_listed,
            "days": self.days,
            "top_findings": TOP_FINDINGS,
        }


def _references(items: list[Any]) -> Iterator[str]:
    for item in items:
        if isinstance(item, dict):
            yield from (str(r) for r in item.get("references", []))
        else:
            yield str(item)


@dataclass
class DayAudit:
    """One day's results, and which references are the day's own (not the margin's)."""

    charges: AuditResult
    refunds: RefundAuditResult
    owned: Callable[[str], bool]
    provider_successes: int
    intents_listed: int
    refunds_listed: int
    #: What each payment listed charged, and the succeeded refunds listed: id -> (payment,
    #: amount).
    charged: dict[str, int] = field(default_factory=dict)
    succeeded_refunds: dict[str, tuple[str, int]] = field(default_factory=dict)


def audit_day(
    ledger: Callable[[int, int], Ledger],
    start: datetime,
    end: datetime,
    *,
    first: bool,
    last: bool,
    system: str = DEFAULT_SYSTEM,
) -> DayAudit:
    """Audit `system`'s claims of [start, end) against its objects of that day (`ledger`:
    its declaration's). A claim older than the claims' system column is the default
    system's; another system's claims are judged against its own ledger, never this one."""
    listed_from = int((start - CLOCK_MARGIN).timestamp())
    listed_to = int((end + CLOCK_MARGIN).timestamp())
    listed = ledger(listed_from, listed_to)
    payments, refunds = listed.payments, listed.refunds
    mine = ("", system) if system == DEFAULT_SYSTEM else (system,)
    day = claims_of(start, end) & Q(system__in=mine)
    # Stale uncertain claims are judged once per run (whatever their age), not per day.
    charges = audit(payments, day, stale_claims=Q(pk__in=[]))
    charged = {payment.id: payment.amount for payment in payments}
    refunds_of: dict[str, list[LedgerEntry]] = {}
    for refund in refunds:
        refunds_of.setdefault(refund.parent, []).append(refund)
    judged = audit_refunds(refunds_of, charged, day, judge_all=True)
    own_from = listed_from if first else int(start.timestamp())
    own_to = listed_to + 1 if last else int(end.timestamp())
    created = {payment.id: payment.created for payment in payments}

    def owned(reference: str) -> bool:
        when = created.get(reference)
        return when is None or own_from <= when < own_to

    return DayAudit(
        charges=charges,
        refunds=judged,
        owned=owned,
        provider_successes=sum(1 for p in payments if p.succeeded and owned(p.id)),
        intents_listed=len(payments),
        refunds_listed=len(refunds),
        charged=charged,
        succeeded_refunds={r.id: (r.parent, r.amount) for r in refunds if r.succeeded},
    )
