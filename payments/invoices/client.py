"""HTTP client for the accounting API (the contract of devtools.fake_provider.accounting).

Like the payment provider's client it knows no database, sends one request per call and
never retries on its own (a retry is the fence's, under the same key, counted); every
failure becomes a ProviderError (payments.provider.errors) whose `outcome` tells the fence
what may have happened there. The accounting API's own table (`classify`):

- TRANSIENT, nothing executed: no connection, `409 request_in_progress` (the key's first
  request is in flight: `in_flight`), `429`.
- UNCERTAIN, it may have executed: a read timeout or a reset after the request went out,
  a 2xx that is not an invoice, any 5xx (the API stores a 500 under the key: a replay gets
  it again, and only the list tells).
- CONFLICT: `422 idempotency_key_reused`, the key was used with another body: a bug,
  never retried (the operation goes to review).
- PERMANENT: `400` (a malformed body), `401`/`403` (a wrong key: the export fails, and
  an operator runs it again once the key is fixed), `404`, any other 4xx.

Logs carry the method, path, status and key only: never the API key or a body (an
invoice names the customer).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import requests

from payments.conf import payments_settings
from payments.exceptions import ConfigurationError
from payments.invoices.names import ACCOUNTING
from payments.provider.client import MAX_IDLE_SECONDS, new_session
from payments.provider.errors import (
    IdempotencyConflict,
    InvalidRequest,
    ProviderError,
    ResourceMissing,
    TransientProviderError,
    UncertainProviderError,
    classify_exception,
)

logger = logging.getLogger(__name__)

INVOICES_PATH = "/v1/invoices"
KEY_REUSED = "idempotency_key_reused"
REPLAYED_HEADER = "Idempotent-Replayed"

#: This process's session and when it was last used: (pid, session, monotonic time).
_session: tuple[int, requests.Session, float] | None = None
_session_lock = threading.Lock()


def _process_session() -> requests.Session:
    """This process's session: kept-alive connections reused across jobs, rebuilt after a
    fork (never the parent's sockets) and after MAX_IDLE_SECONDS unused, before the server
    closes its idle connections under a new request (as the provider's client does)."""
    global _session
    with _session_lock:
        now, current = time.monotonic(), _session
        if current is None or current[0] != os.getpid() or now - current[2] > MAX_IDLE_SECONDS:
            if current is not None and current[0] == os.getpid():
                current[1].close()
            current = (os.getpid(), new_session(pool_maxsize=2), now)
        _session = (current[0], current[1], now)
        return current[1]


#: Called once per request with what the fence's rows keep of it (method, path, status,
#: key, replayed, error): payments.fence.note_request.
Observer = Callable[..., None]


@dataclass(frozen=True)
class Invoice:
    """An invoice as the accounting API answers it."""

    id: str
    external_id: str
    status: str
    total: int
    currency: str
    created: int
    replayed: bool = False

    @classmethod
    def from_json(cls, data: Any, *, replayed: bool = False) -> Invoice:
        """Build from a decoded answer; ValueError when it is not an invoice."""
        if not isinstance(data, dict):
            raise ValueError("not an invoice")
        fields = {name: data.get(name) for name in ("id", "external_id", "status", "currency")}
        if not all(isinstance(value, str) and value for value in fields.values()):
            raise ValueError("an invoice without its id, external id, status or currency")
        total, created = data.get("total"), data.get("created")
        if not (isinstance(total, int) and isinstance(created, int)):
            raise ValueError("an invoice without its total or creation time")
        return cls(**fields, total=total, created=created, replayed=replayed)  # type: ignore[arg-type]


def classify(status: int, body: Any, headers: Any, *, context: str) -> ProviderError:
    """Turn a non-2xx answer of the accounting API into the ProviderError the fence acts on."""
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    attrs: dict[str, Any] = {
        "http_status": status,
        "code": code if isinstance(code, str) else None,
        "param": error.get("param") if isinstance(error, dict) else None,
        "replayed": headers.get(REPLAYED_HEADER, "").lower() == "true",
    }
    message = f"{context}: HTTP {status}" + (f" {attrs['code']}" if attrs["code"] else "")
    if status == 409:
        transient = TransientProviderError(message, **attrs)
        transient.in_flight = True
        return transient
    if status == 429:
        return TransientProviderError(message, **attrs)
    if status == 422 and attrs["code"] == KEY_REUSED:
        return IdempotencyConflict(message, **attrs)
    if status == 404:
        return ResourceMissing(message, **attrs)
    if 400 <= status < 500:
        return InvalidRequest(message, **attrs)
    return UncertainProviderError(message, **attrs)


class AccountingClient:
    """The accounting API's client: create an invoice under a key, list, retrieve."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        observe: Observer | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("api_key is required")
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.timeout = (float(connect_timeout), float(read_timeout))
        self._observe = observe

    @classmethod
    def from_settings(cls, *, observe: Observer | None = None) -> AccountingClient:
        """Build the client from PAYMENTS["SYSTEMS"]["accounting"] (the provider's timeouts
        when the entry sets none)."""
        conf = payments_settings()
        entry = conf.system(ACCOUNTING)
        if entry is None:
            raise ConfigurationError(
                f"PAYMENTS['SYSTEMS'][{ACCOUNTING!r}] is not configured (its URL and API_KEY)"
            )
        return cls(
            entry.url,
            entry.api_key,
            connect_timeout=entry.connect_timeout,
            read_timeout=entry.read_timeout,
            observe=observe,
        )

    def __repr__(self) -> str:
        return f"AccountingClient({self.base_url!r})"

    def create_invoice(self, invoice: dict[str, Any], *, idempotency_key: str) -> Invoice:
        """POST the invoice under the key; the stored answer when the key replays."""
        if not idempotency_key or len(idempotency_key) > 255:
            raise ValueError("idempotency_key must be 1 to 255 characters")
        body, replayed = self._request(
            "POST", INVOICES_PATH, json=invoice, idempotency_key=idempotency_key
        )
        return self._invoice(body, replayed, "POST invoice")

    def list_invoices(self, *, external_id: str) -> Iterator[Invoice]:
        """Every invoice carrying `external_id` (a consistent read)."""
        body, replayed = self._request("GET", INVOICES_PATH, params={"external_id": external_id})
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise UncertainProviderError("GET invoices: the answer is not a list")
        return iter([self._invoice(item, replayed, "GET invoices") for item in data])

    def retrieve_invoice(self, invoice_id: str) -> Invoice:
        """One invoice by id; ResourceMissing when there is none."""
        if not invoice_id or "/" in invoice_id or "?" in invoice_id:
            raise ValueError("invalid invoice id")
        body, replayed = self._request("GET", f"{INVOICES_PATH}/{invoice_id}")
        return self._invoice(body, replayed, "GET invoice")

    def _invoice(self, body: Any, replayed: bool, context: str) -> Invoice:
        try:
            return Invoice.from_json(body, replayed=replayed)
        except ValueError as exc:
            raise UncertainProviderError(f"{context}: the answer is not an invoice") from exc

    def _request(
        self, method: str, path: str, *, idempotency_key: str | None = None, **kwargs: Any
    ) -> tuple[Any, bool]:
        """Send one request; return (decoded body, replayed) of a 2xx, else raise."""
        headers = {"Authorization": f"Bearer {self._api_key}"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        context = f"{method} {path}"
        try:
            answer = _process_session().request(
                method, self.base_url + path, headers=headers, timeout=self.timeout, **kwargs
            )
        except requests.RequestException as exc:
            failure = classify_exception(exc, context=context)
            self._note(method, path, None, idempotency_key, error=type(exc).__name__)
            raise failure from exc
        replayed = answer.headers.get(REPLAYED_HEADER, "").lower() == "true"
        self._note(method, path, answer.status_code, idempotency_key, replayed=replayed)
        try:
            body = answer.json()
        except ValueError:
            body = None
        if 200 <= answer.status_code < 300:
            return body, replayed
        raise classify(answer.status_code, body, answer.headers, context=context)

    def _note(
        self,
        method: str,
        path: str,
        status: int | None,
        key: str | None,
        *,
        replayed: bool = False,
        error: str = "",
    ) -> None:
        logger.info("accounting %s %s -> %s key=%s", method, path, status, key)
        if self._observe is not None:
            self._observe(
                method,
                path,
                status=status,
                request_id=None,
                idempotency_key=key,
                replayed=replayed,
                error=error,
            )
