"""The operators' lists in bounded time, however long the history.

A changelist is sorted on the primary key (newest first), counts its rows
only up to a bound (past it, the planner's estimate: no COUNT over a year of
rows), builds its filters from what the code declares (the registered
handlers), never from a DISTINCT over the table, and routes a search by the
shape of the term to one indexed lookup: a bare number is the key of an entity
the handlers declare (an order), `#17` (or `op 17`) an operation id, and a note
above the list says which one matched.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import EmailField, Exists, F, Model, OuterRef, Q, QuerySet
from django.db.models.functions import Lower
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.http import urlencode

from payments.desk.views.nothing_ran import failed_before_running_q, gave_up_ids
from payments.engine.fence import ENTITY_KEY_LENGTH, entity_key_kind
from payments.engine.handlers import entity_models, registered_handlers
from payments.engine.systems import reference_system
from payments.models import Operation, StepClaim

#: Rows counted exactly; past this the count is the planner's estimate ("about").
EXACT_COUNT_UP_TO = 10_000


def is_reference(term: str) -> bool:
    """Tell whether `term` looks like a reference of a declared external system
    (payments.engine.systems: each system declares its patterns)."""
    return reference_system(term) is not None


DIGITS = re.compile(r"^\d{1,18}$")
#: An operation by its id: "#17", "op 17", "operation 17" (a bare number is an entity's key).
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


class NothingRanFilter(admin.SimpleListFilter):
    """Failed before anything ran, no new attempt asked for since, of any age: the cases
    Needs attention lists for FAILED_WINDOW only, and links here for the rest."""

    title = "failed before anything ran"
    parameter_name = "nothing_ran"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes, no new attempt yet")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() != "yes":
            return queryset
        return queryset.filter(pk__in=gave_up_ids()).filter(failed_before_running_q())


def operation_id_in(term: str) -> int | None:
    """The operation id a term names ("#17", "op 17"); None for any other term."""
    found = OPERATION_ID.match(term.strip())
    return int(found.group(1)) if found else None


def search_operations(
    queryset: QuerySet[Any], term: str, *, may_view: Callable[[type[Model]], bool]
) -> QuerySet[Any] | None:
    """Operations a term names, by its shape; None for a term of no known shape.

    A declared system's reference: the claims that carry it or whose look saw it
    (`claims_with_reference`, through the two reference indexes); digits: the
    operations of the entity with that key, for each entity model the handlers
    declare with an integer key (the entity index), never the operation with
    that id, which `#17` or `op 17` finds (or a key spelled so); an e-mail: the operations of the entities whose e-mail
    field holds it (any case), of the models `may_view` lets the user see.
    Whatever its shape, a term that is a text or UUID entity's key also finds
    that entity's operations (`entities_keyed`, read first through the entity
    index: a term of no other shape that finds them is not searched further).
    """
    term = term.strip()
    keyed = entities_keyed(term)
    # Their ids, not their condition: ORed with an EXISTS or a scan, the entity index's
    # condition would turn every such search into a scan of the operations.
    ids = (
        list(queryset.filter(keyed).values_list("pk", flat=True)[:ENTITY_MATCHES]) if keyed else []
    )

    def also_keyed(condition: Q) -> Q:
        return condition | Q(pk__in=ids) if ids else condition

    if is_reference(term):
        return queryset.filter(also_keyed(Q(Exists(claims_with_reference(term)))))
    if DIGITS.match(term):
        return queryset.filter(also_keyed(_of_entities({m: [term] for m in keyed_by_integer()})))
    op_id = operation_id_in(term)
    if op_id is not None:
        return queryset.filter(also_keyed(Q(pk=op_id) | Q(key=term)))
    if "@" in term:
        seen = [m for m in entity_models() if may_view(m) and email_fields(m)]
        emails = _of_entities({m: entities_with_email(m, term) for m in seen})
        return queryset.filter(also_keyed(emails))
    return queryset.filter(pk__in=ids) if ids else None


def claims_with_reference(term: str) -> QuerySet[StepClaim]:
    """The claims of the outer operation (`OuterRef("pk")`) that carry `term`: as their
    reference (`provider_reference`, from an answer or a settlement), or as what a look
    saw at the provider while the step was not settled with it (`seen_reference`: the
    desk's query of an operation a worker may still run, a contradiction held).

    One EXISTS over both: PostgreSQL reads each column's partial index and joins the
    few claims found to their operations (two EXISTS ORed would test every operation).
    """
    seen = Q(provider_reference=term) | Q(seen_reference=term)
    return StepClaim.objects.filter(seen, operation=OuterRef("pk"))


#: The operations of text- or UUID-keyed entities one search lists at most (an entity has
#: a handful: its operation, retries, reversals).
ENTITY_MATCHES = 500


def keyed_by(*kinds: str) -> list[type[Model]]:
    """The entity models the handlers declare whose key is of one of these kinds
    (`entity_key_kind`: integer, uuid, text), by name."""
    keyed = [m for m in entity_models() if entity_key_kind(m) in kinds]
    return sorted(keyed, key=lambda m: str(m._meta.verbose_name))


def keyed_by_integer() -> list[type[Model]]:
    """The entity models the handlers declare whose key is an integer (a bare number's)."""
    return keyed_by("integer")


def entities_keyed(term: str) -> Q | None:
    """Operations of the text- or UUID-keyed entities whose key `term` is, by the entity
    index; None when no such key can be `term` (no such entity declared, too long).

    A text key is matched exactly as written (case included). A UUID in any form
    (case, hyphens, braces), against the forms an operation may have kept it in:
    the fence keeps the entity id as the caller gave it (`str(uuid)` or `.hex`,
    either case).
    """
    term = term.strip()
    ids: dict[type[Model], list[str]] = {}
    if 0 < len(term) <= ENTITY_KEY_LENGTH:
        ids.update({m: [term] for m in keyed_by("text")})
    try:
        value = uuid.UUID(term)
    except ValueError:
        value = None
    if value is not None:
        forms = [str(value), value.hex]
        ids.update({m: forms + [f.upper() for f in forms] for m in keyed_by("uuid")})
    return _of_entities(ids) if ids else None


def entity_words(models: list[type[Model]]) -> str:
    """The entities' names in the desk's words: "order", "order or booking"."""
    return " or ".join(str(m._meta.verbose_name) for m in models) or "entity"


def with_article(words: str) -> str:
    """ "an order", "a booking"."""
    return f"{'an' if words[:1].lower() in 'aeiou' else 'a'} {words}"


def operations_search_help() -> str:
    """The operations search box's help, in the words of the entities the handlers declare:
    "Order id (17), ..." with the shop's checkout, "Reservation id (17), ..." without it."""
    keyed = keyed_by_integer()
    terms = [f"{entity_words(keyed)} id (17)"] if keyed else []
    by_text, by_uuid = keyed_by("text"), keyed_by("uuid")
    terms += [f"{entity_words(by_text)} key (exact)"] if by_text else []
    terms += [f"{entity_words(by_uuid)} UUID (any form)"] if by_uuid else []
    terms += [
        "operation id (#17)",
        "operation key",
        "a reference as the provider's or another system's dashboard shows it",
        "idempotency key (fence_…)",
    ]
    # Which entities an e-mail finds depends on what the operator may view: not named here.
    if any(email_fields(model) for model in entity_models()):
        terms.append("an e-mail (exact)")
    text = ", ".join(terms[:-1]) + f" or {terms[-1]}."
    return text[:1].upper() + text[1:]


def email_fields(model: type[Model]) -> list[str]:
    """The e-mail fields of an entity model the desk's e-mail search reads: those with an
    index on LOWER(field) (`models.Index(Lower("email"), ...)` in its Meta), so that a
    search never scans the entity's table. Others are not searched."""
    indexed = {
        expression.source_expressions[0].name
        for index in model._meta.indexes
        for expression in index.expressions
        if isinstance(expression, Lower) and isinstance(expression.source_expressions[0], F)
    }
    return [
        f.name
        for f in model._meta.concrete_fields
        if isinstance(f, EmailField) and f.name in indexed
    ]


def entities_with_email(model: type[Model], term: str, limit: int = 100) -> list[str]:
    """The keys (as entity ids) of `model`'s rows whose e-mail is `term`, any case: the
    comparison is on LOWER(field), which an index on it serves (the shop's orders have one)."""
    match = Q()
    rows = model._default_manager.all()
    for i, name in enumerate(email_fields(model)):
        rows = rows.annotate(**{f"email_lower_{i}": Lower(name)})
        match |= Q(**{f"email_lower_{i}": term.strip().lower()})
    return [str(pk) for pk in rows.filter(match).values_list("pk", flat=True)[:limit]]


def _of_entities(ids: dict[type[Model], list[str]]) -> Q:
    """Operations of these entities (by model, their ids), through the entity index."""
    found = Q(pk__in=[])
    for model, keys in ids.items():
        if keys:
            found |= Q(entity_type=model._meta.model_name, entity_id__in=keys)
    return found


def operations_search_note(term: str, changelist_url: str) -> str:
    """What a number search matched, for the note above the list ("" for other terms).

    A bare number lists its entity's operations (an order's); when an operation
    of another entity has that id, the note names it and links its `#id` search (one
    primary-key read).
    """
    term = term.strip()
    op_id = operation_id_in(term)
    if op_id is not None:
        return format_html(
            "Operation #{} (by its id). Operations of {} {}: search {}.",
            op_id, entity_words(keyed_by_integer()), op_id,
            search_link(changelist_url, str(op_id)),
        )  # fmt: skip
    if not DIGITS.match(term):
        return ""
    # Digits are an integer key, and a text key of digits (as search_operations reads them).
    words = entity_words(keyed_by("integer", "text"))
    listed = _of_entities({m: [term] for m in keyed_by_integer()})
    keyed = entities_keyed(term)
    other = (
        Operation.objects.filter(pk=int(term))
        .exclude(listed | keyed if keyed is not None else listed)
        .values_list("key", "entity_type", "entity_id")
        .first()
    )
    if other is None:
        return format_html(
            "Operations of {} {}. A number is {} id; #{} finds an operation by its id.",
            words, term, with_article(words), term,
        )  # fmt: skip
    key, entity_type, entity_id = other
    return format_html(
        "Operations of {} {}. Operation #{} ({}, of {} {}) is not one of them: search {}.",
        words, term, term, key, entity_type, entity_id,
        search_link(changelist_url, f"#{term}"),
    )  # fmt: skip


def search_link(changelist_url: str, term: str) -> str:
    url = f"{changelist_url}?{urlencode({'q': term})}"
    return format_html('<a class="desk-search-link" href="{}">{}</a>', url, term)
