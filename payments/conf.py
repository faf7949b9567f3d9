"""The payments app's settings, read through one accessor with defaults."""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    "PROVIDER_URL": "http://127.0.0.1:8765",
    "PROVIDER_API_KEY": "sk_test_fake",
    "PROVIDER_CONNECT_TIMEOUT": 3.0,
    "PROVIDER_READ_TIMEOUT": 10.0,
    "PROVIDER_KEY_RETENTION": 24 * 3600,
    "JOB_TIMEOUT": 30,
    "CLAIM_LEASE": 45,
    "MAX_ATTEMPTS": 3,
    "RETRY_BACKOFF": [2, 8],
    "RECONCILE_GRACE": 15 * 60,
    "QUEUE": "payments",
    #: How long step claims are kept (seconds); None: forever (nothing purges them today).
    "CLAIM_RETENTION": None,
}


def payments_setting(name: str) -> Any:
    """Return PAYMENTS[name] from the settings, or its default."""
    if name not in DEFAULTS:
        raise KeyError(f"unknown payments setting {name!r}")
    return getattr(settings, "PAYMENTS", {}).get(name, DEFAULTS[name])
