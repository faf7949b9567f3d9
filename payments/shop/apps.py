from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    """The shop (example): orders, invoices, credit notes and the sales ledger.

    The business the example operations (checkout, captures, refunds, the
    accounting export) act on. The fence does not need it: a project that
    fences its own models leaves it, and those operations, out of INSTALLED_APPS.
    """

    name = "payments.shop"
    label = "shop"
    verbose_name = "Shop (example)"
    default_auto_field = "django.db.models.BigAutoField"
