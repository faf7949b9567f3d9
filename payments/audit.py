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
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from payments.conf import payments_setting
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

    @property
    def clean(self) -> bool:
        return not (
            self.double_charges or self.unfenced or self.unknown_references or self.stale_uncertain
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "clean": self.clean,
            "provider_successes": self.provider_successes,
            "done_claims": self.done_claims,
            "double_charges": [
                {"operation_key": k, "step": s, "references": refs}
                for (k, s), refs in sorted(self.double_charges.items())
            ],
            "unfenced": self.unfenced,
            "unknown_references": self.unknown_references,
            "stale_uncertain": self.stale_uncertain,
        }


def audit(intents: Iterable[PaymentIntent], claims: Q | None = None) -> AuditResult:
    """Compare the provider's intents with the `done` claims (optionally filtered)."""
    result = AuditResult()
    by_step: dict[tuple[str, str], list[str]] = defaultdict(list)
    succeeded: set[str] = set()
    for intent in intents:
        if intent.status != "succeeded":
            continue
        result.provider_successes += 1
        succeeded.add(intent.id)
        key = (intent.metadata.get("operation_key", ""), intent.metadata.get("step", ""))
        by_step[key].append(intent.id)
    result.double_charges = {k: refs for k, refs in by_step.items() if len(refs) > 1}

    scope = StepClaim.objects.filter(claims or Q())
    done = scope.filter(state=ClaimState.DONE).exclude(provider_reference="")
    fenced = set(done.values_list("provider_reference", flat=True))
    result.done_claims = len(fenced)
    result.unfenced = sorted(succeeded - fenced)
    # A done claim may carry a reference of an intent outside the listed window;
    # only references in the listed window are judged by the caller's filter.
    result.unknown_references = sorted(fenced - succeeded)

    grace = timedelta(seconds=payments_setting("RECONCILE_GRACE"))
    stale = scope.filter(state=ClaimState.UNCERTAIN, claimed_at__lt=timezone.now() - grace)
    result.stale_uncertain = [
        f"{c.operation.key}/{c.step}" for c in stale.select_related("operation")
    ]
    return result
