"""The developer tools refuse to be installed in a production configuration."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, register
from django.core.checks import Error as CheckError


@register(Tags.security, deploy=True)
def check_devtools_not_in_production(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """`check --deploy` with devtools installed and DEBUG off is an error."""
    if settings.DEBUG:
        return []
    return [
        CheckError(
            "The devtools app (fake provider, chaos run, bench) is installed with DEBUG off.",
            hint="Unset DEVTOOLS in production.",
            id="devtools.E001",
        )
    ]
