"""Signals of the inbox app, so that others can observe it without it knowing them."""

from __future__ import annotations

from django.dispatch import Signal

#: Sent when a redelivered message is skipped; kwargs: consumer, message_id.
duplicate_skipped = Signal()
