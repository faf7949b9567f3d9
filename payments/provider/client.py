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

Connections. `ProviderClient.from_settings()` returns a client on this
process's shared session (`shared_session`): keep-alive connections are
reused across calls and jobs, at most `POOL_MAXSIZE` are kept open, and a
session idle for `MAX_IDLE_SECONDS` is closed and rebuilt before the provider
(or a load balancer in front of it) would close its connections under a new
request. After `os.fork` the child gets a session of its own (keyed by pid),
never the parent's sockets. A request on a kept-alive socket that the provider
closed is classified like any other transport failure: a socket found closed
before the request is sent is replaced by a new connection (if that connect
fails: TRANSIENT); a reset after the request went out is UNCERTAIN
(tests/provider/test_client_session.py pins both on real sockets).

Intents are created (and by default confirmed) by `create_payment_intent`;
one left unconfirmed or declined is confirmed later by
`confirm_payment_intent` (a decline is CardDeclined again) and given up by
`cancel_payment_intent`. One created with `capture_method="manual"` is only
authorised (`requires_capture`, holding `amount_capturable`) until
`capture_payment_intent` takes all or part of it (`amount_received`) or a
cancel releases it. A confirm, cancel or capture that the intent's status does
not allow (confirming a succeeded or canceled intent, canceling a succeeded
one, capturing one not in `requires_capture`) is an InvalidRequest with `code`
`errors.PAYMENT_INTENT_UNEXPECTED_STATE` and the intent's status in
`payment_intent_status`; capturing more than is held is an InvalidRequest with
`code` `errors.CAPTURE_AMOUNT_TOO_LARGE`.

Refunds (`create_refund`, `retrieve_refund`, `list_refunds`) go through the
same table: a refused refund is an InvalidRequest (PERMANENT) whose `code`
says why (`errors.REFUND_AMOUNT_TOO_LARGE`, `errors.CHARGE_ALREADY_REFUNDED`,
`errors.PAYMENT_INTENT_NOT_REFUNDABLE`). A refund can be `pending` and can
still fail after it succeeded (`failed` with `failure_reason`).

The lists (`list_payment_intents`, `list_refunds`, `list_events`) follow
`starting_after` pages lazily, one request per page.

Logs carry method, path, status, request id, idempotency key, intent id and
refund id only: never the API key, the payment method, metadata values or
bodies. The same method, path, status, request id and key of every request
are noted for the fence's rows (`payments.engine.exchanges`), inside the
engine's and the desk's `recording()` blocks only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import requests
from requests.adapters import HTTPAdapter

from payments.engine import exchanges
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
CANCELLATION_REASONS = frozenset({"duplicate", "fraudulent", "requested_by_customer", "abandoned"})
CAPTURE_METHODS = frozenset({"automatic", "manual"})

#: Kept-alive connections one process keeps to the provider. A worker sends one
#: request at a time (one connection); threads beyond this open extra
#: connections that are closed after their request instead of kept.
POOL_MAXSIZE = 4
#: A session unused for this long is closed and rebuilt before its next request.
#: Servers and load balancers close idle keep-alive connections after some
#: quiet time (the fake provider after 120 s, common load balancers after 60 s);
#: a request written onto a socket at the moment its peer closes it ends
#: UNCERTAIN, so the client gives such sockets up well before.
MAX_IDLE_SECONDS = 30.0


def new_session(*, pool_maxsize: int = POOL_MAXSIZE) -> requests.Session:
    """Return a requests session for the provider: no automatic retries, a bounded pool.

    The CA bundle comes from requests' own environment (REQUESTS_CA_BUNDLE), so
    a provider with a private CA (the fake provider over TLS) needs no setting.
    """
    session = requests.Session()
    # No automatic retries: a retry is a fence decision with a counted
    # attempt, and urllib3 must not resend a POST behind our back.
    adapter = HTTPAdapter(max_retries=0, pool_connections=1, pool_maxsize=pool_maxsize)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class _ProcessSession:
    """One process's provider session, rebuilt when it sat idle past MAX_IDLE_SECONDS.

    The idle age is the session's: a worker sends one request at a time, so
    its one connection is exactly as idle as the session. With threads, a
    pooled connection can idle while others work; urllib3 still drops one the
    provider has already closed before reusing it.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._lock = threading.Lock()
        self.session = new_session()
        self._in_flight = 0
        self._idle_since = time.monotonic()

    @contextmanager
    def use(self) -> Iterator[requests.Session]:
        """Lend the session for one request; rebuild it first if it sat idle too long."""
        with self._lock:
            if self._in_flight == 0 and time.monotonic() - self._idle_since > MAX_IDLE_SECONDS:
                self.session.close()  # closes every idle kept-alive connection
                self.session = new_session()
            self._in_flight += 1
            session = self.session
        try:
            yield session
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle_since = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self.session.close()


_process_session: _ProcessSession | None = None
_process_session_lock = threading.Lock()


def _shared() -> _ProcessSession:
    """Return this process's session holder, a new one after a fork (keyed by pid)."""
    global _process_session
    pid = os.getpid()
    current = _process_session
    if current is None or current.pid != pid:
        with _process_session_lock:
            current = _process_session
            if current is None or current.pid != pid:
                # The parent's session is dropped, not closed: its sockets are
                # the parent's connections, still in use there.
                current = _process_session = _ProcessSession(pid)
    return current


def shared_session() -> requests.Session:
    """Return the requests session this process's provider clients share."""
    return _shared().session


def close_shared_session() -> None:
    """Close this process's shared session; the next provider call builds a new one."""
    global _process_session
    with _process_session_lock:
        if _process_session is not None and _process_session.pid == os.getpid():
            _process_session.close()
        _process_session = None


def _after_fork_in_child() -> None:
    # A lock held by another thread at the fork stays held in the child forever.
    global _process_session, _process_session_lock
    _process_session_lock = threading.Lock()
    _process_session = None


os.register_at_fork(after_in_child=_after_fork_in_child)


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
    # Ids of payment methods stay out of reprs, as out of logs.
    #: The intent's payment method id (None after a decline: Stripe detaches it).
    payment_method: str | None = field(default=None, repr=False)
    #: The payment method the last failed attempt used (`last_payment_error.payment_method`).
    last_error_payment_method: str | None = field(default=None, repr=False)
    #: What an authorised manual intent holds for a capture (0 once captured or released).
    amount_capturable: int = 0
    #: What was charged or captured: the most a refund can give back.
    amount_received: int = 0
    #: `automatic` (charged at confirm) or `manual` (authorised, captured later).
    capture_method: str = "automatic"
    #: The charge that moved the money (a capture's own object), or None before one.
    latest_charge: str | None = None

    @classmethod
    def from_json(cls, data: Any, *, replayed: bool = False) -> PaymentIntent:
        """Build from a decoded JSON object; raise ValueError when it is not an intent."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("not a payment_intent object")
        last_error = data.get("last_payment_error")
        if not isinstance(last_error, dict):
            last_error = {}
        try:
            return cls(
                id=data["id"],
                status=str(data["status"]),
                amount=int(data["amount"]),
                currency=str(data["currency"]),
                metadata={str(k): str(v) for k, v in (data.get("metadata") or {}).items()},
                created=int(data.get("created") or 0),
                last_error_code=last_error.get("code"),
                replayed=replayed,
                payment_method=_id_of(data.get("payment_method")),
                last_error_payment_method=_id_of(last_error.get("payment_method")),
                amount_capturable=int(data.get("amount_capturable") or 0),
                amount_received=int(data.get("amount_received") or 0),
                capture_method=str(data.get("capture_method") or "automatic"),
                latest_charge=_id_of(data.get("latest_charge")),
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
    #: Why a `failed` refund failed (`lost_or_stolen_card`, ...); None otherwise.
    failure_reason: str | None = None

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
        reason, failure = data.get("reason"), data.get("failure_reason")
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
                failure_reason=str(failure) if failure is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError("malformed refund object") from exc


def _id_of(value: Any) -> str | None:
    """The id of an expandable field: the string itself, or the expanded object's `id`."""
    if isinstance(value, dict):
        value = value.get("id")
    return value if isinstance(value, str) and value else None


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


class _Listed(Protocol):
    """What a listed object needs for the next page's cursor."""

    @property
    def id(self) -> str: ...


_Item = TypeVar("_Item", bound=_Listed)


class ProviderClient:
    """Talk to the provider's PaymentIntents and Refunds APIs; one HTTP request per call.

    Requests go through `session`, or with `shared=True` through this process's
    shared session, or else through a new session of the client's own.
    `close()` closes the first and the last, never the shared one (other clients
    of the process use it).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        session: requests.Session | None = None,
        shared: bool = False,
    ) -> None:
        if not api_key:
            raise ValueError("api_key is required")
        if shared and session is not None:
            raise ValueError("pass a session or shared=True, not both")
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        self._own_session: requests.Session | None = None
        if not shared:
            self._own_session = session if session is not None else new_session()

    @classmethod
    def from_settings(cls, *, session: requests.Session | None = None) -> ProviderClient:
        """Build a client from the PAYMENTS settings (read here, lazily, not at import).

        Without `session`, the client uses this process's shared session.
        """
        from payments.conf import payments_settings

        conf = payments_settings()
        return cls(
            conf.provider_url,
            conf.provider_api_key,
            connect_timeout=conf.provider_connect_timeout,
            read_timeout=conf.provider_read_timeout,
            session=session,
            shared=session is None,
        )

    @property
    def _session(self) -> requests.Session:
        """The session the next request goes through."""
        return self._own_session if self._own_session is not None else shared_session()

    def __repr__(self) -> str:
        return f"ProviderClient({self.base_url!r})"

    def close(self) -> None:
        """Close the client's pooled connections (a shared session stays open)."""
        if self._own_session is not None:
            self._own_session.close()

    @contextmanager
    def _use_session(self) -> Iterator[requests.Session]:
        if self._own_session is not None:
            yield self._own_session
        else:
            with _shared().use() as session:
                yield session

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
        capture_method: str = "automatic",
    ) -> PaymentIntent:
        """Create (and by default confirm) a PaymentIntent under an idempotency key.

        With `capture_method="manual"` a confirmed intent is only authorised
        (`requires_capture`); `capture_payment_intent` takes the money later.
        """
        _check_idempotency_key(idempotency_key)
        if capture_method not in CAPTURE_METHODS:
            raise ValueError(f"capture_method must be one of {sorted(CAPTURE_METHODS)}")
        form = encode_form(
            {
                "amount": amount,
                "currency": currency,
                "confirm": confirm,
                "payment_method": payment_method,
                # Sent only when manual: an automatic create stays byte for byte
                # the request it always was, so keys stored before keep replaying.
                "capture_method": None if capture_method == "automatic" else capture_method,
                "metadata": dict(metadata),
            }
        )
        answer = self._request(
            "POST", PAYMENT_INTENTS_PATH, form=form, idempotency_key=idempotency_key
        )
        return _intent(answer.body, answer)

    def confirm_payment_intent(
        self, pi_id: str, *, payment_method: str, idempotency_key: str
    ) -> PaymentIntent:
        """Confirm (charge) an intent with `payment_method` under an idempotency key.

        A decline raises CardDeclined (with `payment_intent_id`); a succeeded or
        canceled intent raises InvalidRequest with `code`
        PAYMENT_INTENT_UNEXPECTED_STATE and its `payment_intent_status`.
        """
        _check_intent_id(pi_id)
        _check_idempotency_key(idempotency_key)
        if not isinstance(payment_method, str) or not payment_method:
            raise ValueError("payment_method must be a non-empty string")
        form = encode_form({"payment_method": payment_method})
        return self._intent_action(pi_id, "confirm", form, idempotency_key)

    def cancel_payment_intent(
        self,
        pi_id: str,
        *,
        idempotency_key: str | None = None,
        cancellation_reason: str | None = None,
    ) -> PaymentIntent:
        """Cancel an intent that has not succeeded; return it `canceled`.

        A succeeded (or already canceled) intent raises InvalidRequest with
        `code` PAYMENT_INTENT_UNEXPECTED_STATE and its `payment_intent_status`.
        """
        _check_intent_id(pi_id)
        if idempotency_key is not None:
            _check_idempotency_key(idempotency_key)
        if cancellation_reason is not None and cancellation_reason not in CANCELLATION_REASONS:
            raise ValueError(f"cancellation_reason must be one of {sorted(CANCELLATION_REASONS)}")
        form = encode_form({"cancellation_reason": cancellation_reason})
        return self._intent_action(pi_id, "cancel", form, idempotency_key)

    def capture_payment_intent(
        self,
        pi_id: str,
        *,
        idempotency_key: str,
        amount_to_capture: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> PaymentIntent:
        """Capture what a manual intent holds under an idempotency key; return it `succeeded`.

        `amount_to_capture` (None: all of `amount_capturable`) becomes its
        `amount_received` and the rest is released; `metadata` is merged into
        the intent's. An intent not in `requires_capture` raises InvalidRequest
        with `code` PAYMENT_INTENT_UNEXPECTED_STATE and its
        `payment_intent_status`; more than it holds raises InvalidRequest with
        `code` CAPTURE_AMOUNT_TOO_LARGE.
        """
        _check_intent_id(pi_id)
        _check_idempotency_key(idempotency_key)
        if amount_to_capture is not None and (
            isinstance(amount_to_capture, bool)
            or not isinstance(amount_to_capture, int)
            or amount_to_capture < 1
        ):
            raise ValueError("amount_to_capture must be a positive integer or None")
        form = encode_form(
            {
                "amount_to_capture": amount_to_capture,
                "metadata": dict(metadata) if metadata is not None else None,
            }
        )
        return self._intent_action(pi_id, "capture", form, idempotency_key)

    def _intent_action(
        self, pi_id: str, action: str, form: list[tuple[str, str]], idempotency_key: str | None
    ) -> PaymentIntent:
        """POST one of an intent's actions (confirm, cancel, capture); return the intent."""
        path = f"{PAYMENT_INTENTS_PATH}/{pi_id}/{action}"
        answer = self._request("POST", path, form=form, idempotency_key=idempotency_key)
        return _intent(answer.body, answer)

    def retrieve_payment_intent(self, pi_id: str) -> PaymentIntent:
        """Fetch one intent by id; a missing one raises ResourceMissing."""
        _check_intent_id(pi_id)
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
        self,
        *,
        created_gte: int | None = None,
        created_lte: int | None = None,
        limit: int = 100,
    ) -> Iterator[PaymentIntent]:
        """Yield the intents created in [created_gte, created_lte] (either open), newest first."""
        query = {"limit": _page_size(limit)}
        if created_gte is not None:
            query["created[gte]"] = str(int(created_gte))
        if created_lte is not None:
            query["created[lte]"] = str(int(created_lte))
        return self._pages(PAYMENT_INTENTS_PATH, query, _intent)

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

    def list_refunds(
        self,
        *,
        payment_intent: str | None = None,
        created_gte: int | None = None,
        created_lte: int | None = None,
        limit: int = 100,
    ) -> Iterator[Refund]:
        """Yield the refunds of one intent, or of a created window [created_gte, created_lte]
        (either open, not both: the whole account), newest first, page by page."""
        if payment_intent is not None and not payment_intent:
            raise ValueError("payment_intent must be a non-empty string")
        if payment_intent is None and created_gte is None and created_lte is None:
            raise ValueError("list the refunds of an intent or of a created window")
        query = {} if payment_intent is None else {"payment_intent": payment_intent}
        query["limit"] = _page_size(limit)
        if created_gte is not None:
            query["created[gte]"] = str(int(created_gte))
        if created_lte is not None:
            query["created[lte]"] = str(int(created_lte))
        return self._pages(REFUNDS_PATH, query, _refund)

    def list_events(self, *, created_gte: int | None = None, limit: int = 100) -> Iterator[Event]:
        """Yield the provider's events (newest first), following `starting_after` pages.

        For catching up on webhooks missed while the endpoint was down: the
        listed events are the ones the provider pushes, unsigned (the API key
        authenticates this answer).
        """
        query = {"limit": _page_size(limit)}
        if created_gte is not None:
            query["created[gte]"] = str(int(created_gte))
        return self._pages(EVENTS_PATH, query, _event)

    def _pages(
        self,
        path: str,
        query: Mapping[str, str],
        parse: Callable[[Any, _Answer], _Item],
    ) -> Iterator[_Item]:
        """Yield the items of a list, newest first, one request per `starting_after` page.

        Arguments are checked by the callers before this generator starts, so a
        bad one raises at the call, not at the first `next()`.
        """
        page = dict(query)
        while True:
            answer = self._request("GET", path, query=page)
            items = [parse(item, answer) for item in _data(answer)]
            yield from items
            if not answer.body.get("has_more") or not items:
                return
            page["starting_after"] = items[-1].id

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
            with self._use_session() as session:
                response = session.request(
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
            exchanges.sent(
                method,
                path,
                status=None,
                request_id=None,
                idempotency_key=idempotency_key,
                error=type(exc).__name__,
            )
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
        request_id = response.headers.get("Request-Id")
        # Every answer, a success as much as a refusal: what the provider's support asks for.
        exchanges.sent(
            method,
            path,
            status=status,
            request_id=request_id,
            idempotency_key=idempotency_key,
            replayed=replayed,
        )
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
                request_id=request_id,
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
            request_id,
            idempotency_key,
            pi_id,
            refund_id,
            error.outcome if error is not None else Outcome.SUCCESS,
            replayed,
        )
        if error is not None:
            raise error
        return _Answer(context, body, status, request_id, replayed)


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


def _page_size(limit: int) -> str:
    """Check a list's page size (Stripe allows 1 to 100) and return it as sent."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100:
        raise ValueError("limit must be between 1 and 100")
    return str(limit)


def _check_intent_id(pi_id: str) -> None:
    """Refuse ids that would change the request's path."""
    if not isinstance(pi_id, str) or not pi_id or "/" in pi_id or "?" in pi_id:
        raise ValueError("invalid payment intent id")


def _check_idempotency_key(key: str) -> None:
    """Refuse keys the provider would reject or that cannot go into a header."""
    if not isinstance(key, str) or not key:
        raise ValueError("idempotency_key must be a non-empty string")
    if len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise ValueError(f"idempotency_key longer than {MAX_IDEMPOTENCY_KEY_LENGTH} characters")
    if not key.isascii() or not key.isprintable():
        raise ValueError("idempotency_key must be printable ASCII")


# --- events (webhooks and their list) ------------------------------------------

EVENTS_PATH = "/v1/events"


@dataclass(frozen=True)
class Event:
    """A provider event: its id, type, creation time and the object it carries."""

    id: str
    type: str
    created: int
    object: Mapping[str, Any] = field(hash=False)
    #: The whole event as the provider sent it (stored as is).
    raw: Mapping[str, Any] = field(hash=False, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> Event:
        """Build from a decoded event; raise ValueError when it is not one."""
        if not isinstance(data, dict) or data.get("object") != "event":
            raise ValueError("not an event object")
        event_id, kind, created = data.get("id"), data.get("type"), data.get("created")
        payload = data.get("data")
        obj = payload.get("object") if isinstance(payload, dict) else None
        if not isinstance(event_id, str) or not event_id or len(event_id) > 255:
            raise ValueError("event without an id")
        if not isinstance(kind, str) or not kind or len(kind) > 100:
            raise ValueError("event without a type")
        if isinstance(created, bool) or not isinstance(created, int) or created < 0:
            raise ValueError("event without a creation time")
        if not isinstance(obj, dict):
            raise ValueError("event without data.object")
        return cls(id=event_id, type=kind, created=created, object=obj, raw=data)


def _event(item: Any, answer: _Answer) -> Event:
    """Parse one event out of a list answer; anything else is an UNCERTAIN answer."""
    try:
        return Event.from_json(item)
    except ValueError as exc:
        raise answer.not_understood("an event") from exc
