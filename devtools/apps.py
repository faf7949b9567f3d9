from __future__ import annotations

from django.apps import AppConfig


class DevtoolsConfig(AppConfig):
    """Developer tooling: fake provider, chaos run, bench, local stack. Never in production."""

    name = "devtools"
    verbose_name = "Developer tools"

    def ready(self) -> None:
        from devtools import checks  # noqa: F401
