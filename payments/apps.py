from __future__ import annotations

from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "payments"
    verbose_name = "Payments"

    def ready(self) -> None:
        # Registers the checkout handlers (the engine runs none it was not told of),
        # the system checks and the metrics' signal receivers.
        from payments import checks  # noqa: F401
        from payments.checkout import followups, handler  # noqa: F401
        from payments.observability import metrics  # noqa: F401
