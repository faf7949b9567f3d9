"""The fake Adyen over HTTP: the Checkout API under `/v72`, its control API under `/_fake/`.

The contract and its sources are in the package docstring (`devtools.fake_provider.adyen`).
A real HTTP/1.1 server on the standard library, like the Stripe fake's
(`devtools.fake_provider.server`), answering `Reply` values; a dropped answer closes
the socket without a byte.

Control API (no auth; JSON in and out), mirroring the Stripe fake's where it fits:

- `GET /_fake/health`: `{"status": "ok", "contract": "adyen"}`.
- `GET /_fake/stats`: the state's counters, and the sender's under `notifications`.
- `GET /_fake/timeline`: `{"data": [...]}`, what was executed in order: each payment
  (AUTHORISATION) and modification with its pspReference, originalReference,
  merchantReference, amount, success, reason and `executed_at` (the fake's clock).
- `POST /_fake/faults` `{"mode": "...", "count": N}`: queue faults for the next payments
  and modifications: `drop_after_accept` (execute, store the answer under the key, close
  the socket), `slow` (execute, hold the key in flight `slow_delay` s, then answer),
  `fail_before` (500, nothing executed or stored), `fail_after` (execute, store the real
  answer, answer a 500), `key_store_unavailable` (503 `703`, keyed requests only).
- `POST /_fake/config`: any `AdyenConfig` field (`api_key`, `merchant_accounts`,
  `capture`, `key_retention`, `in_flight_status`, `key_reuse`, the `<mode>_rate`s, `seed`,
  `slow_delay`, `latency`).
- `GET /_fake/notifications`: the sender's counters and config; `POST` with
  `{"fault": "duplicate", "count": N}` queues faults, any other keys change its config
  (`accept`, `retry_delays`, `max_attempts`, `give_up_after`, `timeout`, `delay`, ...).
- `POST /_fake/reset`: forget payments, modifications, keys, faults, counters and the
  notifications not yet delivered.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from devtools.fake_provider.adyen import contract
from devtools.fake_provider.adyen.notifications import NotificationSender
from devtools.fake_provider.adyen.parsing import parse_modification, parse_payment
from devtools.fake_provider.adyen.state import AdyenConfig, AdyenState
from devtools.fake_provider.state import Reply

logger = logging.getLogger(__name__)

_PAYMENTS = f"/{contract.API_VERSION}/payments"
_MODIFICATION = re.compile(
    rf"/{contract.API_VERSION}/payments/(?P<psp>[A-Za-z0-9]+)/(?P<kind>captures|refunds|cancels)"
)


class _Server(ThreadingHTTPServer):
    """Threading server that remembers open connections so stop() can close them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        state: AdyenState,
        stopping: threading.Event,
        notifications: NotificationSender | None,
    ) -> None:
        self.state = state
        self.stopping = stopping
        self.notifications = notifications
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that time out and hang up are part of the game, not errors.
        logger.debug("fake adyen: connection error from %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so Content-Length must be right
    server_version = "FakeAdyen/1.0"
    sys_version = ""
    timeout = 120  # idle keep-alive connections do not hold a thread forever
    disable_nagle_algorithm = True  # headers and body go in two writes
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
        logger.debug("fake adyen: " + format, *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length > 0 else b""
            path = urlsplit(self.path).path
            if path.startswith("/_fake/"):
                reply = _control(self.server, method, path, body)
            else:
                reply = self._api(method, path, body)
        except Exception:
            logger.exception("fake adyen: handler failed")
            reply = contract.internal_error()
        self._send(reply)

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
            self.send_header("Content-Type", "application/json;charset=UTF-8")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()
        except OSError:
            # The client gave up (a read timeout during a slow fault): the fault's point.
            self.close_connection = True

    def _api(self, method: str, path: str, body: bytes) -> Reply:
        state = self.server.state
        if not state.check_api_key(self.headers.get(contract.API_KEY_HEADER)):
            return contract.unauthorized()
        modification = _MODIFICATION.fullmatch(path)
        if method != "POST" or (path != _PAYMENTS and modification is None):
            return contract.not_found(method, path)  # no lookup: nothing else is served
        key = self.headers.get(contract.IDEMPOTENCY_HEADER) or None
        if key is not None and len(key) > contract.IDEMPOTENCY_KEY_MAX:
            return contract.key_too_long()
        wait = self.server.stopping.wait
        if modification is None:
            return state.authorise(parse_payment(body), key, wait)
        kind = modification["kind"]
        return state.modify(kind, modification["psp"], parse_modification(kind, body), key, wait)


def _control(server: _Server, method: str, path: str, body: bytes) -> Reply:
    """Answer a control API request (no auth: the fake is a developer tool)."""
    state = server.state
    if method == "GET" and path == "/_fake/health":
        return Reply(200, {"status": "ok", "contract": "adyen"})
    if method == "GET" and path == "/_fake/stats":
        sender = server.notifications
        return Reply(200, state.stats() | {"notifications": sender.stats() if sender else None})
    if method == "GET" and path == "/_fake/timeline":
        return Reply(200, {"data": state.timeline()})
    if path == "/_fake/notifications":
        return _notifications_control(server.notifications, method, body)
    if method != "POST":
        return contract.not_found(method, path)
    try:
        data = _object(body)
        if path == "/_fake/faults":
            queued = state.enqueue_faults(str(data.get("mode")), int(data.get("count", 1)))
            return Reply(200, {"queued": queued})
        if path == "/_fake/config":
            state.configure(**data)
            return Reply(200, state.stats()["config"])
        if path == "/_fake/reset":
            state.reset()
            return Reply(200, {"reset": True})
    except (ValueError, TypeError) as exc:
        return contract.service_error(400, "000", f"Bad control request: {exc}", "validation")
    return contract.not_found(method, path)


def _notifications_control(sender: NotificationSender | None, method: str, body: bytes) -> Reply:
    if sender is None:
        return contract.not_found(method, "/_fake/notifications (no notification URL)")
    if method == "GET":
        return Reply(200, sender.stats())
    try:
        data = _object(body)
        fault, count = data.pop("fault", None), int(data.pop("count", 1))
        if data:
            sender.configure(**data)
        if fault is not None:
            sender.enqueue_faults(str(fault), count)
    except (ValueError, TypeError) as exc:
        return contract.service_error(400, "000", f"Bad control request: {exc}", "validation")
    return Reply(200, sender.stats())


def _object(body: bytes) -> dict[str, Any]:
    data = json.loads(body or b"{}")
    if not isinstance(data, dict):
        raise ValueError("a JSON object is required")
    return data


class FakeAdyenServer:
    """Run the fake Adyen on a real socket; bind in the constructor, serve on start()."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Callable[[], float] = time.time,
        notification_url: str | None = None,
        hmac_key: str | None = None,
        notification_options: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        if "merchant_accounts" in config:
            config["merchant_accounts"] = tuple(config["merchant_accounts"] or ())
        self.state = AdyenState(AdyenConfig(**config), clock=clock)
        #: The notification sender (None: no notification URL, nothing is sent).
        self.notifications: NotificationSender | None = None
        if notification_url or hmac_key:
            if not (notification_url and hmac_key):
                raise ValueError("notifications need both notification_url and hmac_key")
            self.notifications = NotificationSender(
                notification_url, hmac_key, clock=clock, **(notification_options or {})
            )
            self.state.add_sink(self.notifications)
        self._stopping = threading.Event()
        self._httpd = _Server((host, port), self.state, self._stopping, self.notifications)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The server's root, e.g. `http://127.0.0.1:54321` (the control API is under it)."""
        host = str(self._httpd.server_address[0])
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def checkout_url(self) -> str:
        """The Checkout API's base URL, what the Adyen library's `baseUrl` is set to."""
        return f"{self.url}/{contract.API_VERSION}"

    def start(self) -> FakeAdyenServer:
        """Serve in a daemon thread (and start the notification sender); return self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"fake-adyen-{self.port}",
                daemon=True,
            )
            self._thread.start()
        if self.notifications is not None:
            self.notifications.start()
        return self

    def stop(self) -> None:
        """Stop serving, wake slow faults, close open connections and the socket."""
        self._stopping.set()
        if self.notifications is not None:
            self.notifications.stop()
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

    def __enter__(self) -> FakeAdyenServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
