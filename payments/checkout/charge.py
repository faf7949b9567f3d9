"""The `charge` effect: the order's PaymentIntent, confirmed once, fenced by a claim.

One PaymentIntent per order, as Stripe's own retry model has it. The first
attempt creates and confirms it in one request; every later attempt (a new
payment method after a decline, the desk's new attempt, the shop's retry under
a new key) confirms that same intent (`POST /v1/payment_intents/{id}/confirm`),
and an intent that succeeded refuses that: the provider itself makes a second
success for the order impossible. An intent cancelled by an operator's "mark
failed" can never be charged; the next attempt creates a new one.

Outcomes are decided by consistent reads only: retrieve by id, or a list by
`created` window matched against the claim's request; never by search.

This module is the only place where the fence's effect contract meets the
provider client. It maps provider answers to EffectResult and lets provider
errors (which carry their `outcome`) propagate to the fence.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from payments.checkout.names import CHARGE, CHECKOUT
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
from payments.engine.outcomes import Outcome
from payments.models import Operation, StepClaim
from payments.provider.client import PaymentIntent, ProviderClient
from payments.provider.errors import (
    PAYMENT_INTENT_UNEXPECTED_STATE,
    CardDeclined,
    InvalidRequest,
    ResourceMissing,
)

logger = logging.getLogger("payments.checkout.charge")
alerts = logging.getLogger("payments.alerts")

#: A created intent in these took no money: declined (back to requires_payment_method) or cancelled.
DECLINED_STATUSES = frozenset({"requires_payment_method", "canceled"})
#: Stripe's code for a confirm or cancel the intent's status forbids (succeeded, canceled).
UNEXPECTED_STATE = PAYMENT_INTENT_UNEXPECTED_STATE


class UnsettledPaymentIntent(StillInProgress):
    """The intent exists but is neither succeeded nor declined (processing, requires_action)."""


def order_intent(operation: Operation) -> str:
    """The order's PaymentIntent a new attempt confirms, or '' when it must create one.

    The latest intent an earlier attempt of the same order recorded, unless it
    was cancelled (a cancelled intent can never be charged; a new one may be).
    """
    earlier = (
        StepClaim.objects.filter(
            operation__kind=CHECKOUT,
            operation__entity_type=operation.entity_type,
            operation__entity_id=operation.entity_id,
            step=CHARGE,
        )
        .exclude(operation_id=operation.pk)
        .exclude(provider_reference="")
        .order_by("-claimed_at", "-pk")
        .only("provider_reference", "result")
        .first()
    )
    if earlier is None or (earlier.result or {}).get("status") == "canceled":
        return ""
    return earlier.provider_reference


class PaymentIntentCharge:
    """Charge an operation's amount with its payment method, once, on the order's intent."""

    #: What "mark failed" must say, in the desk's words: it may have happened, and how it
    #: is made final (`void`).
    MAY_HAVE_HAPPENED = "The customer may already have been charged."
    VOIDS = "is cancelled there, so that it can never be charged"

    def __init__(self, operation: Operation, client: ProviderClient | None = None) -> None:
        self.operation = operation
        self.client = client or ProviderClient.from_settings()

    def build_request(self) -> dict[str, Any]:
        params = self.operation.params
        request = {
            "amount": int(params["amount"]),
            "currency": params["currency"],
            "payment_method": params["payment_method"],
        }
        # Only a later attempt (linked to the one before) can find an intent to confirm:
        # the first one creates it, with no look-up on the way.
        intent = order_intent(self.operation) if self.operation.retry_of_id else ""
        if intent:
            # A confirm sends no metadata: the intent keeps the first attempt's.
            return {**request, "payment_intent": intent}
        metadata = fence_metadata(self.operation, CHARGE, order_id=str(params["order_id"]))
        return {**request, "metadata": metadata}

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        try:
            if request.get("payment_intent"):
                intent = self.client.confirm_payment_intent(
                    request["payment_intent"],
                    payment_method=request["payment_method"],
                    idempotency_key=idempotency_key,
                )
            else:
                intent = self.client.create_payment_intent(
                    amount=request["amount"],
                    currency=request["currency"],
                    payment_method=request["payment_method"],
                    metadata=request["metadata"],
                    idempotency_key=idempotency_key,
                )
        except CardDeclined as exc:
            return EffectResult(
                Outcome.PERMANENT,
                reference=exc.payment_intent_id or "",
                data={"status": "declined", "code": exc.code or "card_declined"},
            )
        except ResourceMissing:
            raise  # a 404 on create is not a refusal of this charge: let it be classified
        except InvalidRequest as exc:
            if exc.code == UNEXPECTED_STATE and exc.payment_intent_id:
                return self._refused_by_state(exc.payment_intent_id)
            return EffectResult(
                Outcome.PERMANENT, data={"status": "invalid", "code": exc.code or "invalid"}
            )
        return _outcome(intent)

    def _refused_by_state(self, intent_id: str) -> EffectResult:
        """The order's intent refused a confirm: it succeeded already, or was cancelled."""
        intent = self.client.retrieve_payment_intent(intent_id)
        if intent.status == "succeeded":
            # The order's one intent holds the money: this attempt's purpose is met, once.
            alerts.error(
                "operation %s: the order's %s had succeeded already; recorded as this "
                "attempt's charge (no second charge was made)",
                self.operation.key,
                intent.id,
            )
        return _outcome(intent)

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """Check that `reference` is this step's succeeded charge; raise ValueError if not."""
        try:
            intent = self.client.retrieve_payment_intent(reference)
        except (ResourceMissing, ValueError) as exc:
            raise ReferenceNotFound(reference) from exc
        return _verify_intent(intent, claim)

    def find(self, claim: ClaimView) -> EffectResult | None:
        """Retrieve the intent by id when known, else list the claim's created window."""
        target = claim.reference or str(claim.request.get("payment_intent") or "")
        if target:
            try:
                intent = self.client.retrieve_payment_intent(target)
            except ResourceMissing:
                return None
            if claim.request.get("payment_intent"):
                return _confirmed_or_none(intent)
            return _outcome(intent)
        grace = timedelta(seconds=payments_settings().reconcile_grace)
        since, until = created_window(claim, grace)
        found = [
            pi
            for pi in self.client.list_payment_intents(created_gte=since, created_lte=until)
            if _is_this_request(pi, claim.request)
        ]
        succeeded = [pi for pi in found if pi.status == "succeeded"]
        if len(succeeded) > 1:
            alerts.error(
                "operation %s step %s has %s provider successes: double charge",
                claim.operation_key,
                claim.step,
                len(succeeded),
            )
        if succeeded:
            return _outcome(succeeded[0])
        declined = [pi for pi in found if pi.status in DECLINED_STATUSES]
        if declined:
            return _outcome(declined[0])
        return _outcome(found[0]) if found else None  # in progress raises

    def void(self, claim: ClaimView) -> EffectResult | None:
        """Cancel the intent this step works on, unless it succeeded; say what it is now."""
        target = claim.reference or str(claim.request.get("payment_intent") or "")
        try:
            found = self.find(claim)
        except UnsettledPaymentIntent as exc:
            found, target = None, exc.reference or target
        if found is not None and found.outcome == Outcome.SUCCESS:
            return found
        target = (found.reference if found is not None else "") or target
        if not target:
            return found  # nothing in the consistent list: the caller weighs the grace
        try:
            intent = self.client.cancel_payment_intent(target, cancellation_reason="abandoned")
        except InvalidRequest as exc:
            if exc.code != UNEXPECTED_STATE:
                raise
            intent = self.client.retrieve_payment_intent(target)  # succeeded, or cancelled before
        if intent.status == "succeeded" and claim.request.get("payment_intent"):
            return _confirmed_or_none(intent)
        return _outcome(intent)


def _verify_intent(intent: PaymentIntent, claim: ClaimView) -> EffectResult:
    """Check a typed reference against the claim; raise ValueError naming what differs."""
    problems = []
    request = claim.request
    if intent.status != "succeeded":
        problems.append(f"its status is {intent.status}")
    if request.get("payment_intent"):
        if intent.id != request["payment_intent"]:
            problems.append(f"this attempt confirms {request['payment_intent']}, not it")
    elif intent.metadata.get("operation_key") != claim.operation_key:
        problems.append("it belongs to another operation")
    elif intent.metadata.get("step", claim.step) != claim.step:
        problems.append(f"it belongs to step {intent.metadata.get('step')}")
    sent = request.get("metadata") or {}
    if "operation_id" in sent and intent.metadata.get("operation_id") != sent["operation_id"]:
        problems.append("it was made for another operation with the same key")
    if "amount" in request and int(request["amount"]) != intent.amount:
        problems.append(f"its amount is {intent.amount}, not {request['amount']}")
    if "currency" in request and str(request["currency"]).lower() != intent.currency.lower():
        problems.append(f"its currency is {intent.currency}, not {request['currency']}")
    if problems:
        raise ValueError("; ".join(problems))
    return _outcome(intent)


def _is_this_request(intent: PaymentIntent, request: dict[str, Any]) -> bool:
    """Tell whether a found intent is the one this claim's request made (not a namesake's).

    Every metadata item the request sent, its amount and currency must match:
    a key equal to another operation's (another scope) never settles this one.
    """
    if not sent_metadata_matches(request, intent.metadata):
        return False
    if "amount" in request and int(request["amount"]) != intent.amount:
        return False
    return "currency" not in request or str(request["currency"]) == intent.currency


def _outcome(intent: PaymentIntent) -> EffectResult:
    """SUCCESS, or PERMANENT (declined, cancelled); raise UnsettledPaymentIntent in between."""
    data: dict[str, Any] = {
        "status": intent.status,
        "amount": intent.amount,
        "currency": intent.currency,
    }
    if intent.status == "succeeded":
        return EffectResult(Outcome.SUCCESS, reference=intent.id, data=data)
    if intent.status in DECLINED_STATUSES:
        data["code"] = "canceled" if intent.status == "canceled" else intent.last_error_code
        data["code"] = data["code"] or "declined"
        return EffectResult(Outcome.PERMANENT, reference=intent.id, data=data)
    raise UnsettledPaymentIntent(
        f"payment intent {intent.id} is {intent.status}", reference=intent.id
    )


def _confirmed_or_none(intent: PaymentIntent) -> EffectResult | None:
    """What a confirm of the order's intent did, as far as its state tells.

    Succeeded or cancelled decide; processing or requires_action is in progress
    (UnsettledPaymentIntent). Back in requires_payment_method does not decide:
    it is what an earlier attempt's decline left too, so only the confirm's
    own answer (or its same-key replay) tells a decline from a confirm that
    never arrived.
    """
    if intent.status == "requires_payment_method":
        return None
    return _outcome(intent)  # succeeded, cancelled; in progress raises
