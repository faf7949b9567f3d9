"""Fixtures for provider events: a webhook secret, a capturing receiver, and providers that send.

`receiver` is a tiny HTTP server that records every delivery (headers and raw
body) and answers with the statuses a test queues (200 by default).
`live_provider` sends its webhooks to this app's own endpoint on
pytest-django's `live_server`, the whole real path.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from devtools.fake_provider.server import FakeProviderServer
from devtools.fake_provider.webhooks import sign
from tests.support.config import TEST_PAYMENTS

SECRET = "whsec_test_0123456789abcdef"
OLD_SECRET = "whsec_test_rotated_out_0000"


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes

    @property
    def event(self) -> dict[str, Any]:
        return json.loads(self.body)


@dataclass
class Receiver:
    """What the capturing server got, and what it answers next."""

    url: str = ""
    deliveries: list[Delivery] = field(default_factory=list)
    statuses: deque[int] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for(self, count: int, timeout: float = 5.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.deliveries) >= count:
                    return list(self.deliveries)
            time.sleep(0.02)
        raise AssertionError(f"{len(self.deliveries)} deliveries, waited for {count}")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (stdlib name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with got.lock:
                got.deliveries.append(Delivery(dict(self.headers.items()), body))
                status = got.statuses.popleft() if got.statuses else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    got.url = f"http://127.0.0.1:{server.server_address[1]}/hooks"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hooked(receiver: Receiver) -> Iterator[FakeProviderServer]:
    """A fake provider that sends its signed events to `receiver`, retrying fast."""
    server = FakeProviderServer(
        "127.0.0.1",
        0,
        slow_delay=1.0,
        webhook_url=receiver.url,
        webhook_secret=SECRET,
        webhook_options={"backoff": 0.05, "max_backoff": 0.2, "reorder_hold": 1.0},
    ).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def hook_settings(settings):
    """The app's settings with the webhook secret (and the test timeouts)."""
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        **TEST_PAYMENTS,
        "PROVIDER_WEBHOOK_SECRETS": [SECRET],
    }
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    return settings


@pytest.fixture
def live_provider(live_server, hook_settings) -> Iterator[FakeProviderServer]:
    """A fake provider whose webhooks reach this app's endpoint on the live server."""
    server = FakeProviderServer(
        "127.0.0.1",
        0,
        slow_delay=1.0,
        webhook_url=f"{live_server.url}/webhooks/provider",
        webhook_secret=SECRET,
        webhook_options={"backoff": 0.1, "max_backoff": 0.5},
    ).start()
    hook_settings.PAYMENTS = {**hook_settings.PAYMENTS, "PROVIDER_URL": server.url}
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def provider_with_secret(provider, hook_settings):
    """The root conftest's provider (no webhooks), with the app knowing the webhook secret."""
    hook_settings.PAYMENTS = {**hook_settings.PAYMENTS, "PROVIDER_URL": provider.url}
    return provider


def signed(payload: dict[str, Any] | bytes, *, secret: str = SECRET, at: float | None = None):
    """Return (body, Stripe-Signature header) as the fake provider signs them."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return body, sign(body, secret, int(time.time() if at is None else at))


def event_about(obj: dict[str, Any], event_type: str, event_id: str = "evt_test_1") -> dict:
    """A Stripe-shaped event carrying `obj` (for facts the fake would not produce)."""
    return {
        "id": event_id,
        "object": "event",
        "api_version": "2024-06-20",
        "created": int(time.time()),
        "data": {"object": obj},
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": None, "idempotency_key": None},
        "type": event_type,
    }
