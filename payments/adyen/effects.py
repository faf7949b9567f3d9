"""Adyen's effects: a payment (charge or authorisation) and its modifications by pspReference.

**A payment** (`POST /payments`) answers at once: `Authorised` is the step's success with
the pspReference as its reference; `Refused` and `Error` are a permanent refusal; any other
result code (`Pending`, `Received`) leaves the step uncertain with its pspReference until
the AUTHORISATION notification says.

**A modification** (capture, refund, cancel by pspReference) is answered `201` with
`status: "received"` and a pspReference of its own: Adyen has the request, not its
outcome, which comes only in the CAPTURE / REFUND / CANCELLATION notification
(`success` true or false). So the step is **not done on "received"**: its claim stays
unsettled with the modification's pspReference (StillInProgress, as a Stripe refund
still `pending` is) and the notification settles it, done or failed. Why not "done once
received": a done claim is what the later steps trust (the capture's invoice and the
order marked paid, the refund's credit note), and a received capture can still fail
(an expired authorisation, a refund above what is left); recorded done, its failure
would be a contradiction for a person, where pending it is just the step's outcome. The
price: the operation waits for the notification (seconds, usually); past
RECONCILE_GRACE without one it goes to review, with the modification's pspReference.

**A lost answer.** Adyen offers no lookup (payments.adyen.system), so `find` reads only
the notifications Adyen signed and this app stored (payments.adyen.models), matched by
the merchant reference the fence sends (`fence:<operation id>:<step>`, one per claim):
none yet is None ("not found"), and the engine replays the same key while the system's
`replay_deadline` allows; past it, it never replays and the claim goes to review.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from payments.adyen.client import CANCELS, CAPTURES, REFUNDS, AdyenClient, Answer
from payments.adyen.models import Notification
from payments.adyen.system import NAME, PSP_REFERENCE
from payments.engine.effects import StillInProgress
from payments.fence import ClaimView, EffectResult, ProviderEffect

AUTHORISATION, CAPTURE, REFUND, CANCELLATION = "AUTHORISATION", "CAPTURE", "REFUND", "CANCELLATION"
#: Adyen's result codes of a payment that took nothing, for good.
REFUSED_CODES = frozenset({"Refused", "Error", "Cancelled"})
#: Where a shopper would return after a redirect; cards without 3D Secure never use it.
RETURN_URL = "https://shop.invalid/adyen/return"


def merchant_reference(operation_id: int, step: str) -> str:
    """The reference sent with a claim's request: it names the claim in notifications."""
    return f"fence:{operation_id}:{step}"


def claim_named(reference: str) -> tuple[int, str] | None:
    """(operation id, step) of a merchant reference the fence sent, else None."""
    prefix, _, rest = reference.partition(":")
    pk, _, step = rest.partition(":")
    return (int(pk), step) if prefix == "fence" and pk.isdigit() and step else None


def payment_method(value: str) -> dict[str, Any]:
    """Adyen's `paymentMethod` from the shop's `payment_method`.

    A JSON object (the `paymentMethod` Adyen's Drop-in hands the shop, encrypted card
    fields and all) is sent as it is; any other string is a stored payment method's id.
    """
    if value.startswith("{"):
        method = json.loads(value)
        if isinstance(method, dict):
            return method
    return {"type": "scheme", "storedPaymentMethodId": value}


class AdyenEffect(ProviderEffect):
    """A call to Adyen under a step claim; settled by its answer or by its notification."""

    SYSTEM = NAME
    #: The notification's eventCode that tells this step's outcome.
    EVENT: ClassVar[str] = ""

    def __init__(self, run: Any, step: str, client: AdyenClient | None = None) -> None:
        self.run = run
        self.step = step
        self.operation = run.operation
        # Built now, before any claim: a missing settings entry fails the step, not its call.
        self.adyen = client or AdyenClient.from_settings()

    def build_request(self) -> dict[str, Any]:
        """`request()` and the merchant reference naming the claim (no engine metadata:
        Adyen is never listed by it, and limits metadata values to 80 characters)."""
        return {**self.request(), "reference": merchant_reference(self.operation.pk, self.step)}

    def perform(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        answer = self.send(request, idempotency_key)
        assert isinstance(answer, EffectResult)  # send settles or raises
        return answer

    def settled_by(self, note: Notification) -> EffectResult:
        """The outcome a notification of this step's EVENT states."""
        raise NotImplementedError

    def notification(self, claim: ClaimView) -> Notification | None:
        """The newest stored notification of this claim's EVENT, by its merchant reference."""
        notes = Notification.objects.filter(
            merchant_reference=str(claim.request.get("reference", "")),
            event_code=self.EVENT,
            merchant_account=self.adyen.merchant_account,
        )
        if claim.reference:
            notes = notes.filter(psp_reference=claim.reference)
        return notes.order_by("-received_at", "-pk").first()

    def find(self, claim: ClaimView) -> EffectResult | None:
        """What Adyen's notification said; None when none came (Adyen has no lookup)."""
        note = self.notification(claim)
        if note is not None:
            return self.settled_by(note)
        if claim.reference:
            raise StillInProgress(
                f"{claim.reference} received by Adyen; its {self.EVENT} notification has not come",
                reference=claim.reference,
            )
        return None

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """Accept a reference only when Adyen's signed notification says it succeeded."""
        note = self.notification(claim)
        if note is None or note.psp_reference != reference or not note.success:
            raise ValueError(
                f"Adyen offers no lookup, and no signed {self.EVENT} notification says "
                f"{reference} succeeded for this step; settle it from Adyen's report"
            )
        return self.settled_by(note)

    def void(self, claim: ClaimView) -> EffectResult | None:
        return self.find(claim)


class AdyenPayment(AdyenEffect):
    """`POST /payments` for the operation's amount (a charge, or with MANUAL an authorisation)."""

    EVENT = AUTHORISATION
    #: Ask for a manual capture (`additionalData.manualCapture`): the amount is only held.
    MANUAL: ClassVar[bool] = False

    def request(self) -> dict[str, Any]:
        params = self.params
        request: dict[str, Any] = {
            "amount": {"value": int(params["amount"]), "currency": str(params["currency"]).upper()},
            "paymentMethod": payment_method(str(params["payment_method"])),
            "returnUrl": RETURN_URL,
            "metadata": {"order_id": str(params["order_id"])},
        }
        if self.MANUAL:
            request["additionalData"] = {"manualCapture": "true"}
        return request

    def send(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        answer = self.adyen.pay(request, idempotency_key=idempotency_key)
        return self.answered(answer)

    def answered(self, answer: Answer) -> EffectResult:
        body = answer.body
        psp, code = str(body.get("pspReference") or ""), str(body.get("resultCode") or "")
        if code == "Authorised":
            return self.succeeded(psp, **self.money_data(), status=code)
        if code in REFUSED_CODES:
            reason = str(body.get("refusalReasonCode") or body.get("refusalReason") or code)
            return self.refused(psp, **self.money_data(), status=code, code=reason)
        raise StillInProgress(f"Adyen answered {code or 'no result code'}", reference=psp)

    def money_data(self) -> dict[str, Any]:
        params = self.params
        key = "held" if self.MANUAL else "amount"
        return {key: int(params["amount"]), "currency": str(params["currency"])}

    def verify(self, claim: ClaimView, reference: str) -> EffectResult:
        """An operator's reference for this payment: a signed notification decides when one
        came (it must name that reference, succeeded); without one, Adyen offers nothing to
        read, and the operator's reading of Adyen's report is recorded as the evidence."""
        if self.notification(claim) is not None:
            return super().verify(claim, reference)
        if not PSP_REFERENCE.fullmatch(reference):
            raise ValueError(f"{reference!r} is not an Adyen pspReference (16 letters and digits)")
        return self.succeeded(
            reference,
            **self.money_data(),
            status="Authorised",
            evidence="the operator's reading of Adyen's report",
        )

    def settled_by(self, note: Notification) -> EffectResult:
        if note.success:
            return self.succeeded(note.psp_reference, **self.money_data(), status="Authorised")
        return self.refused(
            note.psp_reference, **self.money_data(), status="Refused", code=note.reason or "refused"
        )


class AdyenCharge(AdyenPayment):
    """The order's charge through Adyen (captured at once, Adyen's default)."""

    AUDITED = "payment"  # a step that takes the customer's money
    MAY_HAVE_HAPPENED = "The customer may already have been charged at Adyen."


class AdyenAuthorization(AdyenPayment):
    """Hold the order's amount at Adyen (manual capture)."""

    MANUAL = True
    MAY_HAVE_HAPPENED = "The customer's card may already hold the amount at Adyen."
    HOLD = "hold"

    @classmethod
    def money(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        return None  # a hold moves no money

    @classmethod
    def held(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        held, currency = result.get("held"), result.get("currency")
        if isinstance(held, int) and isinstance(currency, str):
            return held, currency
        return None


class AdyenModification(AdyenEffect):
    """A modification of a payment by its pspReference: received now, settled by notification."""

    TARGET = "payment"
    KIND: ClassVar[str] = ""

    def payment(self) -> str:
        """The pspReference of the payment the modification acts on."""
        raise NotImplementedError

    def amount(self) -> int | None:
        return None

    def request(self) -> dict[str, Any]:
        request: dict[str, Any] = {"payment": self.payment()}
        amount = self.amount()
        if amount is not None:
            currency = str(self.params["currency"]).upper()
            request["amount"] = {"value": amount, "currency": currency}
        return request

    def send(self, request: dict[str, Any], idempotency_key: str) -> EffectResult:
        body = {k: v for k, v in request.items() if k != "payment"}
        answer = self.adyen.modify(
            self.KIND, str(request["payment"]), body, idempotency_key=idempotency_key
        )
        psp = str(answer.body.get("pspReference") or "")
        # "received" is not the outcome: the claim keeps the modification's pspReference,
        # unsettled, until its notification (see the module's docstring).
        raise StillInProgress(f"{self.KIND} {psp} received by Adyen", reference=psp)

    def result_data(self, note: Notification) -> dict[str, Any]:
        return {
            "amount": note.amount,
            "currency": str(self.params["currency"]),
            # The shop's name for the payment the money sits on (its invoice and refunds).
            "payment_intent": note.original_reference,
        }

    def settled_by(self, note: Notification) -> EffectResult:
        data = self.result_data(note)
        if note.success:
            return self.succeeded(note.psp_reference, **data, status="succeeded")
        return self.refused(
            note.psp_reference, **data, status="failed", code=note.reason or "refused"
        )


class AdyenCapture(AdyenModification):
    """Capture `amount_to_capture` of the authorisation (Adyen releases the rest)."""

    KIND, EVENT = CAPTURES, CAPTURE
    AUDITED, AUDIT_ID = "payment", "payment_intent"
    MAY_HAVE_HAPPENED = "The held amount may already have been captured at Adyen."
    HOLD = "capture"

    def payment(self) -> str:
        return str(self.run.result("authorize")["reference"])

    def amount(self) -> int | None:
        return int(self.params["amount_to_capture"])


class AdyenCancel(AdyenModification):
    """Cancel the authorisation, which releases a hold nobody will capture."""

    KIND, EVENT = CANCELS, CANCELLATION
    HOLD = "release"

    def payment(self) -> str:
        return str(self.run.result("authorize")["reference"])

    @classmethod
    def money(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        return None


class AdyenRefund(AdyenModification):
    """Refund the operation's amount of the order's payment."""

    KIND, EVENT = REFUNDS, REFUND
    AUDITED = "refund"
    AUDIT_PARENT = "payment_intent"  # the shop's refund names the payment it refunds so
    MAY_HAVE_HAPPENED = "The customer may already have been refunded at Adyen."

    def payment(self) -> str:
        return str(self.params["payment_intent"])

    def amount(self) -> int | None:
        return int(self.params["amount"])
