"""The fake provider's refunds: creation, the states a refund moves through, its failures.

At Stripe a refund is `pending`, `requires_action`, `succeeded`, `failed` or
`canceled`. A new refund here starts `succeeded` or `pending`
(`FakeConfig.refund_status`); a pending one already holds its amount on the
charge, as at Stripe. Later it moves on by `complete_refund` (pending to
succeeded) or `fail_refund` (pending or succeeded to failed: the amount goes
back to the charge). A refund can fail after it was first reported succeeded,
which is what `FakeConfig.refund_fail_after` makes happen to every refund.

`RefundDesk` holds no lock and knows no HTTP: `FakeState` calls it with its
own lock held and turns a `Refusal` into the 400 to answer.
"""

from __future__ import annotations

import copy
import heapq
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

REFUND_REASONS = ("duplicate", "fraudulent", "requested_by_customer")
#: Every status a Stripe refund can have.
REFUND_STATUSES = ("pending", "requires_action", "succeeded", "failed", "canceled")
#: What a new refund starts as (`FakeConfig.refund_status`).
NEW_REFUND_STATUSES = ("succeeded", "pending")
#: Stripe's `failure_reason` values.
REFUND_FAILURE_REASONS = (
    "charge_for_pending_refund_disputed",
    "declined",
    "expired_or_canceled_card",
    "insufficient_funds",
    "lost_or_stolen_card",
    "merchant_request",
    "unknown",
)
# Stripe's error codes for refusing a refund (https://docs.stripe.com/error-codes):
# more than is left on the charge, nothing left at all, no successful charge (none
# made, or one only authorised: an uncaptured intent is released by a cancel).
REFUND_TOO_LARGE = "amount_too_large"
ALREADY_REFUNDED = "charge_already_refunded"
NOT_REFUNDABLE = "payment_intent_unexpected_state"

_ZERO_DECIMAL = frozenset({"bif", "clp", "djf", "gnf", "jpy", "kmf", "krw", "mga", "pyg", "rwf"})
_ZERO_DECIMAL |= {"ugx", "vnd", "vuv", "xaf", "xof", "xpf"}
_SYMBOLS = {"usd": "$", "eur": "€", "gbp": "£", "jpy": "¥"}


def money(amount: int, currency: str) -> str:
    """Format minor units the way Stripe's refund messages do: `$1.00`, `€15.00`, `¥500`."""
    if currency in _ZERO_DECIMAL:
        number = f"{amount}"
    else:
        number = f"{amount // 100}.{amount % 100:02d}"
    symbol = _SYMBOLS.get(currency)
    return f"{symbol}{number}" if symbol else f"{number} {currency.upper()}"


class Refusal(Exception):
    """A refund request refused with a 400 invalid_request_error."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class Charge(Protocol):
    """What the desk needs of an intent: its object, its charge and what is refunded of it."""

    data: dict[str, Any]
    charge_id: str | None
    refunded: int


@dataclass
class RefundRecord:
    data: dict[str, Any]
    created_at: float
    seq: int
    #: (fake clock time, order of successes) once it succeeded; kept if it fails later.
    succeeded: tuple[float, int] | None = None


class RefundDesk:
    """The refunds of one `FakeState` generation; call every method with its lock held."""

    def __init__(
        self,
        intents: Mapping[str, Charge],
        emit: Callable[[str, dict[str, Any]], None],
        next_seq: Callable[[], int],
    ) -> None:
        self.records: dict[str, RefundRecord] = {}
        self._intents = intents
        self._emit = emit
        self._next_seq = next_seq
        self._failures: list[tuple[float, int, str]] = []  # (due, seq, refund id)

    # --- transitions -----------------------------------------------------------------

    def create(
        self, parsed: Mapping[str, Any], *, now: float, status: str, fail_after: float
    ) -> dict[str, Any]:
        """Refund (part of) an intent's charge and return the refund, or raise Refusal."""
        pi_id = parsed["payment_intent"]
        intent = self._intents.get(pi_id)
        if intent is None:
            raise Refusal(
                f"No such payment_intent: '{pi_id}'",
                param="payment_intent",
                code="resource_missing",
            )
        if intent.charge_id is None or intent.data["status"] != "succeeded":
            raise Refusal(
                f"This PaymentIntent ({pi_id}) does not have a successful charge to refund.",
                param="payment_intent",
                code=NOT_REFUNDABLE,
            )
        currency = intent.data["currency"]
        # What was captured, not what was asked for: a partial capture released the rest.
        charged = int(intent.data["amount_received"])
        left = charged - intent.refunded
        if left <= 0:
            raise Refusal(
                f"Charge {intent.charge_id} has already been refunded.", code=ALREADY_REFUNDED
            )
        amount = parsed["amount"] if parsed["amount"] is not None else left
        if amount > left:
            # Stripe names the charge amount until a first refund, then what is left.
            limit = (
                f"charge amount ({money(charged, currency)})"
                if intent.refunded == 0
                else f"unrefunded amount on charge ({money(left, currency)})"
            )
            raise Refusal(
                f"Refund amount ({money(amount, currency)}) is greater than {limit}",
                param="amount",
                code=REFUND_TOO_LARGE,
            )
        re_id = "re_" + secrets.token_hex(12)
        data = {
            "id": re_id,
            "object": "refund",
            "amount": amount,
            "charge": intent.charge_id,
            "created": int(now),
            "currency": currency,
            "failure_balance_transaction": None,
            "failure_reason": None,
            "metadata": parsed["metadata"],
            "payment_intent": pi_id,
            "reason": parsed["reason"],
            "status": status,
        }
        # A pending refund holds its amount too: it cannot be refunded twice meanwhile.
        intent.refunded += amount
        record = RefundRecord(data, now, self._next_seq())
        self.records[re_id] = record
        self._emit("refund.created", data)
        if status == "succeeded":
            self._succeeded(record, intent, now=now, fail_after=fail_after)
        return copy.deepcopy(data)

    def complete(self, refund_id: str, *, now: float, fail_after: float) -> dict[str, Any]:
        """Move a pending refund to succeeded; raise KeyError or ValueError."""
        record = self._record(refund_id)
        if record.data["status"] != "pending":
            raise ValueError(
                f"refund {refund_id} is {record.data['status']}; only a pending one can succeed"
            )
        record.data["status"] = "succeeded"
        self._emit("refund.updated", record.data)
        self._succeeded(record, self._intents[record.data["payment_intent"]], now, fail_after)
        return copy.deepcopy(record.data)

    def fail(self, refund_id: str, *, reason: str) -> dict[str, Any]:
        """Fail a pending or succeeded refund: its amount goes back to the charge."""
        if reason not in REFUND_FAILURE_REASONS:
            raise ValueError(f"failure reason must be one of {REFUND_FAILURE_REASONS}")
        record = self._record(refund_id)
        if record.data["status"] not in ("pending", "succeeded"):
            raise ValueError(
                f"refund {refund_id} is {record.data['status']}; only a pending or "
                "succeeded one can fail"
            )
        data = record.data
        data["status"] = "failed"
        data["failure_reason"] = reason
        data["failure_balance_transaction"] = "txn_" + secrets.token_hex(12)
        self._intents[data["payment_intent"]].refunded -= int(data["amount"])
        self._emit("refund.updated", data)
        self._emit("refund.failed", data)
        return copy.deepcopy(data)

    def fail_due(self, now: float) -> None:
        """Fail the refunds whose `refund_fail_after` time has come."""
        while self._failures and self._failures[0][0] <= now:
            _, _, refund_id = heapq.heappop(self._failures)
            record = self.records.get(refund_id)
            if record is not None and record.data["status"] == "succeeded":
                self.fail(refund_id, reason="lost_or_stolen_card")

    def next_failure(self) -> float | None:
        """When the next scheduled failure is due, or None."""
        return self._failures[0][0] if self._failures else None

    # --- reading -----------------------------------------------------------------

    def newest_first(self, payment_intent: str | None = None) -> list[RefundRecord]:
        rows = sorted(self.records.values(), key=lambda r: (r.created_at, r.seq), reverse=True)
        if payment_intent is not None:
            rows = [r for r in rows if r.data["payment_intent"] == payment_intent]
        return rows

    def charge_of(self, intent: Charge) -> dict[str, Any]:
        """The charge object of a succeeded intent, with its refunds (for `charge.refunded`)."""
        data = intent.data
        refunds = [
            copy.deepcopy(r.data)
            for r in sorted(self.records.values(), key=lambda r: r.seq, reverse=True)
            if r.data["payment_intent"] == data["id"]
        ]
        return {
            "id": intent.charge_id,
            "object": "charge",
            "amount": data["amount"],
            "amount_captured": data["amount_received"],
            "amount_refunded": intent.refunded,
            "currency": data["currency"],
            "created": data["created"],
            "metadata": copy.deepcopy(data["metadata"]),
            "paid": True,
            "payment_intent": data["id"],
            "refunded": intent.refunded >= data["amount_received"],
            "status": "succeeded",
            "refunds": {
                "object": "list",
                "data": refunds,
                "has_more": False,
                "url": f"/v1/charges/{intent.charge_id}/refunds",
            },
        }

    # --- internals -----------------------------------------------------------------

    def _record(self, refund_id: str) -> RefundRecord:
        record = self.records.get(refund_id)
        if record is None:
            raise KeyError(f"No such refund: '{refund_id}'")
        return record

    def _succeeded(
        self, record: RefundRecord, intent: Charge, now: float, fail_after: float
    ) -> None:
        record.succeeded = (now, self._next_seq())
        self._emit("charge.refunded", self.charge_of(intent))
        if fail_after > 0:
            heapq.heappush(
                self._failures, (now + fail_after, record.succeeded[1], record.data["id"])
            )
