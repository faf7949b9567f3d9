"""Adyen's answers the fence acts on, in one table: permanent, transient or uncertain.

Each error carries its `outcome` (payments.engine.outcomes via the fence's contract) and
log-safe fields only: HTTP status, Adyen's `errorCode`, the request's pspReference.

=====================================  ===========  ==========================================
Answer                                 Outcome      Why
=====================================  ===========  ==========================================
no connection, connect timeout         transient    nothing was sent
read timeout, reset after send         uncertain    Adyen may have executed it
409 / 422 ``704`` (key in flight)      transient    the first request decides; replay later
any answer with ``transient-error``    transient    Adyen says nothing was executed
429                                    transient    rate limited, nothing executed
401 / 403 (key, merchant account)      permanent    refused before anything executed; a
                                                    retry under the same key is refused too
400 / 404 / 422 (validation)           permanent    the request itself is wrong
500 and other 5xx                      uncertain    Adyen may have executed it and stores
                                                    the answer under the key
200 ``Refused`` / ``Error``            permanent    a decline (read by the charge effect)
=====================================  ===========  ==========================================

401 and 403 are permanent as this package's brief asks; the Stripe-compatible provider's
table (payments.provider.errors) retries them instead. Either way nothing was executed:
after fixing the key or merchant account an operator starts a new attempt.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from typing import Any

import requests
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError

from payments.engine.outcomes import EffectError, Outcome

#: Adyen's error code for "request already processed or in progress" (a key in flight).
IN_PROGRESS = "704"
TRANSIENT_HEADER = "transient-error"

_CONNECT_PHASE = (NewConnectionError, ConnectTimeoutError, ConnectionRefusedError, socket.gaierror)


class AdyenError(EffectError):
    """A call to Adyen that did not return a usable answer; `outcome` tells the fence what to
    do (an EffectError of any outcome: the table above decides it)."""

    def __init__(
        self,
        message: str,
        *,
        outcome: Outcome | None = None,
        http_status: int | None = None,
        code: str = "",
        psp_reference: str = "",
        in_flight: bool = False,
    ) -> None:
        # Adyen's pspReference of the request is what its support asks for first.
        super().__init__(
            message,
            outcome=outcome,
            http_status=http_status,
            code=code,
            request_id=psp_reference or None,
        )
        #: Another request under the same key is still being executed (`704`).
        self.in_flight = in_flight


def _causes(exc: BaseException) -> Iterator[BaseException]:
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


def from_transport(exc: requests.RequestException, *, context: str) -> AdyenError:
    """A transport failure: before the send TRANSIENT, after it UNCERTAIN."""
    name = type(exc).__name__
    if isinstance(exc, requests.ConnectTimeout) or any(
        isinstance(cause, _CONNECT_PHASE) for cause in _causes(exc)
    ):
        return AdyenError(f"{context}: could not connect ({name})", outcome=Outcome.TRANSIENT)
    return AdyenError(f"{context}: no complete answer ({name})", outcome=Outcome.UNCERTAIN)


def from_answer(status: int, body: Any, headers: Mapping[str, str], *, context: str) -> AdyenError:
    """A non-2xx answer, classified by the table above."""
    body = body if isinstance(body, dict) else {}
    code = str(body.get("errorCode") or "")
    psp = str(body.get("pspReference") or "")
    message = f"{context}: HTTP {status}" + (f" {code}" if code else "")
    transient = str(_header(headers, TRANSIENT_HEADER)).lower() == "true"

    def error(outcome: Outcome, *, in_flight: bool = False) -> AdyenError:
        return AdyenError(
            message,
            outcome=outcome,
            http_status=status,
            code=code,
            psp_reference=psp,
            in_flight=in_flight,
        )

    if code == IN_PROGRESS and status in (409, 422):
        return error(Outcome.TRANSIENT, in_flight=True)
    if transient or status == 429:
        return error(Outcome.TRANSIENT)
    if 400 <= status < 500:
        return error(Outcome.PERMANENT)
    return error(Outcome.UNCERTAIN)


def _header(headers: Mapping[str, str], name: str) -> str:
    """A header by name, whatever its case (the library hands back a case-insensitive dict or
    a plain one)."""
    for key, value in (headers or {}).items():
        if key.lower() == name:
            return str(value)
    return ""
