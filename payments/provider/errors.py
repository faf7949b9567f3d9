"""Errors raised by the payment provider client, each carrying its `Outcome`.

The fence acts on `error.outcome` alone; the other attributes are for the
record, the audit trail and the operator. Messages are built from those
structured fields only, never from request or response bodies, so they can be
logged and stored without leaking card data, keys or customer details.

`classify_exception` and `classify_response` (at the end) hold the one table
that maps transport failures and HTTP answers to these classes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import requests
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError

from payments.engine.outcomes import (
    ConflictError,
    EffectError,
    NotFoundError,
    Outcome,
    PermanentError,
    TransientError,
    UncertainError,
)

# Stripe's error codes for a refused refund (https://docs.stripe.com/error-codes),
# all on a 400 invalid_request_error (InvalidRequest, PERMANENT):
#: the amount is more than what is left of the charge.
REFUND_AMOUNT_TOO_LARGE = "amount_too_large"
#: nothing is left: the charge is already fully refunded.
CHARGE_ALREADY_REFUNDED = "charge_already_refunded"
#: the PaymentIntent's status does not allow the request: a refund of an intent
#: without a successful (captured) charge, a confirm of a succeeded or canceled
#: intent, a cancel of a succeeded one, a capture of an intent not in
#: `requires_capture`. The error carries the intent (`payment_intent_status`).
PAYMENT_INTENT_UNEXPECTED_STATE = "payment_intent_unexpected_state"
#: the refund's name for it: the PaymentIntent has no successful charge.
PAYMENT_INTENT_NOT_REFUNDABLE = PAYMENT_INTENT_UNEXPECTED_STATE
#: a capture of more than the intent holds (`amount_capturable`), param
#: `amount_to_capture`. Stripe answers "the requested capture amount is greater
#: than the authorized amount"; its code is taken to be the general one.
CAPTURE_AMOUNT_TOO_LARGE = "amount_too_large"


class ProviderError(EffectError):
    """Base class: a call to the Stripe-compatible provider did not return a usable success.

    An EffectError with the provider's own fields besides (its error type, decline
    code, param, and the PaymentIntent an error names); each subclass is also the
    neutral class of its outcome (CardDeclined is a PermanentError, ...).
    """

    def __init__(
        self,
        message: str,
        *,
        outcome: Outcome | None = None,
        http_status: int | None = None,
        error_type: str | None = None,
        code: str | None = None,
        decline_code: str | None = None,
        param: str | None = None,
        request_id: str | None = None,
        payment_intent_id: str | None = None,
        payment_intent_status: str | None = None,
        replayed: bool = False,
    ) -> None:
        super().__init__(
            message,
            outcome=outcome,
            http_status=http_status,
            code=code,
            request_id=request_id,
            replayed=replayed,
        )
        self.error_type = error_type
        self.decline_code = decline_code
        self.param = param
        self.payment_intent_id = payment_intent_id
        #: The intent's status as the error reported it (a decline, an unexpected state).
        self.payment_intent_status = payment_intent_status

    def as_dict(self) -> dict[str, object]:
        """Return the structured, log-safe fields (for claim results and events): the
        neutral ones and the provider's own."""
        return {
            **super().as_dict(),
            "error_type": self.error_type,
            "decline_code": self.decline_code,
            "param": self.param,
            "payment_intent_id": self.payment_intent_id,
            "payment_intent_status": self.payment_intent_status,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, outcome={self.outcome.value!r}, "
            f"http_status={self.http_status!r}, code={self.code!r}, "
            f"request_id={self.request_id!r})"
        )


class CardDeclined(ProviderError, PermanentError):
    """The card was declined (HTTP 402): refused for good, no retry."""

    default_outcome = Outcome.PERMANENT


class InvalidRequest(ProviderError, PermanentError):
    """The provider rejected the request as invalid (400 other than idempotency, or 404)."""

    default_outcome = Outcome.PERMANENT


class ResourceMissing(InvalidRequest, NotFoundError):
    """The object asked for does not exist at the provider (404 resource_missing)."""


class IdempotencyConflict(ProviderError, ConflictError):
    """The idempotency key was used before with other parameters: a bug, never retried."""

    default_outcome = Outcome.CONFLICT


class TransientProviderError(ProviderError, TransientError):
    """Nothing was executed; retry the same request with the same key."""

    default_outcome = Outcome.TRANSIENT


class UncertainProviderError(ProviderError, UncertainError):
    """The provider may have executed the request; reconcile before anything else."""

    default_outcome = Outcome.UNCERTAIN


# Errors that can only happen while opening the connection: the request was
# never sent, so retrying with the same key cannot double anything.
_CONNECT_PHASE_ERRORS: tuple[type[BaseException], ...] = (
    NewConnectionError,  # includes urllib3's NameResolutionError (DNS)
    ConnectTimeoutError,
    ConnectionRefusedError,
    socket.gaierror,
)

# requests raises these before anything goes on the wire: a broken
# PROVIDER_URL is a configuration problem, handled like 401 (see below).
_NOT_SENT_REQUEST_ERRORS: tuple[type[BaseException], ...] = (
    requests.exceptions.URLRequired,
    requests.exceptions.MissingSchema,
    requests.exceptions.InvalidSchema,
    requests.exceptions.InvalidURL,
    requests.exceptions.InvalidHeader,
)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """Yield exc and everything it wraps (causes, contexts, args, urllib3 `reason`)."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend([current.__cause__, current.__context__, getattr(current, "reason", None)])
        stack.extend(arg for arg in current.args if isinstance(arg, BaseException))


def _transport_failure(exc: requests.RequestException) -> tuple[Outcome, str]:
    """What a transport failure means: before send TRANSIENT, else UNCERTAIN; and its words."""
    if isinstance(exc, requests.exceptions.ConnectTimeout) or any(
        isinstance(cause, _CONNECT_PHASE_ERRORS) for cause in _causes(exc)
    ):
        return Outcome.TRANSIENT, f"could not connect ({type(exc).__name__})"
    if isinstance(exc, _NOT_SENT_REQUEST_ERRORS):
        return Outcome.TRANSIENT, f"request not sent ({type(exc).__name__})"
    # Read timeouts, resets after send, broken chunked bodies: the request
    # left this process, so the system may have executed it.
    return Outcome.UNCERTAIN, f"no complete answer ({type(exc).__name__})"


def classify_exception(exc: requests.RequestException, *, context: str) -> ProviderError:
    """Turn a transport failure into the payment provider's ProviderError: before send
    TRANSIENT, else UNCERTAIN (a Stripe-shaped client's; any other system's client uses
    `classify_request_failure`)."""
    outcome, words = _transport_failure(exc)
    if outcome == Outcome.TRANSIENT:
        return TransientProviderError(f"{context}: {words}")
    return UncertainProviderError(f"{context}: {words}")


def classify_request_failure(exc: requests.RequestException, *, context: str) -> EffectError:
    """Turn a transport failure into any system's neutral error: `TransientError` before
    the request was sent, else `UncertainError` (the desk and the audit trail show these
    names, not the payment provider's)."""
    outcome, words = _transport_failure(exc)
    if outcome == Outcome.TRANSIENT:
        return TransientError(f"{context}: {words}")
    return UncertainError(f"{context}: {words}")


def classify_response(
    status: int, body: Any, headers: Mapping[str, str], *, context: str
) -> ProviderError:
    """Turn a non-2xx answer into the ProviderError the fence acts on."""
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    pi = error.get("payment_intent")
    pi = pi if isinstance(pi, dict) else {}
    pi_id, pi_status = pi.get("id"), pi.get("status")
    attrs: dict[str, Any] = {
        "http_status": status,
        "error_type": error.get("type"),
        "code": error.get("code"),
        "decline_code": error.get("decline_code"),
        "param": error.get("param"),
        "request_id": headers.get("Request-Id"),
        "payment_intent_id": pi_id if isinstance(pi_id, str) else None,
        "payment_intent_status": pi_status if isinstance(pi_status, str) else None,
        "replayed": headers.get("Idempotent-Replayed", "").lower() == "true",
    }
    label = "/".join(str(part) for part in (attrs["error_type"], attrs["code"]) if part)
    message = f"{context}: HTTP {status}" + (f" {label}" if label else "")
    should_retry = headers.get("Stripe-Should-Retry", "").lower()

    if status == 409 or should_retry == "true":
        # The provider states that nothing was executed and a retry may work.
        # A 409 means another request with the same key is in flight: this one
        # did nothing, but that one may still succeed (Stripe sends the 409
        # with Stripe-Should-Retry: true, so this is checked first).
        error = TransientProviderError(message, **attrs)
        error.in_flight = status == 409
        return error
    if status == 402:
        return CardDeclined(message, **attrs)
    if status == 400 and attrs["error_type"] == "idempotency_error":
        return IdempotencyConflict(message, **attrs)
    if status == 400 and attrs["code"] == "rate_limit":
        # Stripe's older way of saying 429.
        return TransientProviderError(message, **attrs)
    if status in (401, 403):
        # Authentication and permission failures are refused before anything
        # executes, and they come from our configuration (a rotated or wrong
        # key), not from the order. Failing the order for good would punish the
        # customer for an operator mistake; TRANSIENT makes the fence retry
        # with bounded attempts and then park the job in the failed registry
        # with an alert; once the key is fixed an operator starts new attempts
        # (nothing executed under the old key).
        return TransientProviderError(message, **attrs)
    if status == 429:
        # Rate limited: nothing executed, nothing stored for the key.
        return TransientProviderError(message, **attrs)
    if status == 404:
        if attrs["code"] == "resource_missing":
            return ResourceMissing(message, **attrs)
        return InvalidRequest(message, **attrs)
    if 400 <= status < 500:
        return InvalidRequest(message, **attrs)
    # 5xx (also with Should-Retry: false) and anything unexpected: the provider
    # may have executed the request and stores this answer for the key.
    return UncertainProviderError(message, **attrs)
