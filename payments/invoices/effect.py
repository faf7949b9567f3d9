"""`ExportInvoice`: POST a paid order's invoice to the accounting system, once.

The fence claims the step and stores its request before the call, then sends it under the
claim's idempotency key. A lost answer (the worker killed after the 201, a reset, a 500
the API stored under the key) is settled by a same-key replay while the system keeps the
key, else by the list of invoices carrying the operation's `external_id`: a consistent read.

The accounting API stores no metadata, so the engine's lookup metadata is not sent
(`build_request`): the request's `external_id` is the reference the list finds, derived from
the operation (its key, scoped by its id, so that no other operation's key names it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from payments.fence import ClaimView, EffectResult, ProviderEffect, note_request
from payments.invoices.client import AccountingClient, Invoice
from payments.invoices.system import SYSTEM
from payments.shop.models import Order


def external_id(operation: Any) -> str:
    """The export's reference at the accounting system: stable for the operation."""
    return f"{operation.key}@{operation.pk}"


class ExportInvoice(ProviderEffect):
    """The invoice of a paid order, made once at the accounting system."""

    SYSTEM = SYSTEM.name
    MAY_HAVE_HAPPENED = "The invoice may already exist in the accounting system."

    def __init__(self, run: Any, step: str, client: AccountingClient | None = None) -> None:
        self.run = run
        self.step = step
        self.operation = run.operation
        # Built now, before any claim: a missing settings entry fails the step, not its call.
        self.accounting = client or AccountingClient.from_settings(observe=note_request)

    def request(self) -> dict[str, Any]:
        params = self.params
        amount, order_id = int(params["amount"]), int(params["order_id"])
        customer = Order.objects.values_list("customer_email", flat=True).get(pk=order_id)
        return {
            "external_id": external_id(self.operation),
            "customer": customer,
            "currency": str(params["currency"]).lower(),
            "lines": [{"description": f"Order {order_id}", "amount": amount}],
            "total": amount,
        }

    def build_request(self) -> dict[str, Any]:
        """The request as the API takes it: it stores no metadata (the list finds the
        invoice by its `external_id`)."""
        return dict(self.request())

    def send(self, request: dict[str, Any], idempotency_key: str) -> Invoice:
        return self.accounting.create_invoice(request, idempotency_key=idempotency_key)

    def retrieve(self, reference: str) -> Invoice:
        return self.accounting.retrieve_invoice(reference)

    def candidates(self, claim: ClaimView) -> Iterator[Invoice]:
        return self.accounting.list_invoices(external_id=str(claim.request["external_id"]))

    def outcome(self, obj: Invoice) -> EffectResult | None:
        return self.succeeded(
            obj.id,
            status=obj.status,
            external_id=obj.external_id,
            total=obj.total,
            currency=obj.currency,
        )

    def matches(self, obj: Any, request: dict[str, Any]) -> bool:
        """The invoice this request made: its external id, total and currency."""
        return (
            getattr(obj, "external_id", None) == request.get("external_id")
            and getattr(obj, "total", None) == request.get("total")
            and str(getattr(obj, "currency", "")).lower() == str(request.get("currency")).lower()
        )

    @classmethod
    def money(cls, result: dict[str, Any]) -> tuple[int, str] | None:
        """None: an invoice moves no money (the charge did)."""
        return None
