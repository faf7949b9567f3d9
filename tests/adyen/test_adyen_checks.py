"""Adyen's settings entry is checked at start-up: a merchant account and a hex HMAC key."""

from __future__ import annotations

import pytest

from payments.adyen.checks import check_adyen_settings
from tests.support.adyen import settings_entry


def ids(settings, **options) -> list[str]:
    entry = settings_entry("https://checkout-test.adyen.com/v72")
    entry["OPTIONS"] = {**entry["OPTIONS"], **options}
    settings.PAYMENTS = {**settings.PAYMENTS, "SYSTEMS": {"adyen": entry}}
    return [str(error.id) for error in check_adyen_settings()]


def test_checks__a_complete_entry__passes(settings):
    assert ids(settings) == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"MERCHANT_ACCOUNT": ""}, ["adyen.E001"]),
        ({"HMAC_KEY": "not-hex"}, ["adyen.E002"]),
        ({"HMAC_KEY": ""}, ["adyen.E002"]),
        ({"HMAC_KEY": "abcd"}, ["adyen.E002"]),  # two bytes is no key
    ],
)
def test_checks__an_incomplete_entry__names_what_is_missing(settings, options, expected):
    assert ids(settings, **options) == expected


def test_checks__no_adyen_entry__nothing_to_check(settings):
    settings.PAYMENTS = {**settings.PAYMENTS, "SYSTEMS": {}}

    assert check_adyen_settings() == []
