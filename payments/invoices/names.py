"""The export's operation kind, step and system names, declared once.

The kind follows a paid order (declared on the operation, payments.invoices.handler);
the step name feeds the idempotency key of every request.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ACCOUNTING", "EXPORT", "INVOICE_EXPORT"]

#: The operation: a paid order's invoice, exported.
INVOICE_EXPORT: Final = "invoice_export"
#: The system's name: its settings entry is PAYMENTS["SYSTEMS"]["accounting"].
ACCOUNTING: Final = "accounting"

#: The one external step: POST the invoice to the accounting system.
EXPORT: Final = "export"
