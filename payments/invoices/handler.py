"""The `invoice_export` operation: a paid order's invoice, exported once.

Declared a follow-up of a paid order (`follows=Follows(ORDER_PAID, when=exporting)`):
whatever pays the order writes it in the transaction that marks the order paid, where
the deployment turns it on with
`PAYMENTS["SYSTEMS"]["accounting"]["OPTIONS"]["EXPORT_PAID_ORDERS"]`; its job is enqueued
on commit and the sweeper re-enqueues it if that is lost. One external step.
"""

from __future__ import annotations

from payments.conf import payments_settings
from payments.fence import Desk, Follows, Run, operation
from payments.invoices.effect import ExportInvoice
from payments.invoices.names import ACCOUNTING, EXPORT, INVOICE_EXPORT
from payments.models import Operation
from payments.money import format_money
from payments.shop.entities import ORDER_PAID, lock_order
from payments.shop.models import Order


def describe(op: Operation) -> str:
    """One line for the desk: what is exported (no money moves)."""
    total = format_money(op.params.get("amount"), op.params.get("currency"))
    return f"invoice of order {op.params.get('order_id')} ({total}) to the accounting system"


def exporting() -> bool:
    """Whether this deployment exports paid orders (its accounting entry turns it on)."""
    entry = payments_settings().system(ACCOUNTING)
    return entry is not None and entry.option("EXPORT_PAID_ORDERS", False) is True


@operation(
    INVOICE_EXPORT,
    follows=Follows(ORDER_PAID, when=exporting),
    entity=Order,
    steps={EXPORT: ExportInvoice},
    desk=Desk(lock_entity=lock_order, describe=describe),
)
def export_invoice(run: Run) -> None:
    """Make the order's invoice at the accounting system, once."""
    run.external(EXPORT)
