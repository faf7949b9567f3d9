"""A provider incident in the chaos run: minutes of answers held in flight or dropped.

Once a third of the orders are in, the fake provider holds every new request in
flight until the incident ends (a same-key request meanwhile is answered
`409 idempotency_key_in_use`) and drops a share of the answers instead
(`POST /_fake/incident`). At its midpoint the run reads what the desk would show
(each order whose money the provider took: recorded, shown with its intent and
amount, or not shown); after it, how the operations it caught ended: the audit
rows each wrote (most, median), those settled without a person, and how long
after the provider answered again the last one settled.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime

import requests
from django.db.models import Count, F, Max, Q
from django.utils import timezone

from payments.captures.effects import AUTHORIZE
from payments.checkout.names import CHARGE
from payments.models import (
    FINAL_OPERATION_STATES,
    ClaimLook,
    ClaimState,
    Operation,
    OperationEvent,
    StepClaim,
)
from payments.provider.client import ProviderClient

#: How long after the incident its operations may take to settle before the run says so.
RECOVERY_PATIENCE = 120.0


@dataclass
class IncidentFigures:
    """What the incident did, for the report (every figure measured, none assumed)."""

    seconds: float
    drop_rate: float
    started_at: datetime | None = None
    ended_at: datetime | None = None
    #: At the midpoint: operations whose money the provider had taken, by what the desk showed.
    taken_at_midpoint: int = 0
    recorded_at_midpoint: int = 0
    shown_at_midpoint: int = 0
    not_shown_at_midpoint: list[str] = field(default_factory=list)
    #: Of those not shown at the midpoint, still not shown one look later (3 s).
    not_shown_after_a_look: list[str] = field(default_factory=list)
    #: The operations the incident caught (looked at while it ran) and how they ended.
    caught: int = 0
    settled_after: int = 0
    left_for_a_person: list[str] = field(default_factory=list)
    audit_rows_most: int = 0
    audit_rows_median: float = 0.0
    #: Rows the caught operations wrote while the incident ran (most, median), and how many
    #: of all those changed no state (an owner taking over, a worker releasing).
    rows_during_most: int = 0
    rows_during_median: float = 0.0
    rows_during_unchanged: int = 0
    last_settled_after_recovery_s: float | None = None

    def as_report(self) -> dict[str, object]:
        """The figures as JSON can keep them (times as ISO 8601)."""
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in asdict(self).items()}

    def rows(self) -> list[tuple[str, object]]:
        """The report's lines."""
        return [
            ("provider incident (s) / answers dropped", f"{self.seconds:g} / {self.drop_rate:.0%}"),
            ("  operations caught by it", self.caught),
            ("  audit rows per caught operation, its whole life (most / median)",
             f"{self.audit_rows_most} / {self.audit_rows_median:g}"),
            ("  audit rows per caught operation during it (most / median)",
             f"{self.rows_during_most} / {self.rows_during_median:g}"),
            ("    of all those, rows that changed no state", self.rows_during_unchanged),
            ("  at its midpoint: money taken at the provider", self.taken_at_midpoint),
            ("    recorded / shown with its intent / not shown",
             f"{self.recorded_at_midpoint} / {self.shown_at_midpoint} / "
             f"{len(self.not_shown_at_midpoint)}"),
            ("    not shown one look (3 s) later", len(self.not_shown_after_a_look)),
            ("  settled after it without a person", f"{self.settled_after} of {self.caught}"),
            ("  last settled (s after the provider answered)",
             "-" if self.last_settled_after_recovery_s is None
             else f"{self.last_settled_after_recovery_s:.1f}"),
            ("  left for a person", len(self.left_for_a_person)),
        ]  # fmt: skip


class ProviderIncident(threading.Thread):
    """Start the incident when `due()` says so, read the desk's evidence at its midpoint."""

    def __init__(
        self,
        provider_url: str,
        figures: IncidentFigures,
        *,
        due: Callable[[], bool],
        prefix: str,
        stop: threading.Event,
        say: Callable[[str], None],
        client: ProviderClient,
    ) -> None:
        super().__init__(daemon=True, name="provider-incident")
        self.provider_url = provider_url
        self.figures = figures
        self.due = due
        self.prefix = prefix
        self.stop = stop
        self.say = say
        self.client = client
        self.ended = threading.Event()

    def run(self) -> None:
        while not self.due():
            if self.stop.wait(0.2):
                return
        f = self.figures
        requests.post(
            f"{self.provider_url}/_fake/incident",
            json={"seconds": f.seconds, "drop_rate": f.drop_rate},
            timeout=5,
        ).raise_for_status()
        f.started_at = timezone.now()
        self.say(
            f"  provider incident: every new request held in flight for {f.seconds:g} s, "
            f"{f.drop_rate:.0%} of answers dropped"
        )
        if not self.stop.wait(f.seconds / 2):
            self._midpoint()
            if not self.stop.wait(3):
                f.not_shown_after_a_look = [
                    key for key in f.not_shown_at_midpoint if not self._shown(key)
                ]
        self.stop.wait(max(f.seconds / 2 - 3, 0))
        f.ended_at = timezone.now()
        self.say("  provider incident over: the provider answers again")
        self.ended.set()

    def _midpoint(self) -> None:
        """What the desk shows now of each order whose money the provider took."""
        f = self.figures
        taken = {
            str(pi.metadata.get("operation_key")): pi.id
            for pi in self.client.list_payment_intents()
            if pi.status == "succeeded"
            and str(pi.metadata.get("operation_key", "")).startswith(self.prefix)
        }
        # An order's later attempt charges the same intent: recorded when any step carries it.
        recorded = set(
            StepClaim.objects.filter(
                provider_reference__in=list(taken.values()), state=ClaimState.DONE
            )
            .exclude(provider_reference="")
            .values_list("provider_reference", flat=True)
        )
        for key, reference in taken.items():
            f.taken_at_midpoint += 1
            if reference in recorded:
                f.recorded_at_midpoint += 1
            elif self._shown(key):
                f.shown_at_midpoint += 1
            else:
                f.not_shown_at_midpoint.append(key)

    def _shown(self, key: str) -> bool:
        """Tell whether the operation's page shows its money: recorded, or the intent seen."""
        claims = StepClaim.objects.filter(operation__key=key, step__in=(CHARGE, AUTHORIZE))
        for claim in claims:
            view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
            if claim.state == ClaimState.DONE:
                return True
            if view.get("reference") and view.get("amount") is not None:
                return True
        return False


def settle_figures(figures: IncidentFigures, prefix: str, *, patience: float) -> None:
    """Wait (up to `patience` s) for what the incident caught to settle; measure how it did."""
    f = figures
    if f.started_at is None or f.ended_at is None:
        return
    looked = ClaimLook.objects.filter(
        claim__operation__key__startswith=prefix,
        first_look_at__gte=f.started_at,
        first_look_at__lte=f.ended_at,
    ).values_list("claim__operation_id", flat=True)
    caught = sorted(set(looked))
    f.caught = len(caught)
    ops = Operation.objects.filter(pk__in=caught)
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if not ops.exclude(state__in=FINAL_OPERATION_STATES).exists():
            break
        time.sleep(1)
    f.settled_after = ops.filter(state__in=FINAL_OPERATION_STATES).count()
    f.left_for_a_person = list(
        ops.exclude(state__in=FINAL_OPERATION_STATES).values_list("key", flat=True)
    )
    rows = list(
        OperationEvent.objects.filter(operation_id__in=caught)
        .values("operation_id")
        .annotate(n=Count("id"))
        .values_list("n", flat=True)
    )
    f.audit_rows_most = max(rows, default=0)
    f.audit_rows_median = statistics.median(rows) if rows else 0
    during = OperationEvent.objects.filter(
        operation_id__in=caught, created_at__gte=f.started_at, created_at__lte=f.ended_at
    )
    per_op = list(during.values("operation_id").annotate(n=Count("id")).values_list("n", flat=True))
    f.rows_during_most = max(per_op, default=0)
    f.rows_during_median = statistics.median(per_op) if per_op else 0
    f.rows_during_unchanged = during.filter(from_state=F("to_state")).count()
    last = (
        OperationEvent.objects.filter(operation_id__in=caught)
        .filter(Q(to_state__in=list(FINAL_OPERATION_STATES)), step="")
        .aggregate(last=Max("created_at"))["last"]
    )
    if last is not None:
        f.last_settled_after_recovery_s = max((last - f.ended_at).total_seconds(), 0.0)
