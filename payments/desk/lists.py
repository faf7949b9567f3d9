"""The operators' lists in bounded time, however long the history.

A changelist is sorted on the primary key (newest first), counts its rows
only up to a bound (past it, the planner's estimate: no COUNT over a year of
rows), builds its filters from what the code declares (the registered
handlers) or from a bounded read (the latest orders' currencies), never from a
DISTINCT over the table, and
routes a search by the shape of the term to one indexed lookup: a bare number
is an order id, `#17` (or `op 17`) an operation id, and a note above the list
says which one matched.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Lower
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.http import urlencode

from payments.engine.handlers import registered_handlers
from payments.engine.systems import reference_system
from payments.models import Operation, Order, StepClaim

#: Rows counted exactly; past this the count is the planner's estimate ("about").
EXACT_COUNT_UP_TO = 10_000


def is_reference(term: str) -> bool:
    """Tell whether `term` looks like a reference of a declared external system
    (payments.engine.systems: each system declares its patterns)."""
    return reference_system(term) is not None


DIGITS = re.compile(r"^\d{1,18}$")
#: An operation by its id: "#17", "op 17", "operation 17" (a bare number is an order id).
OPERATION_ID = re.compile(r"^(?:#|op|operation)[\s:#]*(\d{1,18})$", re.IGNORECASE)


class EstimatedCountPaginator(Paginator):
    """Counts at most EXACT_COUNT_UP_TO + 1 rows; past that, takes the planner's estimate."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        # Only the keys: the page's annotations (subqueries per row) count nothing.
        bounded = queryset.order_by().values("pk")[: EXACT_COUNT_UP_TO + 1].count()
        if bounded <= EXACT_COUNT_UP_TO:
            return bounded
        return max(bounded, planner_estimate(queryset))


def planner_estimate(queryset: QuerySet[Any]) -> int:
    """The rows PostgreSQL expects the query to return (from its statistics; no scan)."""
    sql, params = queryset.order_by().query.sql_with_params()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        raw = cursor.fetchone()[0]
    plan = json.loads(raw) if isinstance(raw, str) else raw
    return int(plan[0]["Plan"]["Plan Rows"])


class BoundedListMixin:
    """A changelist that never counts the whole table (sort it on "-pk" too)."""

    paginator: type[Paginator] = EstimatedCountPaginator
    show_full_result_count = False  # no second COUNT(*) of every row for "N total"


class KindFilter(admin.SimpleListFilter):
    """The operation kinds the registered handlers declare (not a DISTINCT over operations)."""

    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(kind, kind) for kind in sorted(registered_handlers())]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(kind=value)


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


def operation_id_in(term: str) -> int | None:
    """The operation id a term names ("#17", "op 17"); None for any other term."""
    found = OPERATION_ID.match(term.strip())
    return int(found.group(1)) if found else None


def search_operations(
    queryset: QuerySet[Any], term: str, *, may_view_orders: bool
) -> QuerySet[Any] | None:
    """Operations a term names, by its shape; None for a term of no known shape.

    A declared system's reference: the claims carrying it (EXISTS through the
    reference index); digits: the order's operations (the entity index), never
    the operation with that id, which `#17` or `op 17` finds (or a key spelled
    so); an e-mail: that customer's orders (for who may view orders).
    """
    term = term.strip()
    if is_reference(term):
        carrying = StepClaim.objects.filter(operation=OuterRef("pk"), provider_reference=term)
        return queryset.filter(Exists(carrying))
    if DIGITS.match(term):
        return queryset.filter(entity_type="order", entity_id=term)
    op_id = operation_id_in(term)
    if op_id is not None:
        return queryset.filter(Q(pk=op_id) | Q(key=term))
    if "@" in term:
        if not may_view_orders:
            return queryset.none()
        ids = [str(pk) for pk in orders_with_email(term).values_list("pk", flat=True)[:100]]
        return queryset.filter(entity_type="order", entity_id__in=ids)
    return None


def operations_search_note(term: str, changelist_url: str) -> str:
    """What a number search matched, for the note above the list ("" for other terms).

    A bare number lists its order's operations; when an operation of another
    order has that id, the note names it and links its `#id` search (one
    primary-key read).
    """
    term = term.strip()
    op_id = operation_id_in(term)
    if op_id is not None:
        return format_html(
            "Operation #{} (by its id). Order {}\u2019s operations: search {}.",
            op_id, op_id, _search_link(changelist_url, str(op_id)),
        )  # fmt: skip
    if not DIGITS.match(term):
        return ""
    other = (
        Operation.objects.filter(pk=int(term))
        .exclude(entity_type="order", entity_id=term)
        .values_list("key", "entity_type", "entity_id")
        .first()
    )
    if other is None:
        return format_html(
            "Operations of order {}. A number is an order id; #{} finds an operation by its id.",
            term, term,
        )  # fmt: skip
    key, entity_type, entity_id = other
    return format_html(
        "Operations of order {}. Operation #{} ({}, of {} {}) is not one of them: search {}.",
        term, term, key, entity_type, entity_id,
        _search_link(changelist_url, f"#{term}"),
    )  # fmt: skip


def _search_link(changelist_url: str, term: str) -> str:
    url = f"{changelist_url}?{urlencode({'q': term})}"
    return format_html('<a class="desk-search-link" href="{}">{}</a>', url, term)


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
        "{} Search the operations for it: {}.", said, _search_link(operations_url, term)
    )
