"""A payment at the fake Adyen and what its modifications do to it: the accounting rules.

Plain data and functions, no lock and no HTTP: `AdyenState` calls them with its lock
held. The rules are the ones Adyen documents (package docstring): capture at most what
was authorised, once (a partial capture releases the rest); refund, in parts if need be,
at most what was captured; cancel only what was not captured. A modification the rules
refuse is still "received": it fails in its notification, with the fake's words in
`reason`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from devtools.fake_provider.adyen import contract


@dataclass
class Payment:
    """One /payments request that was executed, and what its modifications did to it."""

    psp: str
    merchant_account: str
    reference: str
    value: int
    currency: str
    outcome: contract.Outcome
    manual_capture: bool
    created_at: float
    captured: int = 0
    refunded: int = 0
    cancelled: bool = False


@dataclass(frozen=True)
class Executed:
    """What one request did: a timeline row and, announced, a notification item."""

    event: str
    psp: str
    original: str | None
    merchant_account: str
    merchant_reference: str
    amount: dict[str, Any]
    success: bool
    reason: str | None
    at: float

    def timeline_row(self) -> dict[str, Any]:
        return {
            "eventCode": self.event,
            "pspReference": self.psp,
            "originalReference": self.original,
            "merchantReference": self.merchant_reference,
            "amount": dict(self.amount),
            "success": self.success,
            "reason": self.reason,
            "executed_at": self.at,
        }

    def notification_item(self) -> dict[str, Any]:
        """The NotificationRequestItem, unsigned (`success` is a string, as Adyen sends it)."""
        item: dict[str, Any] = {
            "eventCode": self.event,
            "success": "true" if self.success else "false",
            "pspReference": self.psp,
            "merchantAccountCode": self.merchant_account,
            "merchantReference": self.merchant_reference,
            "amount": {"value": self.amount["value"], "currency": self.amount["currency"]},
            "eventDate": datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds"),
            "paymentMethod": "visa",
        }
        if self.reason:  # "If success = false, then this includes a short message"
            item["reason"] = self.reason
        if self.original is not None:
            item["originalReference"] = self.original
        return item


def authorise(
    body: dict[str, Any], capture: str, now: float
) -> tuple[Payment, dict[str, Any], Executed]:
    """Execute a /payments body: the payment, the answer's body, what to announce."""
    method, extra, amount = body["paymentMethod"], body.get("additionalData") or {}, body["amount"]
    outcome = contract.scripted_outcome(
        method.get("holderName"), extra.get("RequestedTestAcquirerResponseCode")
    )
    manual = capture == "manual" or str(extra.get("manualCapture")) == "true"
    payment = Payment(
        psp=contract.psp_reference(),
        merchant_account=body["merchantAccount"],
        reference=body["reference"],
        value=amount["value"],
        currency=amount["currency"],
        outcome=outcome,
        manual_capture=manual,
        created_at=now,
    )
    authorised = outcome.result_code == contract.AUTHORISED
    if authorised and not manual:
        payment.captured = payment.value  # captured automatically, at once
    answer: dict[str, Any] = {
        "pspReference": payment.psp,
        "resultCode": outcome.result_code,
        "merchantReference": payment.reference,
    }
    if authorised:
        answer["amount"] = dict(amount)
    else:
        answer["refusalReason"] = outcome.refusal_reason
        answer["refusalReasonCode"] = outcome.refusal_reason_code
    executed = Executed(
        contract.AUTHORISATION, payment.psp, None, payment.merchant_account,
        payment.reference, dict(amount), authorised, outcome.refusal_reason, now,
    )  # fmt: skip
    return payment, answer, executed


def modify(
    kind: str, payment: Payment, body: dict[str, Any], now: float
) -> tuple[dict[str, Any], Executed]:
    """Execute a capture, refund or cancel of `payment`: the answer's body, what to announce."""
    amount = body.get("amount")
    reason = refusal_reason(kind, payment, amount)
    if reason is None:
        _apply(kind, payment, amount)
    psp = contract.psp_reference()
    answer: dict[str, Any] = {
        "merchantAccount": payment.merchant_account,
        "paymentPspReference": payment.psp,
        "pspReference": psp,
        "status": "received",
    }
    for name in ("reference", "merchantRefundReason"):
        if body.get(name) is not None:
            answer[name] = body[name]
    if amount is not None:
        answer["amount"] = dict(amount)
    executed = Executed(
        contract.MODIFICATIONS[kind], psp, payment.psp, payment.merchant_account,
        body.get("reference") or payment.reference,
        dict(amount or {"value": payment.value, "currency": payment.currency}),
        reason is None, reason, now,
    )  # fmt: skip
    return answer, executed


def refusal_reason(kind: str, payment: Payment, amount: dict[str, Any] | None) -> str | None:
    """Return why the accounting rules refuse the modification, or None (the fake's words)."""
    if payment.outcome.result_code != contract.AUTHORISED:
        return "Payment not authorised"
    if payment.cancelled:
        return "Payment already cancelled"
    if kind == "cancels":
        return "Payment already captured" if payment.captured else None
    assert amount is not None  # parsed: captures and refunds require one
    if amount["currency"] != payment.currency:
        return "Currency does not match the payment"
    if kind == "captures":
        if payment.captured:
            return "Payment already captured"
        return "Insufficient balance on payment" if amount["value"] > payment.value else None
    if amount["value"] > payment.captured - payment.refunded:
        return "Insufficient balance on payment"
    return None


def _apply(kind: str, payment: Payment, amount: dict[str, Any] | None) -> None:
    """Apply an accepted modification; a partial capture releases the rest."""
    if kind == "cancels":
        payment.cancelled = True
    elif kind == "captures":
        assert amount is not None
        payment.captured = amount["value"]
    else:
        assert amount is not None
        payment.refunded += amount["value"]
