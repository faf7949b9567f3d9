"""The `charge` effect: a confirmed PaymentIntent at the provider, fenced by a claim.

This module is the only place where the fence's effect contract meets the
provider client. It maps provider answers to EffectResult and lets provider
errors (which carry their `outcome`) propagate to the fence.
"""

from __future__ import annotations

import logging
from typing import Any

from payments.checkout.names import CHARGE
from payments.engine.effects import (
    ClaimView,
    EffectResult,
    ReferenceNotFound,
    fence_metadata,
    sent_metadata_matches,
)
from payments.engine.outcomes import Outcome
from payments.models import Operation
from payments.provider.client import PaymentIntent, ProviderClient
from payments.provider.errors import CardDeclined, InvalidRequest, ResourceMissing

logger = logging.getLogger("payments.checkout.charge")
alerts = logging.getLogger("payments.alerts")

DECLINED_STATUSES = frozenset({"requires_payment_method", "canceled"})


class UnsettledPaymentIntent(Exception):
    """The intent exists but is neither succeeded nor declined; look again later."""

    outcome = Outcome.UNCERTAIN


class PaymentIntentCharge:
    """Charge an operation's amount with its payment method, once."""

    def __init__(self, operation: Operation, client: ProviderClient | None = None) -> None:
        self.operation = operation
        self.client = client or ProviderClient.from_settings()

    def build_request(self) -> dict[str, Any]:
        params = self.operation.params
        return {
            "amount": int(params["amount"]),
            "currency": params["currency"],
            "payment_method": params["payment_method"],
            "metadata": fence_metadata(self.operation, CHARGE, order_id=str(params["order_id"])),
        }

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        try:
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
            return EffectResult(
                Outcome.PERMANENT, data={"status": "invalid", "code": exc.code or "invalid"}
            )
        return _settled(intent)

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """Check that `reference` is this step's succeeded charge; raise ValueError if not."""
        try:
            intent = self.client.retrieve_payment_intent(reference)
        except (ResourceMissing, ValueError) as exc:
            raise ReferenceNotFound(reference) from exc
        return _verify_intent(intent, claim)

    def find(self, claim: ClaimView) -> EffectResult | None:
        if claim.reference:
            try:
                return _settled_or_none(self.client.retrieve_payment_intent(claim.reference))
            except ResourceMissing:
                return None
        found = [
            pi
            for pi in self.client.search_payment_intents(
                {"operation_key": claim.operation_key, "step": claim.step}
            )
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
            return _settled(succeeded[0])
        declined = [pi for pi in found if pi.status in DECLINED_STATUSES]
        return _settled(declined[0]) if declined else None


def _verify_intent(intent: PaymentIntent, claim: ClaimView) -> EffectResult:
    """Check a typed reference against the claim; raise ValueError naming what differs."""
    problems = []
    if intent.status != "succeeded":
        problems.append(f"its status is {intent.status}")
    if intent.metadata.get("operation_key") != claim.operation_key:
        problems.append("it belongs to another operation")
    elif intent.metadata.get("step", claim.step) != claim.step:
        problems.append(f"it belongs to step {intent.metadata.get('step')}")
    request = claim.request
    sent = request.get("metadata") or {}
    if "operation_id" in sent and intent.metadata.get("operation_id") != sent["operation_id"]:
        problems.append("it was made for another operation with the same key")
    if "amount" in request and int(request["amount"]) != intent.amount:
        problems.append(f"its amount is {intent.amount}, not {request['amount']}")
    if "currency" in request and str(request["currency"]).lower() != intent.currency.lower():
        problems.append(f"its currency is {intent.currency}, not {request['currency']}")
    if problems:
        raise ValueError("; ".join(problems))
    return _settled(intent)


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


def _settled(intent: PaymentIntent) -> EffectResult:
    result = _settled_or_none(intent)
    if result is None:
        raise UnsettledPaymentIntent(f"payment intent {intent.id} is {intent.status}")
    return result


def _settled_or_none(intent: PaymentIntent) -> EffectResult | None:
    data = {"status": intent.status, "amount": intent.amount, "currency": intent.currency}
    if intent.status == "succeeded":
        return EffectResult(Outcome.SUCCESS, reference=intent.id, data=data)
    if intent.status in DECLINED_STATUSES:
        data["code"] = intent.last_error_code or "declined"
        return EffectResult(Outcome.PERMANENT, reference=intent.id, data=data)
    return None
