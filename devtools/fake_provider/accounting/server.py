"""The fake accounting API over HTTP: `/v1/invoices`, its control API under `/_fake/`.

The contract is in the package docstring (`devtools.fake_provider.accounting`). A real
HTTP/1.1 server on the standard library, like the other fakes', answering `Reply` values;
a dropped answer closes the socket without a byte.
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
from urllib.parse import parse_qs, urlsplit

from devtools.fake_provider.accounting.state import AccountingConfig, AccountingState, error
from devtools.fake_provider.state import Reply

logger = logging.getLogger(__name__)

INVOICES = "/v1/invoices"
_ONE_INVOICE = re.compile(r"/v1/invoices/(?P<id>[A-Za-z0-9_]+)")


class _Server(ThreadingHTTPServer):
    """Threading server that remembers open connections so stop() can close them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], state: AccountingState, stopping: threading.Event
    ) -> None:
        self.state = state
        self.stopping = stopping
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that time out and hang up are part of the game, not errors.
        logger.debug("fake accounting: connection error from %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so Content-Length must be right
    server_version = "FakeAccounting/1.0"
    sys_version = ""
    timeout = 120  # idle keep-alive connections do not hold a thread forever
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

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        logger.debug("fake accounting: " + format, *args)

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
            url = urlsplit(self.path)
            if url.path.startswith("/_fake/"):
                reply = _control(self.server, method, url.path, body)
            else:
                reply = self._api(method, url.path, url.query, body)
        except Exception:
            logger.exception("fake accounting: handler failed")
            reply = error(500, "internal_error", "the fake failed")
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
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client gave up (a read timeout)

    def _api(self, method: str, path: str, query: str, body: bytes) -> Reply:
        state = self.server.state
        if not state.check_api_key(self.headers.get("Authorization")):
            return error(401, "unauthorized", "a valid Authorization: Bearer key is required")
        if path == INVOICES and method == "POST":
            key = self.headers.get("Idempotency-Key")
            return state.create(body, key, self.server.stopping)
        if path == INVOICES and method == "GET":
            external_id = parse_qs(query).get("external_id", [""])[-1]
            if not external_id:
                return error(400, "invalid_request", "external_id is required", "external_id")
            return state.list_by_external_id(external_id)
        one = _ONE_INVOICE.fullmatch(path)
        if one is not None and method == "GET":
            return state.retrieve(one["id"])
        return error(404, "not_found", f"no route {method} {path}")


def _control(server: _Server, method: str, path: str, body: bytes) -> Reply:
    """Answer a control API request (no auth: the fake is a developer tool)."""
    state = server.state
    if method == "GET" and path == "/_fake/health":
        return Reply(200, {"status": "ok", "contract": "accounting"})
    if method == "GET" and path == "/_fake/stats":
        return Reply(200, state.stats())
    if method == "GET" and path == "/_fake/invoices":
        return Reply(200, {"data": state.invoices()})
    if method != "POST":
        return error(404, "not_found", f"no route {method} {path}")
    try:
        data = json.loads(body or b"{}")
        if not isinstance(data, dict):
            raise ValueError("a JSON object is required")
        if path == "/_fake/faults":
            queued = state.enqueue_faults(str(data.get("mode")), int(data.get("count", 1)))
            return Reply(200, {"queued": queued})
        if path == "/_fake/release":
            return Reply(200, {"released": state.release()})
        if path == "/_fake/config":
            state.configure(**data)
            return Reply(200, state.stats()["config"])
        if path == "/_fake/reset":
            state.reset()
            return Reply(200, {"reset": True})
    except (ValueError, TypeError) as exc:
        return error(400, "invalid_request", f"bad control request: {exc}")
    return error(404, "not_found", f"no route {method} {path}")


class FakeAccountingServer:
    """Run the fake accounting API on a real socket; bind in the constructor, serve on start()."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Callable[[], float] = time.time,
        **config: Any,
    ) -> None:
        self.state = AccountingState(AccountingConfig(**config), clock=clock)
        self._stopping = threading.Event()
        self._httpd = _Server((host, port), self.state, self._stopping)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """The server's root, e.g. `http://127.0.0.1:54321` (the control API is under it)."""
        host = str(self._httpd.server_address[0])
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> FakeAccountingServer:
        """Serve in a daemon thread; return self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"fake-accounting-{self.port}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, let held and slow requests end, close connections and the socket."""
        self._stopping.set()
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

    def __enter__(self) -> FakeAccountingServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
