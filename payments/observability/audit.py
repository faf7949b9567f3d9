"""The invariant we measure, against the provider's own list of payment intents.

For every (operation, step) that calls the provider: provider-side successes
<= 1, and every provider success has exactly one `done` claim carrying its
reference. Any excess of provider successes over claims means a call ran
without a claim.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from payments.conf import payments_settings
from payments.models import ClaimState, StepClaim
from payments.provider.client import PaymentIntent


@dataclass
class AuditResult:
    """What an audit found; `clean` when nothing at all."""

    provider_successes: int = 0
    done_claims: int = 0
    #: (operation_key, step) -> references of more than one success: double charges.
    double_charges: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    #: provider successes with no `done` claim carrying their reference.
    unfenced: list[str] = field(default_factory=list)
    #: `done` claims whose reference the provider does not list as succeeded.
    unknown_references: list[str] = field(default_factory=list)
    #: uncertain claims older than the grace period (operation_key/step).
    stale_uncertain: list[str] = field(default_factory=list)
    #: reference -> "operation_key/step", for the references named in the findings only.
    steps: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (
            self.double_charges or self.unfenced or self.unknown_references or self.stale_uncertain
        )

    @property
    def findings(self) -> int:
        """Count the problems: each double-charged step, reference and stale claim once."""
        return (
            len(self.double_charges)
            + len(self.unfenced)
            + len(self.unknown_references)
            + len(self.stale_uncertain)
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "clean": self.clean,
            "findings": self.findings,
            "provider_successes": self.provider_successes,
            "done_claims": self.done_claims,
            "double_charges": [
                {"operation_key": k, "step": s, "references": refs}
                for (k, s), refs in sorted(self.double_charges.items())
            ],
            "unfenced": self.unfenced,
            "unknown_references": self.unknown_references,
            "stale_uncertain": self.stale_uncertain,
            "steps": dict(sorted(self.steps.items())),
        }


def audit(
    intents: Iterable[PaymentIntent],
    claims: Q | None = None,
    *,
    stale_claims: Q | None = None,
    now: datetime | None = None,
) -> AuditResult:
    """Compare the provider's intents with the `done` claims.

    `claims` limits which claims are judged against the provider's list (a
    `done` claim outside the listed window would look unknown); a provider
    success is looked up among all claims, so a claim just before the window
    still fences its intent. `stale_claims` limits the uncertain-claim check
    (default: `claims`).
    """
    now = now or timezone.now()
    result = AuditResult()
    by_step: dict[tuple[str, str], list[str]] = defaultdict(list)
    succeeded: set[str] = set()
    for intent in intents:
        if intent.status != "succeeded":
            continue
        result.provider_successes += 1
        succeeded.add(intent.id)
        key = (intent.metadata.get("operation_key", ""), intent.metadata.get("step", ""))
        result.steps[intent.id] = "/".join(key) if key[0] else "(no operation_key)"
        if key[0]:  # an intent made outside the fence is unfenced, not a double charge
            by_step[key].append(intent.id)
    result.double_charges = {k: sorted(refs) for k, refs in by_step.items() if len(refs) > 1}

    done = StepClaim.objects.filter(state=ClaimState.DONE).exclude(provider_reference="")
    fenced = set(
        done.filter(provider_reference__in=succeeded).values_list("provider_reference", flat=True)
    )
    result.unfenced = sorted(succeeded - fenced)

    scoped = done.filter(claims or Q()).select_related("operation")
    result.done_claims = 0
    unknown = []
    for claim in scoped.only("provider_reference", "step", "operation__key"):
        result.done_claims += 1
        if claim.provider_reference not in succeeded:
            unknown.append(claim.provider_reference)
            result.steps[claim.provider_reference] = f"{claim.operation.key}/{claim.step}"
    result.unknown_references = sorted(unknown)
    named = {*result.unfenced, *result.unknown_references}
    named.update(ref for refs in result.double_charges.values() for ref in refs)
    result.steps = {ref: where for ref, where in result.steps.items() if ref in named}

    grace = timedelta(seconds=payments_settings().reconcile_grace)
    stale = StepClaim.objects.filter(stale_claims if stale_claims is not None else (claims or Q()))
    stale = stale.filter(state=ClaimState.UNCERTAIN, claimed_at__lt=now - grace)
    result.stale_uncertain = [
        f"{c.operation.key}/{c.step}" for c in stale.select_related("operation").order_by("id")
    ]
    return result
