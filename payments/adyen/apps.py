from __future__ import annotations

from django.apps import AppConfig


class AdyenConfig(AppConfig):
    """Adyen as a payment system: its declaration, effects, notifications and checks."""

    name = "payments.adyen"
    label = "adyen"
    verbose_name = "Adyen"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from payments.adyen import checks, system  # noqa: F401  (declare, register checks)
