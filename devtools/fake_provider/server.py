"""A fake Stripe-compatible payment provider: a real HTTP/1.1 server on the stdlib.

It serves the provider contract of docs/design.md from its own in-memory state
(`devtools.fake_provider.state`), never from the application's database, so
tests and the demo can compare what the provider did with what the fence
recorded.

Provider API (`Authorization: Bearer sk_...`, form-encoded POST, JSON answers,
a `Request-Id` header on every answer, `req_` and 14 letters or digits as Stripe's):

- `POST /v1/payment_intents`: `amount`, `currency`, `confirm`, `payment_method`
  (`pm_card_visa` succeeds, `pm_card_chargeDeclined` answers 402),
  `capture_method` (`automatic`, the default, or `manual`: a good card only
  authorises, the intent waits in `requires_capture` with `amount_capturable`
  and `payment_intent.amount_capturable_updated` is emitted),
  `metadata[...]`; other Stripe parameters (description, expand[] ...) are
  accepted and ignored. `Idempotency-Key` replays the stored answer with
  `Idempotent-Replayed: true`, answers 400 idempotency_error for other
  parameters and 409 while the first request is in flight.
- `POST /v1/payment_intents/{id}/confirm`: `payment_method` (else the
  intent's own). Charges as a confirmed create does: `succeeded`, or a 402
  card_error that leaves the intent in `requires_payment_method` (the declined
  method in `last_payment_error.payment_method`, none left on the intent). A
  succeeded or canceled intent answers 400 `payment_intent_unexpected_state`
  with the intent in `error.payment_intent`. Idempotency and faults as for
  creates; a key belongs to one intent's confirm path. A manual intent ends in
  `requires_capture`, as a confirmed create does.
- `POST /v1/payment_intents/{id}/capture`: `amount_to_capture` (default: all
  of `amount_capturable`), `metadata[...]` (merged into the intent's; an empty
  value removes a key). `succeeded` with `amount_received` the captured amount
  and `amount_capturable` 0 (the rest is released). An intent not in
  `requires_capture` answers 400 `payment_intent_unexpected_state` with the
  intent; more than it holds answers 400 `amount_too_large` (param
  `amount_to_capture`). Idempotency and faults as for confirms.
- `POST /v1/payment_intents/{id}/cancel`: `cancellation_reason` (`duplicate`,
  `fraudulent`, `requested_by_customer`, `abandoned`); `canceled` with
  `canceled_at` (a held authorisation is released: `amount_capturable` 0),
  or 400 `payment_intent_unexpected_state` (with the intent) from
  `succeeded` or `canceled`. `Idempotency-Key` honoured; no faults.
- `GET /v1/payment_intents/{id}`, `GET /v1/payment_intents/search?query=...`
  (`metadata['k']:'v'` and `status:'...'` clauses joined by AND; only intents
  older than `search_lag` seconds are found) and `GET /v1/payment_intents`
  (list, newest first: `limit`, `starting_after`, `ending_before`,
  `created[gt|gte|lt|lte]` and `created=<t>`, all together).
- `POST /v1/refunds`: `payment_intent`, `amount` (default: what is left),
  `reason` (`duplicate`, `fraudulent`, `requested_by_customer`),
  `metadata[...]`; the same idempotency and faults as intent creates (a key
  belongs to the endpoint it was first used on). A refund reaches only the
  captured amount (`amount_received`). Refusals are 400
  invalid_request_error: `amount_too_large` (more than is left),
  `charge_already_refunded` (nothing left), `payment_intent_unexpected_state`
  (no successful charge, or one not yet captured), `resource_missing` (no
  such intent). A new refund is `succeeded`, or `pending` with
  `refund_status: "pending"` (it holds its amount meanwhile);
  `failure_reason` and `failure_balance_transaction` are null unless it
  failed.
- `GET /v1/refunds/{id}` and `GET /v1/refunds` (list, newest first:
  `payment_intent`, `limit`, `starting_after`, `ending_before`,
  `created[gt|gte|lt|lte]` and `created=<t>`, all together).
- `GET /v1/events` (list, newest first: `limit`, `starting_after`,
  `ending_before`, `created[gt|gte|lt|lte]`, `type`, `types[]`): every event
  the fake emitted: `payment_intent.succeeded`, `payment_intent.payment_failed`,
  `payment_intent.canceled`, `payment_intent.amount_capturable_updated`,
  `refund.created`, `refund.updated`, `refund.failed`, `charge.refunded`.

Webhooks: `FakeProviderServer(webhook_url=..., webhook_secret=...)` POSTs
every event there, signed (`Stripe-Signature: t=...,v1=...`), retried with
back-off until a 2xx, with faults (duplicate, reorder, delay): see
`devtools.fake_provider.webhooks`. `GET /_fake/webhooks` returns the sender's
counters; `POST /_fake/webhooks` `{"fault": "duplicate", "count": N}` queues
faults for the next events, any other keys change its config.

Control API (no auth; JSON in and out):

- `POST /_fake/faults` `{"mode": "...", "count": N}` queues N faults for the
  next create, confirm or capture requests (intents, confirms, captures and
  refunds alike; never cancels). Modes: `drop_after_accept` (charge, store
  the answer for the key, close the socket without answering), `slow`
  (charge, wait `slow_delay` s before answering), `fail_before` (500 with
  `Stripe-Should-Retry: true`, nothing executed or stored), `fail_after`
  (charge, store and answer a 500), `rate_limit` (429, not stored).
- `POST /_fake/config` sets `<mode>_rate` (random faults, seeded by `seed`),
  `slow_delay`, `search_lag`, `key_retention`, `api_key`, `refund_status`
  (`succeeded` or `pending`: what new refunds start as) and
  `refund_fail_after` (seconds; > 0: every refund fails that long after it
  succeeded, as a refund at Stripe can fail after it was first reported).
- `POST /_fake/refunds/{id}/succeed` moves a pending refund to `succeeded`
  (`refund.updated`, `charge.refunded`); `POST /_fake/refunds/{id}/fail`
  `{"reason": "lost_or_stolen_card"}` (optional) moves a pending or succeeded
  one to `failed`, giving its amount back to the charge (`refund.updated`,
  `refund.failed`). Both answer the refund; 404 unknown refund, 400 wrong status.
- `POST /_fake/incident` `{"seconds": S, "drop_rate": 0.3}` starts a provider
  incident: for S seconds every new create, confirm, capture or refund is
  executed and then held in flight until the incident ends (a same-key
  request meanwhile: `409 idempotency_key_in_use`), or, at `drop_rate`, its
  answer dropped. Reads are answered as usual. `GET /_fake/stats` says
  `incident` (active, seconds left).
- `POST /_fake/reset` forgets intents, refunds, keys, queued faults and counters.
- `GET /_fake/stats` returns counters; `GET /_fake/health` returns `{"status": "ok"}`.
- `GET /_fake/timeline` returns `{"data": [...]}`: every charge and refund that
  succeeded (`object`, `id`, `metadata`, `succeeded_at`: the fake's Unix time
  to the microsecond; `created` is whole seconds), in the order they succeeded.

TLS: `FakeProviderServer(tls=True)` serves HTTPS with a throwaway certificate
for its host from a throwaway CA (made with `trustme`, never written to the
system's trust store); `write_ca(path)` stores the CA for clients, which trust
it through `REQUESTS_CA_BUNDLE`.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import ssl
import string
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from devtools.fake_provider.state import (
    CANCELLATION_REASONS,
    CAPTURE_METHODS,
    DECLINING_CARDS,
    REFUND_REASONS,
    SUCCEEDING_CARDS,
    FakeConfig,
    FakeState,
    Reply,
    error_reply,
    invalid,
)
from devtools.fake_provider.webhooks import WebhookSender

logger = logging.getLogger(__name__)

_PI_PATH = "/v1/payment_intents"
#: Stripe's request ids: `req_` and 14 letters or digits, a new one on every answer.
_REQUEST_ID_ALPHABET = string.ascii_letters + string.digits
_REFUNDS_PATH = "/v1/refunds"
_EVENTS_PATH = "/v1/events"
_INTENT_ACTION = re.compile(r"/v1/payment_intents/(?P<id>[^/]+)/(?P<action>confirm|cancel|capture)")
_REFUND_CONTROL = re.compile(r"/_fake/refunds/(?P<id>[^/]+)/(?P<action>succeed|fail)")

_CLAUSE = re.compile(
    r"""\s*(?:metadata\[(?P<kq>['"])(?P<key>(?:\\.|(?!(?P=kq))[^\\])*)(?P=kq)\]"""
    r"""|(?P<field>status|currency))\s*:\s*"""
    r"""(?P<vq>['"])(?P<value>(?:\\.|(?!(?P=vq))[^\\])*)(?P=vq)\s*""",
    re.S,
)
_AND = re.compile(r"AND\s+", re.I)


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_search_query(query: str) -> list[tuple[str, str]] | None:
    """Parse `metadata['k']:'v' AND status:'s'`; return [(path, value)] or None."""
    clauses: list[tuple[str, str]] = []
    pos = 0
    while True:
        match = _CLAUSE.match(query, pos)
        if match is None:
            return None
        path = match["field"] or "metadata." + _unescape(match["key"])
        clauses.append((path, _unescape(match["value"])))
        pos = match.end()
        if pos == len(query):
            return clauses
        joiner = _AND.match(query, pos)
        if joiner is None:
            return None
        pos = joiner.end()


def parse_create(params: list[tuple[str, str]]) -> dict[str, Any] | Reply:
    """Validate create parameters; return them parsed or a 400 (never stored)."""
    flat = dict(params)
    raw_amount = flat.get("amount")
    if raw_amount is None or raw_amount == "":
        return invalid("Missing required param: amount.", param="amount", code="parameter_missing")
    if not re.fullmatch(r"-?\d+", raw_amount):
        return invalid("Invalid integer: amount.", param="amount", code="parameter_invalid_integer")
    amount = int(raw_amount)
    if amount < 1:
        return invalid("Amount must be at least 1.", param="amount", code="amount_too_small")
    if amount > 99_999_999:
        return invalid("Amount is too large.", param="amount", code="amount_too_large")
    currency = flat.get("currency", "")
    if not currency:
        return invalid(
            "Missing required param: currency.", param="currency", code="parameter_missing"
        )
    if not re.fullmatch(r"[A-Za-z]{3}", currency):
        return invalid("Invalid currency.", param="currency", code="parameter_invalid_string")
    confirm_raw = flat.get("confirm", "false").lower()
    if confirm_raw not in ("true", "false"):
        return invalid(
            "Invalid boolean: confirm.", param="confirm", code="parameter_invalid_boolean"
        )
    confirm = confirm_raw == "true"
    payment_method = flat.get("payment_method") or None
    if payment_method is None and confirm:
        return invalid(
            "A payment method is required to confirm.",
            param="payment_method",
            code="parameter_missing",
        )
    if payment_method is not None and not _known_card(payment_method):
        return _no_such_method()
    capture_method = flat.get("capture_method") or "automatic"
    if capture_method not in CAPTURE_METHODS:
        return invalid(
            "Invalid capture_method: must be one of " + ", ".join(CAPTURE_METHODS) + ".",
            param="capture_method",
        )
    metadata = _metadata(params)
    if isinstance(metadata, Reply):
        return metadata
    return {
        "amount": amount,
        "currency": currency.lower(),
        "confirm": confirm,
        "payment_method": payment_method,
        "capture_method": capture_method,
        "metadata": metadata,
    }


def _known_card(payment_method: str) -> bool:
    return payment_method in SUCCEEDING_CARDS or payment_method in DECLINING_CARDS


def _no_such_method() -> Reply:
    # The method id is not echoed: the fake keeps to the no-PII rule too.
    return invalid("No such PaymentMethod.", param="payment_method", code="resource_missing")


def parse_confirm(params: list[tuple[str, str]]) -> dict[str, Any] | Reply:
    """Validate confirm parameters (`payment_method`, optional); others are ignored."""
    payment_method = dict(params).get("payment_method") or None
    if payment_method is not None and not _known_card(payment_method):
        return _no_such_method()
    return {"payment_method": payment_method}


def parse_cancel(params: list[tuple[str, str]]) -> dict[str, Any] | Reply:
    """Validate cancel parameters (`cancellation_reason`, optional)."""
    reason = dict(params).get("cancellation_reason") or None
    if reason is not None and reason not in CANCELLATION_REASONS:
        return invalid(
            "Invalid cancellation_reason: must be one of duplicate, fraudulent, "
            "requested_by_customer, or abandoned",
            param="cancellation_reason",
        )
    return {"cancellation_reason": reason}


def parse_capture(params: list[tuple[str, str]]) -> dict[str, Any] | Reply:
    """Validate capture parameters (`amount_to_capture`, `metadata[...]`, both optional)."""
    raw_amount = dict(params).get("amount_to_capture")
    amount: int | None = None
    if raw_amount is not None and raw_amount != "":
        if not re.fullmatch(r"-?\d+", raw_amount) or int(raw_amount) < 1:
            return invalid(
                "Invalid positive integer",
                param="amount_to_capture",
                code="parameter_invalid_integer",
            )
        amount = int(raw_amount)
    metadata = _metadata(params)
    if isinstance(metadata, Reply):
        return metadata
    return {"amount_to_capture": amount, "metadata": metadata}


def _metadata(params: list[tuple[str, str]]) -> dict[str, str] | Reply:
    metadata = {m.group(1): v for k, v in params if (m := re.fullmatch(r"metadata\[(.+)\]", k))}
    if len(metadata) > 50 or any(len(k) > 40 or len(v) > 500 for k, v in metadata.items()):
        return invalid("Metadata exceeds the limits.", param="metadata", code="parameter_invalid")
    return metadata


def parse_refund(params: list[tuple[str, str]]) -> dict[str, Any] | Reply:
    """Validate refund create parameters; return them parsed or a 400 (never stored)."""
    flat = dict(params)
    payment_intent = flat.get("payment_intent") or None
    if payment_intent is None:
        if flat.get("charge"):
            return invalid("The fake provider refunds by payment_intent only.", param="charge")
        return invalid(
            "One of the following params should be provided for this request: "
            "payment_intent or charge.",
            param="payment_intent",
            code="parameter_missing",
        )
    amount: int | None = None
    raw_amount = flat.get("amount")
    if raw_amount is not None and raw_amount != "":
        if not re.fullmatch(r"-?\d+", raw_amount):
            return invalid(
                "Invalid integer: amount.", param="amount", code="parameter_invalid_integer"
            )
        amount = int(raw_amount)
        if amount < 1:
            return invalid(
                "Invalid positive integer", param="amount", code="parameter_invalid_integer"
            )
    reason = flat.get("reason") or None
    if reason is not None and reason not in REFUND_REASONS:
        return invalid(
            "Invalid reason: must be one of duplicate, fraudulent, or requested_by_customer",
            param="reason",
        )
    metadata = _metadata(params)
    if isinstance(metadata, Reply):
        return metadata
    return {
        "payment_intent": payment_intent,
        "amount": amount,
        "reason": reason,
        "metadata": metadata,
    }


def _request_id() -> str:
    """A new request id, shaped as Stripe's (`req_` and 14 letters or digits)."""
    return "req_" + "".join(secrets.choice(_REQUEST_ID_ALPHABET) for _ in range(14))


class _Server(ThreadingHTTPServer):
    """Threading server that remembers open connections so stop() can close them."""

    daemon_threads = True
    allow_reuse_address = True
    webhooks: WebhookSender | None = None  # set by FakeProviderServer when it sends events

    def __init__(self, address: tuple[str, int], state: FakeState, stopping: threading.Event):
        self.state = state
        self.stopping = stopping
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that time out and hang up are part of the game, not errors.
        logger.debug("fake provider: connection error from %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so Content-Length must be right
    server_version = "FakeProvider/1.0"
    sys_version = ""
    timeout = 120  # idle keep-alive connections do not hold a thread forever
    # Headers and body go out in two writes; without TCP_NODELAY, Nagle and
    # the client's delayed ACK add ~40 ms to every answer.
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.connections_lock:
            self.server.connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass  # the peer is gone; nothing left to flush

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        logger.debug("fake provider: " + format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # --- plumbing ---------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        try:
            body = self._read_body()
            parts = urlsplit(self.path)
            if parts.path.startswith("/_fake/"):
                reply = self._control(method, parts.path, body)
            else:
                reply = self._api(method, parts.path, parts.query, body)
        except Exception:
            logger.exception("fake provider: handler failed")
            reply = error_reply(500, "api_error", "The fake provider failed.")
        self._send(reply)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, reply: Reply) -> None:
        if reply.drop:
            # Close without a byte of answer: the client cannot know what happened.
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer
            return
        payload = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Request-Id", _request_id())
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()
        except OSError:
            # The client gave up (a read timeout during a slow fault); that is
            # exactly the situation the fault exists to create.
            self.close_connection = True

    # --- provider API -----------------------------------------------------------

    def _api(self, method: str, path: str, query: str, body: bytes) -> Reply:
        state = self.server.state
        if not state.check_api_key(_bearer(self.headers.get("Authorization"))):
            # The key is never echoed, not even masked.
            return error_reply(401, "invalid_request_error", "Invalid API Key provided.")
        args = parse_qsl(query, keep_blank_values=True)
        action = _INTENT_ACTION.fullmatch(path)
        if method == "POST" and (path in (_PI_PATH, _REFUNDS_PATH) or action is not None):
            params = parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
            key = self.headers.get("Idempotency-Key") or None
            if key is not None and len(key) > 255:
                return invalid("Idempotency-Key is too long.", param="Idempotency-Key")
            wait = self.server.stopping.wait
            if action is not None and action["action"] == "confirm":
                return state.confirm_payment_intent(
                    action["id"], params, parse_confirm(params), key, sleep=wait
                )
            if action is not None and action["action"] == "capture":
                return state.capture_payment_intent(
                    action["id"], params, parse_capture(params), key, sleep=wait
                )
            if action is not None:
                return state.cancel_payment_intent(
                    action["id"], params, parse_cancel(params), key, sleep=wait
                )
            if path == _REFUNDS_PATH:
                return state.create_refund(params, parse_refund(params), key, sleep=wait)
            return state.create_payment_intent(params, parse_create(params), key, sleep=wait)
        if method != "GET":
            return _unrecognized(method, path)
        flat = dict(args)
        if path == _REFUNDS_PATH:
            limit = _limit(flat.get("limit"))
            if isinstance(limit, Reply):
                return limit
            created = _created_filters(flat)
            if isinstance(created, Reply):
                return created
            return state.list_refunds(
                limit=limit,
                created=created,
                payment_intent=flat.get("payment_intent") or None,
                starting_after=flat.get("starting_after") or None,
                ending_before=flat.get("ending_before") or None,
            )
        if path.startswith(_REFUNDS_PATH + "/") and path.count("/") == 3:
            return state.retrieve_refund(path.rsplit("/", 1)[1])
        if path == f"{_PI_PATH}/search":
            limit = _limit(flat.get("limit"))
            if isinstance(limit, Reply):
                return limit
            if not flat.get("query"):
                return invalid(
                    "Missing required param: query.", param="query", code="parameter_missing"
                )
            clauses = parse_search_query(flat["query"])
            if clauses is None:
                return invalid("Unsupported search query.", param="query", code="parameter_invalid")
            page = flat.get("page") or "page_0"
            if not re.fullmatch(r"page_\d+", page):
                return invalid("Invalid page.", param="page", code="parameter_invalid")
            return state.search_payment_intents(clauses, limit, int(page.removeprefix("page_")))
        if path == _EVENTS_PATH:
            return _list_events(state, flat, args)
        if path == _PI_PATH:
            return self._list(state, flat)
        if path.startswith(_PI_PATH + "/") and path.count("/") == 3:
            return state.retrieve_payment_intent(path.rsplit("/", 1)[1])
        return _unrecognized(method, path)

    @staticmethod
    def _list(state: FakeState, flat: dict[str, str]) -> Reply:
        limit = _limit(flat.get("limit"))
        if isinstance(limit, Reply):
            return limit
        created = _created_filters(flat)
        if isinstance(created, Reply):
            return created
        return state.list_payment_intents(
            limit=limit,
            created=created,
            starting_after=flat.get("starting_after") or None,
            ending_before=flat.get("ending_before") or None,
        )

    # --- control API ------------------------------------------------------------

    def _control(self, method: str, path: str, body: bytes) -> Reply:
        state = self.server.state
        if method == "GET" and path == "/_fake/health":
            return Reply(200, {"status": "ok"})
        if method == "GET" and path == "/_fake/stats":
            return Reply(200, state.stats())
        if method == "GET" and path == "/_fake/timeline":
            return Reply(200, {"data": state.timeline()})
        if path == "/_fake/webhooks":
            return _webhooks_control(self.server.webhooks, method, body)
        if method != "POST":
            return _unrecognized(method, path)
        try:
            data = json.loads(body or b"{}")
            if not isinstance(data, dict):
                raise ValueError("a JSON object is required")
            if path == "/_fake/faults":
                queued = state.enqueue_faults(str(data.get("mode")), int(data.get("count", 1)))
                return Reply(200, {"queued": queued})
            if path == "/_fake/config":
                state.configure(**data)
                return Reply(200, state.stats()["config"])
            if path == "/_fake/incident":
                seconds, drop = float(data.get("seconds", 0)), float(data.get("drop_rate", 0.3))
                return Reply(200, state.start_incident(seconds, drop))
            if path == "/_fake/reset":
                state.reset()
                return Reply(200, {"reset": True})
            refund = _REFUND_CONTROL.fullmatch(path)
            if refund is not None and refund["action"] == "succeed":
                return Reply(200, state.complete_refund(refund["id"]))
            if refund is not None:
                return Reply(200, state.fail_refund(refund["id"], **data))
        except KeyError as exc:
            return error_reply(404, "invalid_request_error", str(exc.args[0] if exc.args else exc))
        except (ValueError, TypeError) as exc:
            return invalid(f"Bad control request: {exc}")
        return _unrecognized(method, path)


def _bearer(header: str | None) -> str | None:
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def _limit(raw: str | None) -> int | Reply:
    if raw is None or raw == "":
        return 10
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        return invalid(
            "Limit must be between 1 and 100.", param="limit", code="parameter_invalid_integer"
        )
    return int(raw)


def _unrecognized(method: str, path: str) -> Reply:
    return error_reply(
        404, "invalid_request_error", f"Unrecognized request URL ({method}: {path})."
    )


class FakeProviderServer:
    """Run the fake provider on a real socket; bind in the constructor, serve on start()."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Callable[[], float] = time.time,
        tls: bool = False,
        webhook_url: str | None = None,
        webhook_secret: str | None = None,
        webhook_options: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        self.state = FakeState(FakeConfig(**config), clock=clock)
        self._stopping = threading.Event()
        self._httpd = _Server((host, port), self.state, self._stopping)
        self._thread: threading.Thread | None = None
        #: The PEM of the throwaway CA that signed the server's certificate (TLS only).
        self.ca_pem: bytes | None = None
        if tls:
            self.ca_pem, context = _throwaway_tls(host)
            # The handshake runs on the connection's first read, in its own
            # handler thread: a slow client never holds up the accept loop.
            self._httpd.socket = context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        #: The webhook sender (None: no webhook URL, events are only listed).
        self.webhooks: WebhookSender | None = None
        if webhook_url or webhook_secret:
            if not (webhook_url and webhook_secret):
                raise ValueError("webhooks need both webhook_url and webhook_secret")
            self.webhooks = WebhookSender(
                webhook_url, webhook_secret, clock=clock, **(webhook_options or {})
            )
            self.state.add_event_sink(self.webhooks)
            self._httpd.webhooks = self.webhooks

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Base URL for clients, e.g. `http://127.0.0.1:54321` (`https://` with TLS)."""
        host = self.host
        scheme = "https" if self.ca_pem is not None else "http"
        return (
            f"{scheme}://[{host}]:{self.port}" if ":" in host else f"{scheme}://{host}:{self.port}"
        )

    def write_ca(self, path: str | Path) -> Path:
        """Write the CA certificate (PEM) to `path` atomically, for REQUESTS_CA_BUNDLE."""
        if self.ca_pem is None:
            raise ValueError("this fake provider serves plain HTTP; it has no CA")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(self.ca_pem)
        partial.replace(target)  # a reader never sees half a certificate
        return target

    def start(self) -> FakeProviderServer:
        """Serve in a daemon thread and return self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"fake-provider-{self.port}",
                daemon=True,
            )
            self._thread.start()
        if self.webhooks is not None:
            self.webhooks.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake slow faults, close open connections and the socket."""
        self._stopping.set()
        self.state.close()
        if self.webhooks is not None:
            self.webhooks.stop()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        with self._httpd.connections_lock:
            open_connections = list(self._httpd.connections)
        for conn in open_connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        self._httpd.server_close()

    def __enter__(self) -> FakeProviderServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _throwaway_tls(host: str) -> tuple[bytes, ssl.SSLContext]:
    """Return (CA PEM, server context) for a certificate of `host` from a new throwaway CA."""
    import trustme  # a development dependency: only the TLS option needs it

    ca = trustme.CA()
    names = list(dict.fromkeys([host, "127.0.0.1", "localhost"]))
    certificate = ca.issue_cert(*names)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    certificate.configure_cert(context)
    return ca.cert_pem.bytes(), context


def _list_events(state: FakeState, flat: dict[str, str], args: list[tuple[str, str]]) -> Reply:
    """`GET /v1/events`: the created filters and cursors of the intents' list, plus types."""
    limit = _limit(flat.get("limit"))
    if isinstance(limit, Reply):
        return limit
    created = _created_filters(flat)
    if isinstance(created, Reply):
        return created
    types = [value for name, value in args if re.fullmatch(r"types\[\d*\]", name)]
    if flat.get("type"):
        types.append(flat["type"])
    return state.list_events(
        limit=limit,
        created=created,
        types=types,
        starting_after=flat.get("starting_after") or None,
        ending_before=flat.get("ending_before") or None,
    )


def _webhooks_control(sender: WebhookSender | None, method: str, body: bytes) -> Reply:
    """`GET /_fake/webhooks`: counters; `POST`: queue faults and change the sender's config."""
    if sender is None:
        return error_reply(404, "invalid_request_error", "This fake provider sends no webhooks.")
    if method == "GET":
        return Reply(200, sender.stats())
    if method != "POST":
        return _unrecognized(method, "/_fake/webhooks")
    try:
        data = json.loads(body or b"{}")
        if not isinstance(data, dict):
            raise ValueError("a JSON object is required")
        fault = data.pop("fault", None)
        count = int(data.pop("count", 1))
        if data:
            sender.configure(**data)
        if fault is not None:
            sender.enqueue_faults(str(fault), count)
    except (ValueError, TypeError) as exc:
        return invalid(f"Bad control request: {exc}")
    return Reply(200, sender.stats())


def _created_filters(flat: dict[str, str]) -> dict[str, int] | Reply:
    """The `created`, `created[gt|gte|lt|lte]` filters of a list request, or its refusal."""
    created: dict[str, int] = {}
    for name, value in flat.items():
        match = re.fullmatch(r"created(?:\[(gt|gte|lt|lte)\])?", name)
        if match is None:
            continue
        if not re.fullmatch(r"-?\d+", value):
            return invalid("Invalid integer.", param=name, code="parameter_invalid_integer")
        created[match[1] or "eq"] = int(value)
    return created
