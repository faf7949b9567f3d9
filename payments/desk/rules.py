"""What the desk allows: read-only checks that raise DeskError, and the reference check.

`payments.desk.services` runs these before it acts and again under the operation's
lock; the admin runs them to show which buttons apply and why the others do
not. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from payments.desk.display import when
from payments.desk.evidence import no_handler, system_label
from payments.engine import fence
from payments.engine.effects import ReferenceNotFound
from payments.engine.handlers import HandlerSpec, get_handler, registered_handlers
from payments.engine.outcomes import EffectError
from payments.engine.steps import view_of
from payments.exceptions import InvalidTransition, PaymentsError
from payments.models import ClaimState, KeyScope, Operation, OperationState, StepClaim


class DeskError(InvalidTransition):
    """The operation's current state forbids what the operator asked; nothing was changed."""

    def __init__(self, message: str, *, operation_key: str = "", action: str = "") -> None:
        self.operation_key = operation_key
        self.action = action
        self.detail = message  # without the key, for a page that shows the operation already
        super().__init__(f"{operation_key}: {message}" if operation_key else message)


class ReasonRequired(DeskError):
    """A judgement (resume, mark a step, new attempt) needs a written reason."""


#: Operation.key's max_length: a derived key must fit it too.
KEY_LENGTH = 255


def next_attempt_key(op: Operation) -> str:
    """Return the derived key of the attempt after `op`, named after the first attempt's key.

    "order-6-checkout attempt 2": what an operator knows the payment by, not an
    id. It lives in the derived scope (KeyScope.DERIVED), so it never collides
    with a client's key, whatever the client chose; attempts of the same first
    share its tenant (the handler's new attempt keeps it), whose keys are unique
    in their scope, and " attempt <n>" at the end is read back unambiguously. A
    first attempt keyed by the system (its string may equal a client's key) or a
    name past the column's length ends in the first attempt's id instead:
    "desk-refund:order:5:… attempt 2 (#40)", unique by that id, and never ending
    in a digit as the names above do.
    """
    first, attempt = op, 1
    while first.retry_of_id is not None:
        first = Operation.objects.only("pk", "key", "scope", "retry_of_id").get(
            pk=first.retry_of_id
        )
        attempt += 1
    name = f"{first.key} attempt {attempt + 1}"
    if first.scope == KeyScope.CLIENT and len(name) <= KEY_LENGTH:
        return name
    tail = f" attempt {attempt + 1} (#{first.pk})"
    return f"{first.key[: KEY_LENGTH - len(tail)]}{tail}"


#: How the engine records a step the provider refused (payments.engine.steps, recovery).
REFUSED_BY_PROVIDER = "refused: "


def declined_payment_method(op: Operation, claims: list[StepClaim], spec: HandlerSpec) -> str:
    """The payment method the provider refused at this attempt ("" if it refused nothing).

    Only a refusal by the provider counts: a step given up without an answer,
    or marked failed by a person, says nothing against the payment method.
    """
    method = str((op.params or {}).get("payment_method") or "")
    refused = any(
        c.step in spec.effects
        and c.state == ClaimState.FAILED
        and c.error.startswith(REFUSED_BY_PROVIDER)
        for c in claims
    )
    return method if refused else ""


def check_payment_method(
    op: Operation,
    claims: list[StepClaim],
    spec: HandlerSpec,
    payment_method: str | None,
    *,
    charge_declined_again: bool = False,
) -> None:
    """Refuse a new attempt that would charge the method the provider just declined.

    Left blank, a new attempt takes the old one's method: after a decline that
    is the declined one, so a method must be given. The declined one itself is
    accepted only when the operator confirms it (`charge_declined_again`: the
    customer says it will work now).
    """
    declined = declined_payment_method(op, claims, spec)
    if not declined or charge_declined_again:
        return
    if not payment_method:
        raise DeskError(
            f"the provider declined {declined} at this attempt: give the payment method the "
            "customer authorised for the new one",
            operation_key=op.key,
            action="new_attempt",
        )
    if payment_method == declined:
        raise DeskError(
            f"the provider declined {declined} at this attempt: give another payment method, "
            "or confirm that it should be charged again",
            operation_key=op.key,
            action="new_attempt",
        )


# --- what the desk offers for one operation (the admin's buttons) ----------------


@dataclass(frozen=True)
class DeskActions:
    """Which actions the state allows now; a refused action maps to the reason why."""

    refused: dict[str, str]
    settleable_steps: list[str]
    #: Why no action at all can be taken (the kind has no handler in this deploy).
    refused_all: str = ""


def available_actions(operation: Operation) -> DeskActions:
    """Tell which actions the operation's state allows (permissions are the caller's)."""
    claims = list(operation.claims.all())
    spec = registered_handlers().get(operation.kind)
    if spec is None:  # the runtime sent it to a person; the desk cannot act for a handler
        return DeskActions(refused={}, settleable_steps=[], refused_all=no_handler(operation))
    refused: dict[str, str] = {}
    checks = {
        "resume": lambda: check_resume(operation, claims, reopen=True),
        "new_attempt": lambda: check_new_attempt(operation, claims, spec),
    }
    for action, check in checks.items():
        try:
            check()
        except PaymentsError as exc:
            refused[action] = getattr(exc, "detail", str(exc))
    steps = []
    for step in spec.effects:
        try:
            settleable_claim(operation, claims, step, spec)
        except PaymentsError:
            continue
        steps.append(step)
    if not steps:
        refused["mark_step"] = "no step is waiting to be settled"
    return DeskActions(refused=refused, settleable_steps=steps)


# --- checks (raise DeskError; read-only) -----------------------------------------


def check_resume(op: Operation, claims: list[StepClaim], *, reopen: bool = False) -> None:
    if op.state == OperationState.SUCCEEDED:
        raise DeskError("it succeeded; there is nothing to resume", operation_key=op.key)
    if op.state in (OperationState.PENDING, OperationState.RETRYING):
        raise DeskError(
            f"it is {op.get_state_display().lower()} and will run; the sweeper delivers a lost "
            "job again",
            operation_key=op.key,
        )
    check_no_live_lease(op)
    for claim in claims:
        if claim.state == ClaimState.UNCERTAIN:
            raise DeskError(
                f"step {claim.step} is uncertain: query {system_label(claim)}, or mark "
                "the step succeeded or failed after checking",
                operation_key=op.key,
            )
        if claim.state == ClaimState.FAILED and op.state == OperationState.FAILED:
            if claim.error.startswith(fence.GAVE_UP_BEFORE_RUNNING):  # an outage, say
                raise DeskError(
                    f"every request under step {claim.step}'s key was refused before it ran "
                    f"({system_label(claim)} executed nothing) and the fence gave up; its key "
                    "is closed: " + a_new_attempt(op),
                    operation_key=op.key,
                )
            if claim.error.startswith("marked failed by "):  # a person decided; nobody refused
                raise DeskError(
                    f"step {claim.step} was marked failed by an operator; its key is closed: "
                    + a_new_attempt(op),
                    operation_key=op.key,
                )
            raise DeskError(
                f"step {claim.step} was refused; the same key would be refused again: "
                + a_new_attempt(op),
                operation_key=op.key,
            )
    if reopen and op.state == OperationState.FAILED:
        check_entity_reopenable(op)


def a_new_attempt(op: Operation) -> str:
    """Where a new attempt comes from: the desk's button when the kind declares one, else
    wherever operations of the kind are started (never a button the page refuses)."""
    spec = registered_handlers().get(op.kind)
    if spec is None:  # a case still listed after a deploy removed its handler
        return no_handler(op)
    hooks = spec.desk
    if hooks is not None and hooks.new_attempt is not None:
        return "start a new attempt instead"
    return (
        f"a new {op.kind} operation is asked for where it is started (the API, the "
        "business's own page); the desk offers no new attempt for this kind"
    )


def check_new_attempt(op: Operation, claims: list[StepClaim], spec: HandlerSpec) -> None:
    hooks = spec.desk
    if hooks is None or hooks.new_attempt is None:
        raise DeskError(
            f"{op.kind} operations declare no new attempt: a new one is asked for where "
            "they are started (the API, the business's own page)",
            operation_key=op.key,
        )
    if op.state != OperationState.FAILED:
        raise DeskError(
            f"it is {op.get_state_display().lower()}; only a failed operation may get a new "
            "attempt",
            operation_key=op.key,
        )
    newer = op.retries.order_by("pk").first()
    if newer is not None:
        raise DeskError(f"a new attempt exists already: {newer.key}", operation_key=op.key)
    for claim in claims:
        if claim.step in spec.effects and claim.state != ClaimState.FAILED:
            raise DeskError(
                f"step {claim.step} is {claim.state}: it may have taken effect (charged, "
                "refunded); a new key could do it twice. Settle it first",
                operation_key=op.key,
            )
    refusal = hooks.refuse_new_attempt(op)
    if refusal:
        raise DeskError(refusal, operation_key=op.key)


def settleable_claim(
    op: Operation, claims: list[StepClaim], step: str, spec: HandlerSpec
) -> StepClaim:
    """Return the claim of an external step that waits to be settled, or raise DeskError."""
    if step not in spec.effects:
        raise DeskError(f"{step!r} is not a step with a provider look-up", operation_key=op.key)
    if op.state == OperationState.SUCCEEDED:
        raise DeskError("it succeeded; its steps are settled", operation_key=op.key)
    check_no_live_lease(op)
    claim = next((c for c in claims if c.step == step), None)
    if claim is None:
        raise DeskError(f"step {step} never started; resume instead", operation_key=op.key)
    if claim.state in (ClaimState.DONE, ClaimState.FAILED):
        raise DeskError(f"step {step} is settled already ({claim.state})", operation_key=op.key)
    if claim.state == ClaimState.CLAIMED and not fence.claim_expired(claim):
        raise DeskError(
            f"a worker holds step {step} until {when(claim.lease_expires_at)}",
            operation_key=op.key,
        )
    return claim


def check_no_live_lease(op: Operation) -> None:
    """Refuse to act on an operation a worker holds (by the database's clock), naming who."""
    if fence.lease_alive(op, fence.db_now()):
        raise DeskError(
            f"a worker runs it now ({op.lease_owner} holds the lease until "
            f"{when(op.lease_expires_at)})",
            operation_key=op.key,
        )


def check_reference_unused(op: Operation, claim: StepClaim, reference: str) -> None:
    """Refuse a reference another step is settled done with: one success settles one step.

    A failed claim may carry it (an order's attempts share one PaymentIntent).
    """
    other = (
        StepClaim.objects.filter(provider_reference=reference, state=ClaimState.DONE)
        .exclude(pk=claim.pk)
        .select_related("operation")
        .first()
    )
    if other is not None:
        raise DeskError(
            f"reference {reference} already settles {other.operation.key}/{other.step}",
            operation_key=op.key,
        )


def check_entity_reopenable(op: Operation) -> None:
    """Refuse to run a failed operation again once its entity moved on (the handler says)."""
    hooks = get_handler(op.kind).desk
    refusal = hooks.refuse_rerun(op) if hooks is not None else None
    if refusal:
        raise DeskError(refusal, operation_key=op.key)


# --- the provider check of a reference -------------------------------------------


def verified_success(
    op: Operation, claim: StepClaim, spec: HandlerSpec, reference: str
) -> dict[str, Any]:
    """Ask the step's effect to check `reference` is this step's success; return what it shows."""
    effect = spec.effect(claim.step, op)
    try:
        found = effect.verify(view_of(claim), reference)
    except ReferenceNotFound as exc:
        raise DeskError(
            f"the provider has no {claim.step} {reference}", operation_key=op.key
        ) from exc
    except ValueError as exc:
        raise DeskError(
            f"{reference} does not settle step {claim.step}: {exc}", operation_key=op.key
        ) from exc
    except EffectError as exc:  # any system's (ProviderError, AdyenError, a project's own)
        raise DeskError(
            f"could not check {reference} with the provider ({type(exc).__name__}); "
            "nothing was changed",
            operation_key=op.key,
        ) from exc
    return dict(found.data)
