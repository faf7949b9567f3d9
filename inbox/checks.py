"""System checks of the inbox settings (``inbox.E001``, ``inbox.W001``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from inbox.conf import inbox_settings
from inbox.durations import format_duration


def register() -> None:
    """Register the inbox checks; called from ``InboxConfig.ready()``."""
    checks.register(check_settings, "inbox")
    checks.register(check_retention_covers_redelivery, "inbox")


def _skipped(app_configs: Sequence[AppConfig] | None) -> bool:
    return app_configs is not None and apps.get_app_config("inbox") not in app_configs


def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Report a malformed ``settings.INBOX`` (``inbox.E001``)."""
    if _skipped(app_configs):
        return []
    try:
        inbox_settings()
    except ImproperlyConfigured as exc:
        return [
            checks.Error(
                str(exc),
                hint="See the docstring of inbox/conf.py for every key and its default.",
                obj="settings.INBOX",
                id="inbox.E001",
            )
        ]
    return []


def check_retention_covers_redelivery(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn when a consumer's retention is shorter than RQ's redelivery window (``inbox.W001``).

    RQ hands a message back after a crash within minutes (abandoned-job
    retry), but a failed job can be requeued for as long as the failed
    registry keeps it: ``failure_ttl``, 1 year by default. An inbox row purged
    before that lets the requeued message run a second time.
    """
    if _skipped(app_configs):
        return []
    try:
        conf = inbox_settings()
    except ImproperlyConfigured:
        return []  # inbox.E001 reports it.
    horizon = conf.redelivery_horizon
    messages: list[checks.CheckMessage] = []
    for consumer, retention in sorted(conf.retention.items()):
        if retention >= horizon:
            continue
        messages.append(
            checks.Warning(
                f"Inbox retention of consumer {consumer!r} ({format_duration(retention)}) is "
                f"shorter than the redelivery horizon ({format_duration(horizon)}): a message "
                "that RQ hands back after its inbox row is purged runs a second time.",
                hint=(
                    f"Raise INBOX['RETENTION'][{consumer!r}] to at least "
                    f"{format_duration(horizon)}. If this deployment keeps failed jobs for less "
                    "than rq's default failure_ttl, or never requeues them after some age, state "
                    "that window in INBOX['REDELIVERY_HORIZON'] (seconds)."
                ),
                obj=f"INBOX['RETENTION'][{consumer!r}]",
                id="inbox.W001",
            )
        )
    return messages
