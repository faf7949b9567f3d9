"""Money shown to people (the desk, the confirmation e-mail): by each currency's own exponent.

Amounts are stored in minor units (`Order.amount`, the checkout's params, the
provider's answers); how many digits a currency has is the currency's, not
ours: JPY has none, EUR two, KWD three. Babel's CLDR data knows them, so no
table is kept here. One locale for the whole desk (the site's LANGUAGE_CODE):
an operator compares figures across pages, they must look the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from functools import cache
from typing import Any

from babel.core import Locale, UnknownLocaleError
from babel.numbers import format_currency, get_currency_precision
from django.conf import settings
from django.utils.translation import to_locale

__all__ = ["decimal_amount", "format_money", "format_totals", "major_units", "money_of"]


@cache
def _locale(language_code: str) -> Locale:
    try:
        return Locale.parse(to_locale(language_code))
    except (ValueError, UnknownLocaleError):
        return Locale.parse("en_US")


def major_units(amount: int, currency: str) -> Decimal:
    """Return `amount` minor units of `currency` in major units (5000 JPY -> 5000, 4999 EUR -> 49.99)."""
    return Decimal(int(amount)).scaleb(-get_currency_precision(currency.upper()))


def decimal_amount(amount: Any, currency: str) -> str:
    """Major units as a plain decimal ("49.99", "5000") for exports; "" when unknown."""
    if amount is None or amount == "" or not currency:
        return ""
    try:
        return str(major_units(int(amount), currency))
    except (TypeError, ValueError, ArithmeticError):
        return ""


def format_money(amount: Any, currency: Any) -> str:
    """Format minor units with the currency's symbol and exponent: "¥5,000", "€49.99"; "-" if unknown."""
    if amount is None or amount == "" or not isinstance(currency, str) or not currency.strip():
        return "-"
    try:
        value = major_units(int(amount), currency.strip())
    except (TypeError, ValueError, ArithmeticError):
        return "-"
    code = currency.strip().upper()
    return format_currency(value, code, locale=_locale(settings.LANGUAGE_CODE))


def money_of(params: Mapping[str, Any] | None) -> str:
    """Format the `amount` and `currency` of an operation's params (or a provider's answer)."""
    if not isinstance(params, Mapping):
        return "-"
    return format_money(params.get("amount"), params.get("currency"))


def format_totals(totals: Iterable[tuple[str, int]]) -> str:
    """Format (currency, minor units) totals, one per currency, as given: "€120.00 · ¥5,000"."""
    shown = [format_money(total, currency) for currency, total in totals if currency]
    return " · ".join(shown) if shown else "-"
