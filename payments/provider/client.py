"""HTTP client for the payment provider (a Stripe-compatible subset).

The client knows no database. It sends one request per call, never retries on
its own (retries belong to the fence, with the same idempotency key and a
bounded count), and turns every failure into a `ProviderError` whose
`outcome` tells the fence what may have happened at the provider:

- TRANSIENT: nothing was executed (connect failure, 401/403, 409, 429,
  `Stripe-Should-Retry: true`); retry with the same key.
- UNCERTAIN: it may have executed (read timeout, reset after send, broken or
  unparsable 2xx body, other 5xx); reconcile, never fail, never a new key.
- PERMANENT: refused for good (402 decline, 400, 404).
- CONFLICT: the key was used with other parameters (400 idempotency_error).

Refunds (`create_refund`, `retrieve_refund`, `list_refunds`) go through the
same table: a refused refund is an InvalidRequest (PERMANENT) whose `code`
says why (`errors.REFUND_AMOUNT_TOO_LARGE`, `errors.CHARGE_ALREADY_REFUNDED`,
`errors.PAYMENT_INTENT_NOT_REFUNDABLE`).

Logs carry method, path, status, request id, idempotency key, intent id and
refund id only: never the API key, the payment method, metadata values or
bodies.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from payments.engine.outcomes import Outcome
from payments.provider.errors import (
    ProviderError,
    UncertainProviderError,
    classify_exception,
    classify_response,
)

logger = logging.getLogger(__name__)

MAX_IDEMPOTENCY_KEY_LENGTH = 255
PAYMENT_INTENTS_PATH = "/v1/payment_intents"
REFUNDS_PATH = "/v1/refunds"
REFUND_REASONS = frozenset({"duplicate", "fraudulent", "requested_by_customer"})


@dataclass(frozen=True)
class PaymentIntent:
    """The fields of a provider PaymentIntent that the fence and the audit use."""

    id: str
    status: str
    amount: int
    currency: str
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    created: int = 0
    last_error_code: str | None = None
    replayed: bool = False

    @classmethod
    def from_json(cls, data: Any, *, replayed: bool = False) -> PaymentIntent:
        """Build from a decoded JSON object; raise ValueError when it is not an intent."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("not a payment_intent object")
        last_error = data.get("last_payment_error")
        try:
            return cls(
                id=data["id"],
                status=str(data["status"]),
                amount=int(data["amount"]),
                currency=str(data["currency"]),
                metadata={str(k): str(v) for k, v in (data.get("metadata") or {}).items()},
                created=int(data.get("created") or 0),
                last_error_code=last_error.get("code") if isinstance(last_error, dict) else None,
                replayed=replayed,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError("malformed payment_intent object") from exc


@dataclass(frozen=True)
class Refund:
    """The fields of a provider Refund that the fence and the audit use."""

    id: str
    amount: int
    currency: str
    payment_intent: str
    status: str
    reason: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    created: int = 0
    replayed: bool = False

    @classmethod
    def from_json(cls, data: Any, *, replayed: bool = False) -> Refund:
        """Build from a decoded JSON object; raise ValueError when it is not a refund."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("not a refund object")
        intent = data.get("payment_intent")
        if isinstance(intent, dict):  # expanded
            intent = intent.get("id")
        if not isinstance(intent, str):
            raise ValueError("refund without a payment_intent")
        reason = data.get("reason")
        try:
            return cls(
                id=data["id"],
                amount=int(data["amount"]),
                currency=str(data["currency"]),
                payment_intent=intent,
                status=str(data["status"]),
                reason=str(reason) if reason is not None else None,
                metadata={str(k): str(v) for k, v in (data.get("metadata") or {}).items()},
                created=int(data.get("created") or 0),
                replayed=replayed,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError("malformed refund object") from exc


def encode_form(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Flatten params Stripe style: `metadata[k]=v`, `items[0]=x`, booleans as true/false."""
    pairs: list[tuple[str, str]] = []
    for key, value in params.items():
        name = f"{prefix}[{key}]" if prefix else str(key)
        if value is None:
            continue
        if isinstance(value, Mapping):
            pairs.extend(encode_form(value, name))
        elif isinstance(value, list | tuple):
            pairs.extend(encode_form({str(i): v for i, v in enumerate(value)}, name))
        elif isinstance(value, bool):
            # Checked before int: bool is an int, and the provider wants the words.
            pairs.append((name, "true" if value else "false"))
        else:
            pairs.append((name, str(value)))
    return pairs


def _quote_search_value(value: str) -> str:
    """Quote a value for the search query language, escaping quotes and backslashes."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def build_metadata_query(metadata: Mapping[str, str]) -> str:
    """Return `metadata['k']:'v' AND ...` for the search endpoint."""
    if not metadata:
        raise ValueError("search needs at least one metadata clause")
    return " AND ".join(
        f"metadata[{_quote_search_value(str(k))}]:{_quote_search_value(str(v))}"
        for k, v in metadata.items()
    )


class ProviderClient:
    """Talk to the provider's PaymentIntents and Refunds APIs; one HTTP request per call."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        session: requests.Session | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("api_key is required")
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        if session is None:
            session = requests.Session()
            # No automatic retries: a retry is a fence decision with a counted
            # attempt, and urllib3 must not resend a POST behind our back.
            adapter = HTTPAdapter(max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self._session = session

    @classmethod
    def from_settings(cls, *, session: requests.Session | None = None) -> ProviderClient:
        """Build a client from the PAYMENTS settings (read here, lazily, not at import)."""
        from payments.conf import payments_settings

        conf = payments_settings()
        return cls(
            conf.provider_url,
            conf.provider_api_key,
            connect_timeout=conf.provider_connect_timeout,
            read_timeout=conf.provider_read_timeout,
            session=session,
        )

    def __repr__(self) -> str:
        return f"ProviderClient({self.base_url!r})"

    def close(self) -> None:
        """Close pooled connections."""
        self._session.close()

    def __enter__(self) -> ProviderClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- API ---------------------------------------------------------------

    def create_payment_intent(
        self,
        *,
        amount: int,
        currency: str,
        payment_method: str,
        metadata: Mapping[str, str],
        idempotency_key: str,
        confirm: bool = True,
    ) -> PaymentIntent:
        """Create (and by default confirm) a PaymentIntent under an idempotency key."""
        _check_idempotency_key(idempotency_key)
        form = encode_form(
            {
                "amount": amount,
                "currency": currency,
                "confirm": confirm,
                "payment_method": payment_method,
                "metadata": dict(metadata),
            }
        )
        answer = self._request(
            "POST", PAYMENT_INTENTS_PATH, form=form, idempotency_key=idempotency_key
        )
        return _intent(answer.body, answer)

    def retrieve_payment_intent(self, pi_id: str) -> PaymentIntent:
        """Fetch one intent by id; a missing one raises ResourceMissing."""
        if not pi_id or "/" in pi_id:
            raise ValueError("invalid payment intent id")
        path = f"{PAYMENT_INTENTS_PATH}/{pi_id}"
        answer = self._request("GET", path)
        return _intent(answer.body, answer)

    def search_payment_intents(self, metadata: Mapping[str, str]) -> list[PaymentIntent]:
        """Return the intents whose metadata match all pairs (search may lag writes)."""
        path = f"{PAYMENT_INTENTS_PATH}/search"
        query: dict[str, str] = {"query": build_metadata_query(metadata), "limit": "100"}
        found: list[PaymentIntent] = []
        while True:
            answer = self._request("GET", path, query=query)
            found.extend(_intent(item, answer) for item in _data(answer))
            next_page = answer.body.get("next_page")
            if not answer.body.get("has_more") or not next_page:
                return found
            query = {**query, "page": str(next_page)}

    def list_payment_intents(
        self, *, created_gte: int | None = None, limit: int = 100
    ) -> Iterator[PaymentIntent]:
        """Yield all intents (newest first), following `starting_after` pages."""
        if not 1 <= limit <= 100:
            raise ValueError("limit must be between 1 and 100")
        query: dict[str, str] = {"limit": str(limit)}
        if created_gte is not None:
            query["created[gte]"] = str(int(created_gte))
        while True:
            answer = self._request("GET", PAYMENT_INTENTS_PATH, query=query)
            items = [_intent(item, answer) for item in _data(answer)]
            yield from items
            if not answer.body.get("has_more") or not items:
                return
            query = {**query, "starting_after": items[-1].id}

    def create_refund(
        self,
        *,
        payment_intent: str,
        amount: int | None,
        metadata: Mapping[str, str],
        idempotency_key: str,
        reason: str | None = None,
    ) -> Refund:
        """Refund `amount` (None: all that is left) of an intent's charge under a key.

        A refusal raises InvalidRequest (PERMANENT) with `code` REFUND_AMOUNT_TOO_LARGE,
        CHARGE_ALREADY_REFUNDED, PAYMENT_INTENT_NOT_REFUNDABLE or resource_missing.
        """
        _check_idempotency_key(idempotency_key)
        if not isinstance(payment_intent, str) or not payment_intent:
            raise ValueError("payment_intent must be a non-empty string")
        if amount is not None and (isinstance(amount, bool) or not isinstance(amount, int)):
            raise ValueError("amount must be an integer or None")
        if reason is not None and reason not in REFUND_REASONS:
            raise ValueError(f"reason must be one of {sorted(REFUND_REASONS)}")
        form = encode_form(
            {
                "payment_intent": payment_intent,
                "amount": amount,
                "reason": reason,
                "metadata": dict(metadata),
            }
        )
        answer = self._request("POST", REFUNDS_PATH, form=form, idempotency_key=idempotency_key)
        return _refund(answer.body, answer)

    def retrieve_refund(self, refund_id: str) -> Refund:
        """Fetch one refund by id; a missing one raises ResourceMissing."""
        if not refund_id or "/" in refund_id:
            raise ValueError("invalid refund id")
        answer = self._request("GET", f"{REFUNDS_PATH}/{refund_id}")
        return _refund(answer.body, answer)

    def list_refunds(self, *, payment_intent: str, limit: int = 100) -> Iterator[Refund]:
        """Yield the refunds of one intent (newest first), following `starting_after` pages."""
        if not payment_intent:
            raise ValueError("payment_intent must be a non-empty string")
        if not 1 <= limit <= 100:
            raise ValueError("limit must be between 1 and 100")
        query: dict[str, str] = {"payment_intent": payment_intent, "limit": str(limit)}
        while True:
            answer = self._request("GET", REFUNDS_PATH, query=query)
            items = [_refund(item, answer) for item in _data(answer)]
            yield from items
            if not answer.body.get("has_more") or not items:
                return
            query = {**query, "starting_after": items[-1].id}

    # --- transport and classification --------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        form: list[tuple[str, str]] | None = None,
        query: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> _Answer:
        """Send one request; return the decoded 2xx answer or raise ProviderError."""
        headers = {"Authorization": f"Bearer {self._api_key}", "Accept": "application/json"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        context = f"{method} {path}"
        logger.debug("provider request %s %s idempotency_key=%s", method, path, idempotency_key)
        try:
            response = self._session.request(
                method,
                self.base_url + path,
                data=form,
                params=query,
                headers=headers,
                timeout=(self.connect_timeout, self.read_timeout),
                # A redirect would turn the POST into a GET elsewhere; treat it
                # as an unexpected answer instead of following it.
                allow_redirects=False,
            )
        except requests.RequestException as exc:
            failure = classify_exception(exc, context=context)
            logger.info(
                "provider call failed %s %s outcome=%s idempotency_key=%s error=%s",
                method,
                path,
                failure.outcome,
                idempotency_key,
                type(exc).__name__,
            )
            raise failure from exc

        status = response.status_code
        replayed = response.headers.get("Idempotent-Replayed", "").lower() == "true"
        try:
            body: Any = response.json()
            readable = True
        except ValueError:
            body, readable = None, False
        error: ProviderError | None = None
        if not 200 <= status < 300:
            error = classify_response(status, body, response.headers, context=context)
        elif not readable:
            # The provider said yes, but what it did cannot be read.
            error = UncertainProviderError(
                f"{context}: HTTP {status} with an unreadable body",
                http_status=status,
                request_id=response.headers.get("Request-Id"),
                replayed=replayed,
            )
        pi_id, refund_id = _logged_ids(body, error)
        # Successes at DEBUG (one per call is noise in production); failures at INFO.
        logger.log(
            logging.DEBUG if error is None else logging.INFO,
            "provider response %s %s status=%s request_id=%s idempotency_key=%s pi=%s "
            "refund=%s outcome=%s replayed=%s",
            method,
            path,
            status,
            response.headers.get("Request-Id"),
            idempotency_key,
            pi_id,
            refund_id,
            error.outcome if error is not None else Outcome.SUCCESS,
            replayed,
        )
        if error is not None:
            raise error
        return _Answer(context, body, status, response.headers.get("Request-Id"), replayed)


@dataclass(frozen=True)
class _Answer:
    """A decoded 2xx answer and what the fence may want to record about it."""

    context: str
    body: Any
    http_status: int
    request_id: str | None
    replayed: bool

    def not_understood(self, what: str) -> UncertainProviderError:
        """The provider said yes, but not in a shape we can read: it may have executed."""
        return UncertainProviderError(
            f"{self.context}: HTTP {self.http_status} answer is not {what}",
            http_status=self.http_status,
            request_id=self.request_id,
            replayed=self.replayed,
        )


def _intent(item: Any, answer: _Answer) -> PaymentIntent:
    """Parse one intent out of an answer; anything else is an UNCERTAIN answer."""
    try:
        return PaymentIntent.from_json(item, replayed=answer.replayed)
    except ValueError as exc:
        raise answer.not_understood("a payment intent") from exc


def _refund(item: Any, answer: _Answer) -> Refund:
    """Parse one refund out of an answer; anything else is an UNCERTAIN answer."""
    try:
        return Refund.from_json(item, replayed=answer.replayed)
    except ValueError as exc:
        raise answer.not_understood("a refund") from exc


def _logged_ids(body: Any, error: ProviderError | None) -> tuple[str | None, str | None]:
    """Return the (intent id, refund id) an answer is about, for the log line."""
    if error is not None:
        return error.payment_intent_id, None
    if not isinstance(body, dict):
        return None, None
    if body.get("object") == "refund":
        intent = body.get("payment_intent")
        return (intent if isinstance(intent, str) else None), body.get("id")
    return body.get("id"), None


def _data(answer: _Answer) -> list[Any]:
    """Return the `data` array of a list or search answer."""
    body = answer.body
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise answer.not_understood("a list")
    return body["data"]


def _check_idempotency_key(key: str) -> None:
    """Refuse keys the provider would reject or that cannot go into a header."""
    if not isinstance(key, str) or not key:
        raise ValueError("idempotency_key must be a non-empty string")
    if len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise ValueError(f"idempotency_key longer than {MAX_IDEMPOTENCY_KEY_LENGTH} characters")
    if not key.isascii() or not key.isprintable():
        raise ValueError("idempotency_key must be printable ASCII")
