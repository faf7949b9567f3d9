"""The invariant we measure, against a system's own list of payments and refunds.

Per business entity (an order): provider-side successes <= 1, whatever
operation or attempt made them; per (operation, step) likewise; and every
provider success has exactly one `done` claim carrying its reference. Any
excess of provider successes over claims means a call ran without a claim.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Q
from django.utils import timezone

from payments.conf import payments_settings
from payments.engine.effects import reversal_step
from payments.engine.handlers import registered_handlers
from payments.engine.systems import LedgerEntry
from payments.models import ClaimState, Operation, StepClaim


@dataclass
class AuditResult:
    """What an audit found; `clean` when nothing at all."""

    provider_successes: int = 0
    done_claims: int = 0
    #: (operation_key, step) -> references of more than one success: double charges.
    double_charges: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    #: (entity_type, entity_id) -> {"references": [...], "operations": [...]} of entities the
    #: provider charged more than once, across operations and attempts: double charges.
    double_charged_entities: dict[tuple[str, str], dict[str, list[str]]] = field(
        default_factory=dict
    )
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
            self.double_charges
            or self.double_charged_entities
            or self.unfenced
            or self.unknown_references
            or self.stale_uncertain
        )

    @property
    def findings(self) -> int:
        """Count the problems: each double-charged entity and step, reference and stale claim."""
        return (
            len(self.double_charged_entities)
            + len(self.double_charges)
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
            "double_charged_entities": [
                {"entity_type": kind, "entity_id": ident, **found}
                for (kind, ident), found in sorted(self.double_charged_entities.items())
            ],
            "unfenced": self.unfenced,
            "unknown_references": self.unknown_references,
            "stale_uncertain": self.stale_uncertain,
            "steps": dict(sorted(self.steps.items())),
        }


def audit(
    payments: Iterable[LedgerEntry],
    claims: Q | None = None,
    *,
    stale_claims: Q | None = None,
    now: datetime | None = None,
) -> AuditResult:
    """Compare a system's payments (its ledger's) with the `done` claims.

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
    metadata_of: dict[str, dict[str, str]] = {}
    for payment in payments:
        if not payment.succeeded:
            continue
        result.provider_successes += 1
        succeeded.add(payment.id)
        metadata_of[payment.id] = dict(payment.metadata)
        key = (payment.metadata.get("operation_key", ""), payment.metadata.get("step", ""))
        result.steps[payment.id] = "/".join(key) if key[0] else "(no operation_key)"
        if key[0]:  # a payment made outside the fence is unfenced, not a double charge
            by_step[key].append(payment.id)
    result.double_charges = {k: sorted(refs) for k, refs in by_step.items() if len(refs) > 1}
    result.double_charged_entities = _double_charged_entities(metadata_of)

    fenced: set[str] = set()
    for steps, names in audited_steps(PAYMENT).items():
        done = StepClaim.objects.filter(steps, state=ClaimState.DONE)
        known = done.filter(**{f"{_lookup(names)}__in": list(succeeded)})
        fenced.update(str(ref) for ref in known.values_list(_lookup(names), flat=True))
    result.unfenced = sorted(succeeded - fenced)

    result.done_claims = 0
    unknown = []
    for steps, names in audited_steps(PAYMENT).items():
        scoped = StepClaim.objects.filter(steps, claims or Q(), state=ClaimState.DONE)
        for step, op_key, ref in scoped.values_list("step", "operation__key", _lookup(names)):
            result.done_claims += 1
            if ref not in succeeded:
                unknown.append(str(ref))
                result.steps[str(ref)] = f"{op_key}/{step}"
    result.unknown_references = sorted(unknown)
    named = {*result.unfenced, *result.unknown_references}
    named.update(ref for refs in result.double_charges.values() for ref in refs)
    named.update(
        ref for found in result.double_charged_entities.values() for ref in found["references"]
    )
    result.steps = {ref: where for ref, where in result.steps.items() if ref in named}

    grace = timedelta(seconds=payments_settings().reconcile_grace)
    stale = StepClaim.objects.filter(stale_claims if stale_claims is not None else (claims or Q()))
    stale = stale.filter(state=ClaimState.UNCERTAIN, claimed_at__lt=now - grace)
    result.stale_uncertain = [
        f"{c.operation.key}/{c.step}" for c in stale.select_related("operation").order_by("id")
    ]
    return result


#: What a done step counts as in the audit (ProviderEffect.AUDITED): money taken (one
#: success per order), or money given back.
PAYMENT = "payment"
REFUND = "refund"


def audited_steps(object_type: str) -> dict[Q, str]:
    """Which done claims count as a provider success of `object_type`, by the handlers' own
    effects (`AUDITED`): {Q(kind, step): the result key naming the object}. A hold or a
    release (AUDITED = "") moves no money and is not judged; a capture's success is the
    payment's it captured (its AUDIT_ID names it in the result), not an object of its own."""
    found: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for kind, spec in sorted(registered_handlers().items()):
        for step, effect in sorted(spec.effects.items()):
            if getattr(effect, "AUDITED", "") == object_type:
                found[(object_type, getattr(effect, "AUDIT_ID", "reference"))].append((kind, step))
    audited: dict[Q, str] = {}
    for (_, key), pairs in found.items():
        either = Q(pk__in=[])
        for kind, step in pairs:
            either |= Q(operation__kind=kind, step=step)
        audited[either] = key
    return audited


def _lookup(key: str) -> str:
    """The claim's field naming the audited object: its reference, or a key of its result."""
    return "provider_reference" if key == "reference" else f"result__{key}"


def _double_charged_entities(
    metadata_of: dict[str, dict[str, str]],
) -> dict[tuple[str, str], dict[str, list[str]]]:
    """Group provider successes by the business entity they paid for; keep those paid twice.

    A success's entity is its claim's operation's (entity_type, entity_id), or
    for a success no claim carries, the operation named in its metadata, or
    its `order_id` metadata: a charge made outside the fence still counts
    against the order it paid for.
    """
    entity_of: dict[str, tuple[str, str]] = {}
    operation_of: dict[str, str] = {}
    for steps, key in audited_steps(PAYMENT).items():
        claims = StepClaim.objects.filter(steps, **{f"{_lookup(key)}__in": list(metadata_of)})
        for ref, op_key, entity_type, entity_id in claims.values_list(
            _lookup(key), "operation__key", "operation__entity_type", "operation__entity_id"
        ):
            entity_of[str(ref)] = (entity_type, entity_id)
            operation_of[str(ref)] = op_key
    for ref, metadata in metadata_of.items():
        if ref in entity_of:
            continue
        op_key = metadata.get("operation_key", "")
        named = Operation.objects.filter(key=op_key).only("entity_type", "entity_id").first()
        if named is not None:
            entity_of[ref] = (named.entity_type, named.entity_id)
            operation_of[ref] = op_key
        elif metadata.get("order_id"):
            entity_of[ref] = ("order", str(metadata["order_id"]))
            operation_of[ref] = op_key or "(outside the fence)"
    refs_of: dict[tuple[str, str], list[str]] = defaultdict(list)
    for ref, entity in entity_of.items():
        refs_of[entity].append(ref)
    return {
        entity: {
            "references": sorted(refs),
            "operations": sorted({operation_of[ref] for ref in refs}),
        }
        for entity, refs in refs_of.items()
        if len(refs) > 1
    }


@dataclass
class RefundAuditResult:
    """What the refund audit found: refunds are an effect of their own, audited per kind."""

    provider_refunds: int = 0
    done_claims: int = 0
    #: "operation_key/step" -> references of more than one succeeded refund: double refunds.
    double_refunds: dict[str, list[str]] = field(default_factory=dict)
    #: payment -> {"charged": n, "refunded": m} where refunds exceed the charge.
    over_refunds: dict[str, dict[str, int]] = field(default_factory=dict)
    #: succeeded refunds no `done` claim carries: refunded outside the fence.
    unfenced: list[str] = field(default_factory=list)
    #: `done` refund claims whose reference the provider does not list as succeeded.
    unknown_references: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def findings(self) -> int:
        return (
            len(self.double_refunds)
            + len(self.over_refunds)
            + len(self.unfenced)
            + len(self.unknown_references)
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "clean": self.clean,
            "findings": self.findings,
            "provider_refunds": self.provider_refunds,
            "done_claims": self.done_claims,
            "double_refunds": [
                {"step": step, "references": refs}
                for step, refs in sorted(self.double_refunds.items())
            ],
            "over_refunds": [
                {"payment": paid, **amounts} for paid, amounts in sorted(self.over_refunds.items())
            ],
            "unfenced": self.unfenced,
            "unknown_references": self.unknown_references,
        }


def audit_refunds(
    refunds_by_payment: dict[str, list[LedgerEntry]],
    charged: dict[str, int],
    claims: Q | None = None,
    *,
    judge_all: bool = False,
) -> RefundAuditResult:
    """Compare a system's refunds of the listed payments with the `done` refund claims.

    `charged` maps each payment to its amount: the refunds of one payment never
    add up to more. `claims` limits which done claims are judged (the window).
    `judge_all`: the refunds listed are every refund of the claims' window (a
    listing by `created`), so every done claim of the window is judged, not
    only those of a payment whose refunds were listed.
    """
    result = RefundAuditResult()
    by_step: dict[str, list[str]] = defaultdict(list)
    succeeded: set[str] = set()
    for paid, refunds in refunds_by_payment.items():
        refunded = 0
        for refund in refunds:
            if not refund.succeeded:
                continue
            result.provider_refunds += 1
            succeeded.add(refund.id)
            refunded += refund.amount
            key, step = refund.metadata.get("operation_key"), refund.metadata.get("step")
            if key and step:
                by_step[f"{key}/{step}"].append(refund.id)
        if refunded > charged.get(paid, refunded):
            result.over_refunds[paid] = {"charged": charged[paid], "refunded": refunded}
    result.double_refunds = {s: sorted(refs) for s, refs in by_step.items() if len(refs) > 1}
    refund_steps = Q(pk__in=[])
    parents: dict[str, str] = {}
    for steps in audited_steps(REFUND):
        refund_steps |= steps
    done = StepClaim.objects.filter(refund_steps, state=ClaimState.DONE)
    fenced = set(
        done.filter(provider_reference__in=succeeded)
        .exclude(provider_reference="")  # the partial index, whatever the list's length
        .values_list("provider_reference", flat=True)
    )
    result.unfenced = sorted(succeeded - fenced)
    rows = list(
        done.filter(claims or Q()).values_list("provider_reference", "operation_id", "step")
    )
    scoped = [ref for ref, _, _ in rows]
    result.done_claims = len(scoped)
    # A refund that failed at the provider after it succeeded, its reversal recorded
    # (`<step>:reversed`, the order given its amount back): not succeeded there, and known.
    reversals = set(
        StepClaim.objects.filter(
            operation_id__in={pk for _, pk, _ in rows},
            step__in={reversal_step(step) for _, _, step in rows},
        ).values_list("operation_id", "step")
    )
    taken_back = {ref for ref, pk, step in rows if (pk, reversal_step(step)) in reversals}
    listed = set(refunds_by_payment)
    for kind, step, item in refund_parents():
        parents.update(
            done.filter(operation__kind=kind, step=step, provider_reference__in=scoped)
            .exclude(provider_reference="")
            .values_list("provider_reference", f"request__{item}")
        )
    # Only a refund of a listed payment can be judged unknown: the others were not asked for.
    result.unknown_references = sorted(
        ref
        for ref in scoped
        if ref not in succeeded
        and ref not in taken_back
        and (judge_all or parents.get(ref) in listed)
    )
    return result


def refund_parents() -> list[tuple[str, str, str]]:
    """(kind, step, request item) of each refund step: the item of its stored request that
    names the payment it refunds (its effect's AUDIT_PARENT)."""
    found = []
    for kind, spec in sorted(registered_handlers().items()):
        for step, effect in sorted(spec.effects.items()):
            item = getattr(effect, "AUDIT_PARENT", "")
            if getattr(effect, "AUDITED", "") == REFUND and item:
                found.append((kind, step, item))
    return found
