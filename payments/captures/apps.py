from __future__ import annotations

from django.apps import AppConfig


class CapturesConfig(AppConfig):
    """Captures (example): authorise now, capture an order's held payment later.

    One of the shop's example operations: listed in INSTALLED_APPS, its
    handler.py is discovered at start-up (payments.engine.handlers.discover_app_handlers);
    left out, the fence knows nothing of it.
    """

    name = "payments.captures"
    label = "payments_captures"
    verbose_name = "Captures (example)"
