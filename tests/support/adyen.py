"""Adyen in the tests: the fake's settings entry, a notification catcher, delivery to the app.

The fake Adyen (devtools.fake_provider.adyen) signs and POSTs each notification to a
catcher here, which keeps it; a test then delivers the very bytes Adyen signed to the
app's endpoint (`deliver`) when its scenario wants them: at once, twice, tampered, or
never (a notification that never comes).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from django.test import Client

API_KEY = "AQEfake_test_key"
MERCHANT = "ShopECOM"
HMAC_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
ENDPOINT = "/adyen/notifications/"


def settings_entry(checkout_url: str, **options: Any) -> dict[str, Any]:
    """PAYMENTS["SYSTEMS"]["adyen"] pointing at the fake."""
    return {
        "URL": checkout_url,
        "API_KEY": API_KEY,
        "OPTIONS": {"MERCHANT_ACCOUNT": MERCHANT, "HMAC_KEY": HMAC_KEY, **options},
    }


def worker_env_of(checkout_url: str) -> dict[str, str]:
    """The variables a worker process reads Adyen's entry from (project/settings.py), the
    same entry as `settings_entry`'s."""
    return {
        "ADYEN_URL": checkout_url,
        "ADYEN_API_KEY": API_KEY,
        "ADYEN_MERCHANT_ACCOUNT": MERCHANT,
        "ADYEN_HMAC_KEY": HMAC_KEY,
    }


def adyen_shop(name: str = "adyen-shop") -> Any:
    """A shop (an API client) that pays through Adyen."""
    from payments.models import ApiClient

    return ApiClient.objects.create(name=name, payment_system="adyen")


class Catcher:
    """Keeps every notification body the fake sends (answering `[accepted]`)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        catcher = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with catcher.cond:
                    catcher.bodies.append(body)
                    catcher.cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "10")
                self.end_headers()
                self.wfile.write(b"[accepted]")

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}{ENDPOINT}"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def wait_for(self, event: str, count: int = 1, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The bodies of `count` notifications of `event`, once the fake sent them."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.of(event)) >= count, timeout), self.bodies
            return self.of(event)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [b for b in self.bodies if item(b)["eventCode"] == event]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def item(body: dict[str, Any]) -> dict[str, Any]:
    """The body's one NotificationRequestItem."""
    return body["notificationItems"][0]["NotificationRequestItem"]


def deliver(body: dict[str, Any]) -> tuple[int, str]:
    """POST a notification body to the app's endpoint; (status, text)."""
    answer = Client().post(ENDPOINT, data=json.dumps(body), content_type="application/json")
    return answer.status_code, answer.content.decode()
