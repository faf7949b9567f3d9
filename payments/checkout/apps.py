from __future__ import annotations

from django.apps import AppConfig


class CheckoutConfig(AppConfig):
    """The checkout (example): charge an order, invoice it, confirm it, mark it paid; its follow-ups.

    One of the shop's example operations: listed in INSTALLED_APPS, its
    handler.py is discovered at start-up (payments.engine.handlers.discover_app_handlers);
    left out, the fence knows nothing of it.
    """

    name = "payments.checkout"
    label = "payments_checkout"
    verbose_name = "Checkout (example)"
