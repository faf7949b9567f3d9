"""The Adyen Checkout client: payments and modifications, with an idempotency key each.

Built on Adyen's official Python library (`Adyen`, pinned in requirements.txt), not on
requests directly, because it does what the fence needs and nothing has to be patched:
its services take an `idempotency_key` on every call and send it as `Idempotency-Key`;
their `baseUrl` is public and documented as the way to point them elsewhere (its README,
"Customizing Base URL"), which is how PAYMENTS["SYSTEMS"]["adyen"]["URL"] reaches it;
with `http_force="requests"` its timeout goes to requests unchanged, so a (connect, read)
pair keeps the fence's timeout chain; its exceptions keep the HTTP status, Adyen's
`errorCode` and the headers (`transient-error`), which `payments.adyen.errors` classifies.
Transport failures surface as requests' own exceptions, classified likewise.

This module knows no database and no fence state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import Adyen  # type: ignore[import-untyped]  # the library ships no type information
import requests
from Adyen.exceptions import AdyenAPIResponseError  # type: ignore[import-untyped]

from payments.adyen.errors import AdyenError, from_answer, from_transport
from payments.adyen.system import NAME
from payments.conf import payments_settings
from payments.exceptions import ConfigurationError

#: The modifications by pspReference, by the path segment Adyen names them with.
CAPTURES, REFUNDS, CANCELS = "captures", "refunds", "cancels"


@dataclass(frozen=True)
class Answer:
    """Adyen's 2xx answer: its status (200 for a payment, 201 for a modification) and body."""

    status: int
    body: dict[str, Any]


class AdyenClient:
    """Calls to one Adyen merchant account's Checkout API."""

    def __init__(
        self,
        *,
        url: str,
        api_key: str,
        merchant_account: str,
        connect_timeout: float,
        read_timeout: float,
    ) -> None:
        self.merchant_account = merchant_account
        adyen = Adyen.Adyen(
            xapikey=api_key,
            platform="test",  # replaced by baseUrl below, for both test and live URLs
            http_force="requests",
            http_timeout=(connect_timeout, read_timeout),
        )
        self._checkout = adyen.checkout
        base = url.rstrip("/")
        self._checkout.payments_api.baseUrl = base
        self._checkout.modifications_api.baseUrl = base

    @classmethod
    def from_settings(cls) -> AdyenClient:
        """The client of PAYMENTS["SYSTEMS"]["adyen"]; ConfigurationError when it is missing."""
        conf = payments_settings()
        entry = conf.system(NAME)
        if entry is None:
            raise ConfigurationError(
                'a shop pays through Adyen but PAYMENTS["SYSTEMS"]["adyen"] is not configured'
            )
        merchant = entry.option("MERCHANT_ACCOUNT")
        if not merchant:
            raise ConfigurationError(
                'PAYMENTS["SYSTEMS"]["adyen"]["OPTIONS"] needs MERCHANT_ACCOUNT'
            )
        return cls(
            url=entry.url,
            api_key=entry.api_key,
            merchant_account=str(merchant),
            connect_timeout=entry.connect_timeout,
            read_timeout=entry.read_timeout,
        )

    def pay(self, body: dict[str, Any], *, idempotency_key: str) -> Answer:
        """`POST /payments`: 200 with a resultCode (Authorised, Refused, ...)."""
        body = {**body, "merchantAccount": self.merchant_account}
        return self._call(
            "payment",
            lambda: self._checkout.payments_api.payments(body, idempotency_key=idempotency_key),
        )

    def modify(
        self, kind: str, psp_reference: str, body: dict[str, Any], *, idempotency_key: str
    ) -> Answer:
        """`POST /payments/{psp}/captures|refunds|cancels`: 201 "received", the outcome later
        in a notification."""
        api = self._checkout.modifications_api
        call = {
            CAPTURES: api.capture_authorised_payment,
            REFUNDS: api.refund_captured_payment,
            CANCELS: api.cancel_authorised_payment_by_psp_reference,
        }[kind]
        body = {**body, "merchantAccount": self.merchant_account}
        return self._call(kind, lambda: call(body, psp_reference, idempotency_key=idempotency_key))

    @staticmethod
    def _call(context: str, send: Any) -> Answer:
        try:
            result = send()
        except requests.RequestException as exc:
            raise from_transport(exc, context=f"adyen {context}") from exc
        except AdyenAPIResponseError as exc:  # any non-2xx answer (Adyen/client.py)
            body = exc.message if isinstance(exc.message, dict) else {}
            raise from_answer(
                int(exc.status_code or 0), body, exc.headers or {}, context=f"adyen {context}"
            ) from exc
        message = result.message if isinstance(result.message, dict) else {}
        return Answer(int(result.status_code), message)


__all__ = ["CANCELS", "CAPTURES", "REFUNDS", "AdyenClient", "AdyenError", "Answer"]
