from __future__ import annotations

from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps
from django.core.exceptions import ImproperlyConfigured
from django.db.backends.signals import connection_created


class DeskAdminConfig(admin_apps.AdminConfig):
    """django.contrib.admin, its default site the desk's (payments.desk.site.DeskAdminSite)."""

    default_site = "payments.desk.site.DeskAdminSite"
    # Not the payments app's config: INSTALLED_APPS names this one explicitly.
    default = False


class PaymentsConfig(AppConfig):
    name = "payments"
    verbose_name = "Payments"

    def ready(self) -> None:
        # Every installed app's `handler` module registers its handlers (the engine runs
        # none it was not told of), and each module of PAYMENTS["HANDLER_MODULES"]; then
        # the system checks and metrics' receivers.
        from payments import checks  # noqa: F401
        from payments.conf import handler_modules_alone, payments_settings
        from payments.engine.driver import plan_once_per_connection
        from payments.engine.handlers import discover_app_handlers
        from payments.observability import metrics  # noqa: F401

        # A bad PAYMENTS is payments.E009's to report, with every other bad key; but the
        # handler modules are read on their own then, so that no process (gunicorn runs
        # no checks) starts without handlers its workers have.
        try:
            extra = payments_settings().handler_modules
        except ImproperlyConfigured:
            extra = handler_modules_alone()
        discover_app_handlers(extra)
        connection_created.connect(plan_once_per_connection, dispatch_uid="payments.generic-plans")
