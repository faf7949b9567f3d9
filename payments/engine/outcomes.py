"""How an attempt at an external effect ended, as the fence needs to know it.

A leaf module shared by the provider client (which classifies its failures)
and the fence runtime (which acts on the class). It imports nothing of either.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """The class of an attempt's result; each class has one fence reaction."""

    SUCCESS = "success", "The effect happened; record it."
    PERMANENT = "permanent", "Refused for good (decline, invalid request); fail, no retry."
    TRANSIENT = "transient", "Nothing executed (refused, 409, 429, retryable 5xx); retry same key."
    UNCERTAIN = "uncertain", "It may have executed (timeout, reset, 5xx); reconcile, never fail."
    CONFLICT = "conflict", "Same idempotency key, other parameters: a bug; needs review."

    def __new__(cls, value: str, doc: str) -> Outcome:
        member = str.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member
