"""The base class of an external effect: a provider call whose outcome can be looked up.

The engine's contract with an effect (payments.engine.effects.ExternalEffect:
build_request, perform, find, void, verify) is written here once for
provider objects; a subclass only says how to call the provider and how to
read its objects. Handler authors reach it as `payments.fence.ProviderEffect`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from payments.conf import payments_settings
from payments.engine.effects import (
    ClaimView,
    EffectResult,
    ReferenceNotFound,
    StillInProgress,
    created_window,
    fence_metadata,
    sent_metadata_matches,
)
from payments.engine.outcomes import NotFoundError, Outcome
from payments.engine.systems import (
    DEFAULT_SYSTEM,
    Described,
    ExternalSystem,
    NotAtSystem,
    Read,
    declare,
)
from payments.exceptions import ConfigurationError
from payments.provider.client import PaymentIntent, ProviderClient
from payments.provider.errors import ResourceMissing
from payments.provider.events import ProviderEvents
from payments.provider.ledger import ledger

alerts = logging.getLogger("payments.alerts")

#: The metadata keys the engine sends with every request that creates a provider object.
FENCE_METADATA_KEYS = ("operation_key", "step", "operation_id")

#: The provider ids worth a retrieve: payment intents and refunds.
RETRIEVED = re.compile(r"(pi|re)_[A-Za-z0-9]{1,64}")


def describe(reference: str) -> Described | None:
    """Retrieve a payment intent or a refund by id, for the desk's search (never its search
    API, which lags): its metadata and status. None for another kind (a charge)."""
    if not RETRIEVED.fullmatch(reference):
        return None
    try:
        with ProviderClient.from_settings() as client:
            found: Any = (
                client.retrieve_refund(reference)
                if reference.startswith("re_")
                else client.retrieve_payment_intent(reference)
            )
    except ResourceMissing as exc:
        raise NotAtSystem(reference) from exc
    metadata = dict(getattr(found, "metadata", {}) or {})
    return Described(
        {str(k): str(v) for k, v in metadata.items()},
        str(found.status),
        amount=found.amount,
        currency=str(found.currency),
    )


#: The payment provider of the PROVIDER_* settings, as the fence must know it: a
#: Stripe-compatible API (keys kept at least 24 hours per account, parameters
#: compared, objects retrieved by id and listed by creation window; search lags and
#: never decides).
PAYMENT_PROVIDER = declare(
    ExternalSystem(
        name=DEFAULT_SYSTEM,
        label="the provider",
        key_retention=24 * 3600,
        reads=(Read.RETRIEVE, Read.LIST_BY_CREATED),
        moves_money=True,
        reference_patterns=(r"(pi|re|ch)_[A-Za-z0-9_]+",),
        object_noun="payment",
        describe=describe,
        events=ProviderEvents(),
        ledger=ledger,
    )
)


class ProviderEffect:
    """A provider call under a step claim, with `find`, `verify` and matching written once.

    A subclass says how to call the provider and how to read its objects;
    the engine does the rest (payments.fence documents the contract):

    - `request()`: the call's parameters, built once, when the claim is made,
      and stored on it: every try sends them unchanged. A request that creates
      an object gets the lookup metadata (`operation_key`, `step`,
      `operation_id`) from the engine; one that acts on an existing object
      names it under `TARGET` and sends none (it would overwrite the first
      step's).
    - `send(request, idempotency_key)`: make the call, return the provider's
      object (or an EffectResult for a refusal it reads itself); provider
      errors carry their `outcome`.
    - `retrieve(reference)`: one object by id (NotFoundError when absent, as
      ResourceMissing is).
    - `candidates(claim)`: a consistent list where a lost answer's object would
      be (a `created` window, an intent's refunds); never search.
    - `outcome(obj)`: SUCCESS or PERMANENT as an EffectResult, None while in
      progress.
    - `decides(obj, request)`: whether the object's state tells this request's
      outcome (an intent back in requires_payment_method does not tell whether
      a confirm ran).
    - `money(result)`: the money the recorded step moved, for the desk and the
      audit; None when it moves none (an authorisation holds, a cancel releases).
    - `EVENTS`: the provider event types whose object may settle this step.
    - `AUDITED`, `AUDIT_ID`: what fence_audit checks a done step against.
    """

    #: The external system the effect calls (payments.engine.systems): its key retention,
    #: reads and words. A package with a system of its own declares it and names it here.
    SYSTEM = DEFAULT_SYSTEM
    #: The desk's "mark failed" page: it may have happened, and what `void` does.
    MAY_HAVE_HAPPENED = "It may already have happened at the provider."
    VOIDS = ""
    #: Provider event types whose object may settle this step (payments.webhooks).
    EVENTS: frozenset[str] = frozenset()
    #: The request key naming the existing object the call acts on ("" : it creates one).
    TARGET = ""
    #: What fence_audit counts a done step as: "payment" (money taken: one success per
    #: order), "refund", or "" (moves no money: a hold, a release); AUDIT_ID is the
    #: result's key naming that object; AUDIT_PARENT (a refund) the request item naming
    #: the payment it gives money back from.
    AUDITED = ""
    AUDIT_ID = "reference"
    AUDIT_PARENT = ""

    #: The provider's client (None on another system's effect: its package builds its own).
    client: ProviderClient

    def __init__(self, run: Any, step: str, client: ProviderClient | None = None) -> None:
        self.run = run
        self.step = step
        self.operation = run.operation
        # Built now, before any claim: a wrong configuration fails the step, not its call.
        # Only the provider's own effects get its client: another system's package builds
        # its client from its own settings entry (its effect's __init__).
        if client is None and self.SYSTEM == DEFAULT_SYSTEM:
            client = ProviderClient.from_settings()
        self.client = client  # type: ignore[assignment]

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.operation.params)

    # --- what a subclass writes ------------------------------------------------------

    def request(self) -> dict[str, Any]:
        raise NotImplementedError

    def send(self, request: dict[str, Any], idempotency_key: str) -> Any:
        raise NotImplementedError

    def retrieve(self, reference: str) -> Any:
        raise NotImplementedError

    def candidates(self, claim: ClaimView) -> Any:
        """The objects a lost answer may have made (a consistent list); none by default."""
        return []

    def outcome(self, obj: Any) -> EffectResult | None:
        raise NotImplementedError

    def decides(self, obj: Any, request: dict[str, Any]) -> bool:
        return True

    @classmethod
    def money(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        """The money a done step moved (minor units, currency) by its recorded result."""
        amount, currency = result.get("amount"), result.get("currency")
        if isinstance(amount, int) and isinstance(currency, str):
            return amount, currency
        return None

    def matches(self, obj: Any, request: dict[str, Any]) -> bool:
        """Tell whether a found object is the one this request made (not a namesake's).

        Every metadata item the request sent, its amount and its currency must match.
        """
        if not sent_metadata_matches(request, getattr(obj, "metadata", {})):
            return False
        if "amount" in request and int(request["amount"]) != getattr(obj, "amount", None):
            return False
        currency = str(getattr(obj, "currency", "")).lower()
        return "currency" not in request or str(request["currency"]).lower() == currency

    def refused(self, reference: str = "", **data: Any) -> EffectResult:
        """A refusal `send` read itself (a decline): the step fails, no retry."""
        return EffectResult(Outcome.PERMANENT, reference=reference, data=data)

    def succeeded(self, reference: str, **data: Any) -> EffectResult:
        """A success `outcome` reads off an object: the step is done with `reference`."""
        return EffectResult(Outcome.SUCCESS, reference=reference, data=data)

    def created_window(self, claim: ClaimView) -> tuple[int, int]:
        """The `created` window (Unix seconds) where a lost answer's object was made."""
        grace = timedelta(seconds=payments_settings().reconcile_grace)
        return created_window(claim, grace)

    def current(self, claim: ClaimView) -> tuple[EffectResult | None, str]:
        """What `find` says, and the object it names: (None, its id) while it is in progress."""
        try:
            found = self.find(claim)
        except StillInProgress as exc:
            return None, exc.reference or claim.reference or self.target(claim.request)
        known = claim.reference or self.target(claim.request)
        return found, (found.reference if found is not None else "") or known

    # --- what the engine calls (written once) ----------------------------------------

    def target(self, request: dict[str, Any]) -> str:
        """The existing object the request acts on, or ''."""
        return str(request.get(self.TARGET) or "") if self.TARGET else ""

    def build_request(self) -> dict[str, Any]:
        """The request to store on the claim: `request()` plus the engine's lookup metadata."""
        request = dict(self.request())
        if self.target(request):
            if "metadata" in request:
                raise ConfigurationError(
                    f"{type(self).__name__}: a request acting on {self.target(request)} sends "
                    "no metadata (it would overwrite the metadata that names the first step)"
                )
            return request
        business = dict(request.pop("metadata", None) or {})
        reserved = sorted(set(business) & set(FENCE_METADATA_KEYS))
        if reserved:
            raise ConfigurationError(
                f"{type(self).__name__}: metadata {reserved} is the engine's; leave it out"
            )
        request["metadata"] = fence_metadata(self.operation, self.step, **business)
        return request

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        answer = self.send(request, idempotency_key)
        return answer if isinstance(answer, EffectResult) else self._settled(answer)

    def find(self, claim: ClaimView) -> EffectResult | None:
        """By the reference or the target when known, else by the consistent list."""
        known = claim.reference or self.target(claim.request)
        if known:
            obj = self._retrieve_or_none(self.target(claim.request) or known)
            if obj is None or not self.decides(obj, claim.request):
                return None
            return self._settled(obj)
        mine = [obj for obj in self.candidates(claim) if self.matches(obj, claim.request)]
        ranked: dict[Outcome | None, list[Any]] = {}
        for obj in mine:
            found = self.outcome(obj)
            ranked.setdefault(None if found is None else found.outcome, []).append(obj)
        if len(ranked.get(Outcome.SUCCESS, [])) > 1:
            alerts.error(
                "operation %s step %s has %s provider successes: double charge",
                claim.operation_key,
                claim.step,
                len(ranked[Outcome.SUCCESS]),
            )
        for outcome in (Outcome.SUCCESS, None, Outcome.PERMANENT):
            if ranked.get(outcome):
                return self._settled(ranked[outcome][0])  # in progress raises
        return None

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """Check that `reference` is this claim's succeeded effect (an operator typed it)."""
        target = self.target(claim.request)
        obj = self._retrieve_or_none(target or reference, missing=True)
        problems = []
        found = self.outcome(obj)
        if found is None or found.outcome != Outcome.SUCCESS:
            problems.append(f"its status is {getattr(obj, 'status', 'unknown')}")
        if target and reference not in (target, found.reference if found else ""):
            problems.append(f"this step acts on {target}, not {reference}")
        if not self.matches(obj, claim.request):  # a target's request sends no metadata
            problems.append("it belongs to another operation, or its amount or currency differ")
        if problems:
            raise ValueError("; ".join(problems))
        assert found is not None
        return found

    def void(self, claim: ClaimView) -> EffectResult | None:
        """Make sure the effect can no longer happen; by default it cannot be called back."""
        return self.find(claim)

    def _retrieve_or_none(self, reference: str, *, missing: bool = False) -> Any:
        try:
            return self.retrieve(reference)
        except (NotFoundError, ValueError) as exc:  # ResourceMissing, any system's 404
            if missing:
                raise ReferenceNotFound(reference) from exc
            return None

    def _settled(self, obj: Any) -> EffectResult:
        found = self.outcome(obj)
        if found is None:
            reference = str(getattr(obj, "id", ""))
            shown = {name: getattr(obj, name, None) for name in ("status", "amount", "currency")}
            raise StillInProgress(
                f"{reference} is {getattr(obj, 'status', 'in progress')}",
                reference=reference,
                data={name: value for name, value in shown.items() if value is not None},
            )
        return found


class PaymentIntentEffect(ProviderEffect):
    """An effect whose object is a PaymentIntent: retrieved by id, and a lost answer found
    in the list of intents created in the claim's window (a consistent read)."""

    def retrieve(self, reference: str) -> PaymentIntent:
        return self.client.retrieve_payment_intent(reference)

    def candidates(self, claim: ClaimView) -> Iterator[PaymentIntent]:
        since, until = self.created_window(claim)
        return self.client.list_payment_intents(created_gte=since, created_lte=until)
