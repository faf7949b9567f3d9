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


class EffectError(Exception):
    """An external call that did not return a usable success; `outcome` says what the fence
    does (payments.engine.steps acts on it alone).

    Raise the subclass that says what your system's answer means: TransientError
    (nothing was done), UncertainError (it may have been done), PermanentError
    (refused for good), NotFoundError (a retrieve's 404: a PermanentError),
    ConflictError (the key was used with other parameters).
    Any other exception from an effect is taken as uncertain. The fields are
    for the record, the audit trail and the operator: build the message from
    them, never from request or response bodies (they are logged and stored).
    """

    default_outcome: Outcome = Outcome.UNCERTAIN
    #: True when another request under the same key is still being processed (a 409 "in
    #: progress"): this one did nothing, but that one may still succeed.
    in_flight = False

    def __init__(
        self,
        message: str,
        *,
        outcome: Outcome | None = None,
        http_status: int | None = None,
        code: str | None = None,
        request_id: str | None = None,
        replayed: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.outcome: Outcome = outcome if outcome is not None else self.default_outcome
        self.http_status = http_status
        #: The system's own error code ("card_declined", "704").
        self.code = code
        #: The system's id of the request, when it answered: what its support asks for.
        self.request_id = request_id
        #: True when the answer was a replay of an earlier request under the same key.
        self.replayed = replayed

    def as_dict(self) -> dict[str, object]:
        """The structured, log-safe fields (for a record or a log line)."""
        return {
            "error": type(self).__name__,
            "outcome": str(self.outcome),
            "message": self.message,
            "http_status": self.http_status,
            "code": self.code,
            "request_id": self.request_id,
            "replayed": self.replayed,
        }


class TransientError(EffectError):
    """Nothing was done: the same request is sent again under the same key, later."""

    default_outcome = Outcome.TRANSIENT


class UncertainError(EffectError):
    """It may have been done: never failed; replayed under the same key, or read, until known."""

    default_outcome = Outcome.UNCERTAIN


class PermanentError(EffectError):
    """Refused for good (a decline, an invalid request): the step fails, no retry."""

    default_outcome = Outcome.PERMANENT


class ConflictError(EffectError):
    """The idempotency key was used before with other parameters: a bug, never retried."""

    default_outcome = Outcome.CONFLICT


class NotFoundError(PermanentError):
    """The object asked for does not exist at the system (a retrieve's 404): a lookup
    found nothing there yet, a send was refused for good."""
