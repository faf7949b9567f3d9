from __future__ import annotations

from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "payments"
    verbose_name = "Payments"

    def ready(self) -> None:
        from payments import checkout, checks, metrics  # noqa: F401  (handler, checks, receivers)
