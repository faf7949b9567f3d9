"""The refund's operation kind and step names, declared once (they feed idempotency keys)."""

from __future__ import annotations

from typing import Final

#: Give back part or all of a paid order's charge: refund -> credit note.
REFUND: Final = "refund"
#: The external step: a refund at the provider, against the order's payment intent.
REFUND_STEP: Final = "refund"
#: The local step: the credit note and the order's refunded total, written once.
CREDIT_NOTE: Final = "credit_note"
#: The local step that records, once, that the provider reversed a refund (it failed after
#: it succeeded) and the order got its refunded amount back.
REFUND_REVERSED: Final = f"{REFUND_STEP}:reversed"  # the engine's name for it
