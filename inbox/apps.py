"""App configuration of the inbox."""

from __future__ import annotations

from django.apps import AppConfig


class InboxConfig(AppConfig):
    """Register the inbox system checks."""

    name = "inbox"
    verbose_name = "Inbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from inbox import checks

        checks.register()
