from __future__ import annotations

from django.apps import AppConfig


class RefundsConfig(AppConfig):
    """Refunds (example): give back part or all of an order's payment.

    One of the shop's example operations: listed in INSTALLED_APPS, its
    handler.py is discovered at start-up (payments.engine.handlers.discover_app_handlers);
    left out, the fence knows nothing of it.
    """

    name = "payments.refunds"
    label = "payments_refunds"
    verbose_name = "Refunds (example)"
