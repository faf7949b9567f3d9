"""The export's operation kind, step and system names, declared once.

The kind is written by whoever pays an order (payments.entities, where the follow-ups of
a paid order are named); the step name feeds the idempotency key of every request.
"""

from __future__ import annotations

from typing import Final

from payments.entities import ACCOUNTING, INVOICE_EXPORT

__all__ = ["ACCOUNTING", "EXPORT", "INVOICE_EXPORT"]

#: The one external step: POST the invoice to the accounting system.
EXPORT: Final = "export"
