"""The checkout's operation kinds and step names, declared once.

Each feeds idempotency keys (a step's provider key is derived from the
operation key and the step name) and is recorded on every claim: renaming one
while operations are in flight would derive a new key for a step that already
ran. `payments.E010` compares the names recorded on unfinished operations with
the registered handlers, so a rename cannot ship silently.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CHARGE",
    "CHECKOUT",
    "CONFIRMATION_EMAIL",
    "COUNT_SALE",
    "INVOICE",
    "LEDGER_CONSUMER",
    "MARK_PAID",
    "RECORD_SALE",
    "SALES_STATS_CONSUMER",
]

#: The checkout of an order: charge -> invoice -> confirmation e-mail -> paid.
CHECKOUT: Final = "checkout"
CHARGE: Final = "charge"
INVOICE: Final = "invoice"
CONFIRMATION_EMAIL: Final = "confirmation_email"
MARK_PAID: Final = "mark_paid"

#: The follow-ups of a paid order (payments.checkout.followups): a ledger line and the
#: day's sales counter, delivered behind the inbox to these consumers.
RECORD_SALE: Final = "record_sale"
COUNT_SALE: Final = "count_sale"

LEDGER_CONSUMER: Final = "ledger"
SALES_STATS_CONSUMER: Final = "sales_stats"
