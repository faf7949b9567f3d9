"""Adyen's Checkout contract as data: the version, headers, error bodies, test outcomes.

Every constant here is a documented fact; the package docstring
(`devtools.fake_provider.adyen`) says where each one comes from. What the fake
decides on its own is marked so where it is defined.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

from devtools.fake_provider.state import Reply

#: The Checkout API version the Adyen 16.0.0 library calls (its `baseUrl` ends in `/v72`).
API_VERSION = "v72"
API_KEY_HEADER = "X-API-Key"
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: "a unique identifier for the message with a maximum of 64 characters".
IDEMPOTENCY_KEY_MAX = 64
#: "Idempotency keys are valid for a minimum period of 7 days after first submission".
KEY_RETENTION_MINIMUM = 7 * 86400.0
#: The header that marks an answer as safe to retry with the same key.
TRANSIENT_HEADER = "transient-error"
#: The two statuses Adyen documents for a duplicate "before the first request has completed".
IN_FLIGHT_STATUSES = (409, 422)

#: Payment `resultCode` values the fake gives (a subset of the specification's enum).
AUTHORISED, REFUSED, ERROR = "Authorised", "Refused", "Error"
#: The asynchronous modifications: path segment -> the notification's eventCode.
MODIFICATIONS = {"captures": "CAPTURE", "refunds": "REFUND", "cancels": "CANCELLATION"}
AUTHORISATION = "AUTHORISATION"
#: `merchantRefundReason` values of PaymentRefundRequest.
REFUND_REASONS = ("FRAUD", "CUSTOMER REQUEST", "RETURN", "DUPLICATE", "OTHER")
_PSP_ALPHABET = string.ascii_uppercase + string.digits


@dataclass(frozen=True)
class Outcome:
    """One row of Adyen's "values for testing refusal reasons" table."""

    result_code: str
    refusal_reason: str | None
    refusal_reason_code: str | None


#: holderName -> outcome, and the same rows by RequestedTestAcquirerResponseCode.
TEST_OUTCOMES: dict[str, Outcome] = {
    "UNKNOWN": Outcome(ERROR, "Unknown", "0"),
    "APPROVED": Outcome(AUTHORISED, None, None),
    "DECLINED": Outcome(REFUSED, "Refused", "2"),
    "REFERRAL": Outcome(REFUSED, "Referral", "3"),
    "ERROR": Outcome(ERROR, "Acquirer Error", "4"),
    "BLOCK_CARD": Outcome(REFUSED, "Blocked Card", "5"),
    "CARD_EXPIRED": Outcome(REFUSED, "Expired Card", "6"),
    "INVALID_AMOUNT": Outcome(REFUSED, "Invalid Amount", "7"),
    "INVALID_CARD_NUMBER": Outcome(REFUSED, "Invalid Card Number", "8"),
    "ISSUER_UNAVAILABLE": Outcome(REFUSED, "Issuer Unavailable", "9"),
    "NOT_ENOUGH_BALANCE": Outcome(REFUSED, "Not enough balance", "12"),
    "ACQUIRER_FRAUD": Outcome(REFUSED, "Acquirer Fraud", "14"),
    "FRAUD": Outcome(REFUSED, "FRAUD", "20"),
    "CVC_DECLINED": Outcome(REFUSED, "CVC Declined", "24"),
}
_BY_CODE = {"1": TEST_OUTCOMES["APPROVED"]} | {
    row.refusal_reason_code: row for row in TEST_OUTCOMES.values() if row.refusal_reason_code
}


def scripted_outcome(holder_name: object, acquirer_code: object) -> Outcome:
    """Return the outcome a test payment asks for; a name or code not in the table authorises."""
    by_code = _BY_CODE.get(str(acquirer_code)) if acquirer_code is not None else None
    return by_code or TEST_OUTCOMES.get(str(holder_name or "").upper(), TEST_OUTCOMES["APPROVED"])


def psp_reference() -> str:
    """A new pspReference: "Adyen's 16-character string reference", letters and digits."""
    return "".join(secrets.choice(_PSP_ALPHABET) for _ in range(16))


def service_error(
    status: int,
    code: str,
    message: str,
    error_type: str,
    *,
    headers: tuple[tuple[str, str], ...] = (),
    psp: bool = True,
) -> Reply:
    """Build an answer in the specification's ServiceError shape.

    The specification's generic 403, 422 and 500 examples carry a pspReference of the
    request; its 401 example does not (`psp=False`).
    """
    body: dict[str, object] = {
        "status": status,
        "errorCode": code,
        "message": message,
        "errorType": error_type,
    }
    if psp:
        body["pspReference"] = psp_reference()
    return Reply(status, body, headers)


def unauthorized() -> Reply:
    """401, the specification's generic-401 example (the key is never echoed)."""
    return service_error(401, "000", "HTTP Status Response - Unauthorized", "security", psp=False)


def invalid_merchant_account() -> Reply:
    """403 `901`, the specification's generic-403 example."""
    return service_error(403, "901", "Invalid Merchant Account", "security")


def in_progress(status: int) -> Reply:
    """409 or 422 `704`: the same key is still being processed; retry it later."""
    return service_error(
        status,
        "704",
        "request already processed or in progress",
        "validation",
        headers=((TRANSIENT_HEADER, "true"),),
    )


def key_store_unavailable() -> Reply:
    """503 `703`: the idempotency store is down; nothing was executed (a transient error)."""
    return service_error(
        503,
        "703",
        "required resource temporarily unavailable",
        "internal",
        headers=((TRANSIENT_HEADER, "true"),),
    )


def reference_missing() -> Reply:
    """422 `130`, as in the library's fixture `payments-error-invalid-data-422.json`."""
    return service_error(422, "130", "Reference Missing", "validation")


def amount_missing() -> Reply:
    """422 `100`, the error-codes page's message for a request without `amount`."""
    return service_error(422, "100", "Required object 'amount' is not provided", "validation")


def unknown_payment() -> Reply:
    """422 `167`, as in the library's fixture `capture-error-167.json`.

    The fake's reading: it answers a modification of a pspReference that is not a
    payment of this merchant account (Adyen documents the message, not this use).
    """
    return service_error(
        422, "167", "Original pspReference required for this operation", "validation"
    )


def return_url_missing() -> Reply:
    """422 `14_030`, the specification's generic-422 example."""
    return service_error(422, "14_030", "Return URL is missing.", "validation")


def field_missing(name: str) -> Reply:
    """422 for another missing or malformed field (the fake's wording and code)."""
    return service_error(422, "000", f"Required field '{name}' is not provided", "validation")


def unparsable() -> Reply:
    """400 `702` for a body that is not a JSON object (the specification's generic-400)."""
    return service_error(400, "702", "Unexpected input: expected a JSON object", "validation")


def key_too_long() -> Reply:
    """422 for an Idempotency-Key over 64 characters (the fake's wording and code)."""
    return service_error(
        422, "000", f"Idempotency-Key longer than {IDEMPOTENCY_KEY_MAX} characters", "validation"
    )


def internal_error() -> Reply:
    """500 for the `fail_before` and `fail_after` faults (the fake's wording)."""
    return service_error(500, "000", "An unknown error occurred", "internal")


def not_found(method: str, path: str) -> Reply:
    """404 for any other path: there is no lookup, and no other version than v72."""
    return service_error(404, "000", f"Not Found ({method} {path})", "validation")
