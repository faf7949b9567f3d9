"""Adyen's notifications: verified, stored once through the inbox, and settling their step.

**Verified.** Each NotificationRequestItem carries `additionalData.hmacSignature`: base64
of HMAC-SHA256, keyed with the hex-decoded HMAC key of the endpoint, over
`pspReference:originalReference:merchantAccountCode:merchantReference:value:currency:
eventCode:success` (docs.adyen.com/development-resources/webhooks/verify-hmac-signatures;
the official library's `Adyen.util.generate_notification_sig` builds the same string).
A body with any item unsigned or signed otherwise is refused whole: nothing is written.
Adyen offers no lookup to check an item against (a Stripe event's object is retrieved
before it moves anything; here the signature is all there is), so the key is the trust.

**Once.** Each item goes through the inbox (consumer `adyen-notifications`, message id
`<pspReference>:<eventCode>:<success>`): the stored row, the claim's settlement and the
inbox row commit together; Adyen's retries and duplicates change nothing.

**Settling.** The item's merchant reference names the claim (`fence:<op>:<step>`, see
payments.adyen.effects); the step's effect says what the item means (AUTHORISATION for a
payment, CAPTURE / REFUND / CANCELLATION for a modification) and the engine settles the
claim as from any provider fact (`settle_from_provider`): an unsettled claim is done or
failed, a settled one is never overridden (a contradiction goes to review). A claim busy
with a worker keeps its stored notification: the worker's own answer, or the reconciler
reading the row (`AdyenEffect.find`), settles it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from typing import Any

from inbox.handlers import inbox_guard
from payments.adyen.effects import AdyenEffect, claim_named
from payments.adyen.models import Notification
from payments.engine.handlers import get_handler
from payments.engine.recovery import settle_from_provider
from payments.exceptions import ConfigurationError
from payments.models import StepClaim

logger = logging.getLogger("payments.adyen.notifications")

CONSUMER = "adyen-notifications"
ACTOR = "adyen-notifications"
SIGNED_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "value",
    "currency",
    "eventCode",
    "success",
)


def signing_string(item: dict[str, Any]) -> str:
    """The string Adyen signs for one item."""
    amount = _amount(item)
    values = {**item, "value": amount.get("value", ""), "currency": amount.get("currency", "")}
    return ":".join(str(values.get(name, "")) for name in SIGNED_FIELDS)


def _amount(item: dict[str, Any]) -> dict[str, Any]:
    amount = item.get("amount")
    return amount if isinstance(amount, dict) else {}


def signed(item: dict[str, Any], hmac_key: str) -> bool:
    """Tell whether the item carries a valid signature under `hmac_key` (hex)."""
    additional = item.get("additionalData")
    given = additional.get("hmacSignature") if isinstance(additional, dict) else None
    if not isinstance(given, str) or not given or not hmac_key:
        return False
    try:
        key = binascii.unhexlify(hmac_key)
    except (binascii.Error, ValueError):
        return False
    digest = hmac.new(key, signing_string(item).encode(), hashlib.sha256).digest()
    return hmac.compare_digest(base64.b64encode(digest).decode(), given)


def items_of(body: Any) -> list[dict[str, Any]]:
    """The NotificationRequestItems of a notification body; ValueError when it is not one."""
    listed = body.get("notificationItems") if isinstance(body, dict) else None
    if not isinstance(listed, list) or not listed:
        raise ValueError("no notificationItems")
    items = [entry.get("NotificationRequestItem") for entry in listed if isinstance(entry, dict)]
    if len(items) != len(listed) or not all(isinstance(item, dict) for item in items):
        raise ValueError("a notificationItems entry without a NotificationRequestItem")
    return items  # type: ignore[return-value]  # checked just above


def message_id(item: dict[str, Any]) -> str:
    """The item's identity in the inbox: Adyen sends one event of a payment once per outcome."""
    return f"{item.get('pspReference')}:{item.get('eventCode')}:{item.get('success')}"


def receive(item: dict[str, Any], *, merchant_account: str) -> str:
    """Store a verified item once and settle what it names; return what it did."""
    if item.get("merchantAccountCode") != merchant_account:
        logger.warning(
            "Adyen notification %s is for another merchant account; ignored", message_id(item)
        )
        return "other_account"
    with inbox_guard(CONSUMER, message_id(item)) as first:
        if not first:
            return "duplicate"
        note = _stored_in_tx(item)
        note.outcome = _settle_in_tx(note)
        note.save(update_fields=["outcome"])
    logger.info("Adyen notification %s: %s", message_id(item), note.outcome)
    return note.outcome


def _stored_in_tx(item: dict[str, Any]) -> Notification:
    amount = _amount(item)
    value = amount.get("value")
    note, _ = Notification.objects.get_or_create(
        psp_reference=str(item.get("pspReference") or ""),
        event_code=str(item.get("eventCode") or ""),
        success=str(item.get("success")).lower() == "true",
        defaults={
            "original_reference": str(item.get("originalReference") or ""),
            "merchant_account": str(item.get("merchantAccountCode") or ""),
            "merchant_reference": str(item.get("merchantReference") or "")[:100],
            "amount": value if isinstance(value, int) else None,
            "currency": str(amount.get("currency") or "")[:3],
            "reason": str(item.get("reason") or "")[:255],
            "event_date": str(item.get("eventDate") or "")[:40],
        },
    )
    return note


def _settle_in_tx(note: Notification) -> str:
    """Settle the claim the notification names (in the inbox's transaction)."""
    named = claim_named(note.merchant_reference)
    claim = (
        StepClaim.objects.select_related("operation")
        .filter(operation_id=named[0], step=named[1])
        .first()
        if named is not None
        else None
    )
    if claim is None:
        return "unmatched"
    try:
        effect = get_handler(claim.operation.kind).effect(claim.step, claim.operation)
    except ConfigurationError:
        return "no_handler"
    if not isinstance(effect, AdyenEffect) or effect.EVENT != note.event_code:
        return "unmatched"
    return settle_from_provider(
        claim,
        effect.settled_by(note),
        actor=ACTOR,
        source=f"Adyen notification {note.event_code} {note.psp_reference}",
    )
