from __future__ import annotations

from django.apps import AppConfig


class InvoicesConfig(AppConfig):
    """The invoice export (example): each paid order's invoice sent to the accounting system.

    One of the shop's example operations: listed in INSTALLED_APPS, its
    handler.py is discovered at start-up (payments.engine.handlers.discover_app_handlers);
    left out, the fence knows nothing of it.
    """

    name = "payments.invoices"
    label = "payments_invoices"
    verbose_name = "Invoices (example)"
