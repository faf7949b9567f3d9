"""The JSON API's test client (the `api` fixture in tests/conftest.py hands one out)."""

from __future__ import annotations

from typing import Any

from django.test import Client

#: settings.API_TOKEN under the `api` fixture: long enough for the production settings check.
API_TOKEN = "test-token-that-is-long-enough-0123456789"


def api_client(token: str = API_TOKEN, **defaults: Any) -> Client:
    """Return a test client that sends `token` as its bearer token on every request."""
    return Client(headers={"Authorization": f"Bearer {token}"}, **defaults)
