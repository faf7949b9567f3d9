"""The shop's lists: the orders' currency filter and the orders' search, in bounded time.

As the desk's own lists (payments.desk.lists): a filter from a bounded read
(the latest orders' currencies), a search routed by the term's shape to one
indexed lookup (an id; an e-mail through the index on LOWER(customer_email)).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Lower
from django.http import HttpRequest
from django.utils.html import format_html

from payments.desk.lists import DIGITS, search_link
from payments.engine.systems import reference_system
from payments.shop.models import Order


class RecentCurrencyFilter(admin.SimpleListFilter):
    """The currencies of the latest orders (a bounded read, not a DISTINCT over every order);
    any other still filters by its URL."""

    title = "currency"
    parameter_name = "currency"
    #: How many of the latest orders name the choices.
    LATEST = 1000

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        latest = Order.objects.order_by("-pk").values_list("currency", flat=True)[: self.LATEST]
        return [(code, code.upper()) for code in sorted(set(latest))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(currency=value)


def orders_with_email(term: str) -> QuerySet[Order]:
    """Orders of a customer's e-mail, any case, through the index on LOWER(customer_email)."""
    return Order.objects.annotate(email_lower=Lower("customer_email")).filter(
        email_lower=term.strip().lower()
    )


def search_orders(queryset: QuerySet[Order], term: str) -> QuerySet[Order] | None:
    """Orders a term names: digits, the id; an e-mail, the customer's (any case)."""
    term = term.strip()
    if DIGITS.match(term):
        return queryset.filter(pk=int(term))
    if "@" in term:
        return queryset.filter(pk__in=orders_with_email(term).values("pk"))
    return None


def orders_search_note(term: str, operations_url: str | None) -> str:
    """Where to look for a term the orders search does not take ("" for an id or an e-mail).

    Orders are found by their id or e-mail only; a provider reference, an
    operation key or an idempotency key is an operation's, so the note links
    the operations search for it (`operations_url`; None: the user may not
    view operations, and the note only says what the term is).
    """
    term = term.strip()
    if not term or DIGITS.match(term) or "@" in term:
        return ""
    system = reference_system(term)
    what = (
        f"looks like a reference of {system.label}"
        if system is not None
        else "may be an operation key or idempotency key"
    )
    said = format_html(
        "No order matches {}: the orders search finds orders by their id or the customer\u2019s "
        "e-mail, and {} {}.",
        term, term, what,
    )  # fmt: skip
    if operations_url is None:
        return said
    return format_html(
        "{} Search the operations for it: {}.", said, search_link(operations_url, term)
    )
