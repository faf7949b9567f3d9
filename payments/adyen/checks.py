"""System checks of Adyen's settings entry (ids `adyen.E001`...), registered at start-up."""

from __future__ import annotations

import binascii
from typing import Any

from django.core import checks

from payments.adyen.system import NAME


@checks.register(checks.Tags.compatibility)
def check_adyen_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """An Adyen entry names its merchant account and a hex HMAC key for its notifications."""
    from django.core.exceptions import ImproperlyConfigured

    from payments.conf import payments_settings

    try:
        entry = payments_settings().system(NAME)
    except ImproperlyConfigured:
        return []  # payments.E009 reports it
    if entry is None:
        return []
    errors: list[checks.CheckMessage] = []
    if not entry.option("MERCHANT_ACCOUNT"):
        errors.append(
            checks.Error(
                'PAYMENTS["SYSTEMS"]["adyen"]["OPTIONS"] has no MERCHANT_ACCOUNT.',
                hint="The merchant account every payment and modification is made for.",
                id="adyen.E001",
            )
        )
    key = str(entry.option("HMAC_KEY") or "")
    try:
        valid = bool(key) and len(binascii.unhexlify(key)) >= 16
    except (binascii.Error, ValueError):
        valid = False
    if not valid:
        errors.append(
            checks.Error(
                'PAYMENTS["SYSTEMS"]["adyen"]["OPTIONS"]["HMAC_KEY"] is not a hex HMAC key.',
                hint="The key of the notification endpoint in Adyen's Customer Area: without "
                "it every notification is refused, and no lost answer is settled by one.",
                id="adyen.E002",
            )
        )
    return errors
