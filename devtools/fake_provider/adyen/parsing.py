"""Check a Checkout request body against the specification's required fields.

A request that fails here is refused before anything runs (and is not stored under its
idempotency key). Which fields are required comes from `CheckoutService-v72.json`
(PaymentRequest: amount, merchantAccount, paymentMethod, reference, returnUrl;
PaymentCaptureRequest and PaymentRefundRequest: amount, merchantAccount;
PaymentCancelRequest: merchantAccount). The merchant account itself is checked by the
state, which knows which ones the key may use.
"""

from __future__ import annotations

import json
import re
from typing import Any

from devtools.fake_provider.adyen import contract
from devtools.fake_provider.state import Reply

_CURRENCY = re.compile(r"[A-Z]{3}")


def parse_payment(raw: bytes) -> dict[str, Any] | Reply:
    """Return a /payments body, or the answer refusing it."""
    body = _json_object(raw)
    if isinstance(body, Reply):
        return body
    refusal = _amount(body) or _reference(body)
    if refusal is not None:
        return refusal
    if not isinstance(body.get("paymentMethod"), dict):
        return contract.field_missing("paymentMethod")
    if not isinstance(body.get("returnUrl"), str) or not body["returnUrl"]:
        return contract.return_url_missing()
    if not isinstance(body.get("additionalData", {}), dict):
        return contract.field_missing("additionalData")
    return body


def parse_modification(kind: str, raw: bytes) -> dict[str, Any] | Reply:
    """Return a capture, refund or cancel body, or the answer refusing it."""
    body = _json_object(raw)
    if isinstance(body, Reply):
        return body
    if kind != "cancels":
        refusal = _amount(body)
        if refusal is not None:
            return refusal
    reason = body.get("merchantRefundReason")
    if kind == "refunds" and reason is not None and reason not in contract.REFUND_REASONS:
        return contract.field_missing("merchantRefundReason")
    if body.get("reference") is not None and not isinstance(body["reference"], str):
        return contract.field_missing("reference")
    return body


def _json_object(raw: bytes) -> dict[str, Any] | Reply:
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        return contract.unparsable()
    return body if isinstance(body, dict) else contract.unparsable()


def _amount(body: dict[str, Any]) -> Reply | None:
    amount = body.get("amount")
    if amount is None:
        return contract.amount_missing()
    if not isinstance(amount, dict):
        return contract.field_missing("amount")
    value = amount.get("value")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return contract.field_missing("amount.value")
    if not isinstance(amount.get("currency"), str) or not _CURRENCY.fullmatch(amount["currency"]):
        return contract.field_missing("amount.currency")
    return None


def _reference(body: dict[str, Any]) -> Reply | None:
    reference = body.get("reference")
    if not isinstance(reference, str) or not reference:
        return contract.reference_missing()
    return None
