"""The last fence audit's summary as tables, with links to operations, orders and references."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.timesince import timesince

from payments.desk.display import reference_link, when
from payments.models import FenceAuditRun, Operation

# --- the last fence audit, as tables ------------------------------------------------------

#: Summary keys shown as figures, in this order (anything else appears under "Other").
AUDIT_FIGURES = (
    ("findings", "Findings"),
    ("provider_successes", "Provider successes"),
    ("done_claims", "Done claims"),
)
AUDIT_TABLES = (
    "window_start",
    "double_charges",
    "double_charged_entities",
    "unfenced",
    "unknown_references",
    "stale_uncertain",
    "steps",
    "clean",
)
#: At most this many rows per finding table (the command's output has them all).
AUDIT_ROWS = 50
#: What the audit names a charge by when no operation made it (payments.observability.audit).
OUTSIDE_THE_FENCE = "(outside the fence)"
#: A time as the audit stores it (ISO 8601: its checkpoint, ...).
ISO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d")


def audit_view(run: FenceAuditRun | None, request: HttpRequest) -> dict[str, Any] | None:
    """The last fence audit's summary as tables, with links to operations, orders and references."""
    if run is None:
        return None
    summary = run.summary if isinstance(run.summary, dict) else {}
    raw_steps = summary.get("steps")
    steps: dict[str, Any] = raw_steps if isinstance(raw_steps, dict) else {}
    links = _OperationLinks(summary, steps)
    may_view_orders = request.user.has_perm("payments.view_order")

    def where(reference: str) -> str:
        place = str(steps.get(reference) or "")
        if not place or "/" not in place:
            return place or "-"
        key, step = place.rsplit("/", 1)
        return format_html("{} / {}", links.link(key), step)

    def entity(item: dict[str, Any]) -> str:
        kind, pk = str(item.get("entity_type") or ""), str(item.get("entity_id") or "")
        if kind == "order" and pk and may_view_orders:
            url = reverse("admin:payments_order_change", args=[pk])
            return format_html('<a class="desk-entity" href="{}">Order {}</a>', url, pk)
        return f"{kind} {pk}".strip() or "-"

    def references(refs: Any) -> str:
        return format_html_join(", ", "{}", ((reference_link(str(r)),) for r in _listed(refs)))

    def operations(ops: Any) -> str:
        keys = [_key_of(o) for o in _listed(ops)]
        return format_html_join(", ", "{}", ((links.link(k),) for k in keys if k))

    double = [
        {"operation": links.link(str(d.get("operation_key") or "")), "step": d.get("step", ""),
         "references": references(d.get("references"))}
        for d in _listed(summary.get("double_charges")) if isinstance(d, dict)
    ]  # fmt: skip
    entities = [
        {"entity": entity(d), "references": references(d.get("references")),
         "operations": operations(d.get("operations"))}
        for d in _listed(summary.get("double_charged_entities")) if isinstance(d, dict)
    ]  # fmt: skip
    unfenced = [
        {"reference": reference_link(str(r)), "where": where(str(r))}
        for r in _listed(summary.get("unfenced"))
    ]
    unknown = [
        {"reference": reference_link(str(r)), "where": where(str(r))}
        for r in _listed(summary.get("unknown_references"))
    ]
    stale = []
    for item in _listed(summary.get("stale_uncertain")):
        key, _, step = str(item).rpartition("/")
        stale.append({"operation": links.link(key or str(item)), "step": step if key else "-"})
    # "counts" is shown as each table's total; the rest is a figure or a table of its own.
    known = {name for name, _ in AUDIT_FIGURES} | set(AUDIT_TABLES) | {"counts"}
    tables = [
        {**table, "cells": [list(zip(table["columns"], row, strict=True)) for row in table["rows"]]}
        for table in _tables(summary, double, entities, unfenced, unknown, stale)
    ]
    return {
        "clean": summary.get("clean"),
        "finished": when(run.finished_at),
        "finished_ago": timesince(run.finished_at, timezone.now()),
        "window_start": when(run.window_start),
        "figures": [(label, summary.get(name, "-")) for name, label in AUDIT_FIGURES],
        "tables": tables,
        "other": [
            (name.replace("_", " ").capitalize(), _plain(value))
            for name, value in sorted(summary.items())
            if name not in known
        ],
    }


def _tables(
    summary: dict[str, Any],
    double: list[dict[str, Any]],
    entities: list[dict[str, Any]],
    unfenced: list[dict[str, Any]],
    unknown: list[dict[str, Any]],
    stale: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The audit's findings, one table each: its columns, rows and total."""
    return [
        {
            "id": "audit-double-charges",
            "title": "Double charges per step",
            "columns": ("Operation", "Step", "References"),
            "rows": [(d["operation"], d["step"], d["references"]) for d in double],
            "total": _total(summary, "double_charges"),
        },
        {
            "id": "audit-double-charged-entities",
            "title": "Double charges per order",
            "columns": ("Order", "References", "Operations"),
            "rows": [(d["entity"], d["references"], d["operations"]) for d in entities],
            "total": _total(summary, "double_charged_entities"),
            "absent": "double_charged_entities" not in summary,
        },
        {
            "id": "audit-unfenced",
            "title": "Provider successes without a done claim (unfenced)",
            "columns": ("Reference", "Operation / step (from the provider's metadata)"),
            "rows": [(u["reference"], u["where"]) for u in unfenced],
            "total": _total(summary, "unfenced"),
        },
        {
            "id": "audit-unknown",
            "title": "Done claims the provider does not show succeeded",
            "columns": ("Reference", "Operation / step"),
            "rows": [(u["reference"], u["where"]) for u in unknown],
            "total": _total(summary, "unknown_references"),
        },
        {
            "id": "audit-stale",
            "title": "Uncertain past the grace period",
            "columns": ("Operation", "Step"),
            "rows": [(u["operation"], u["step"]) for u in stale],
            "total": _total(summary, "stale_uncertain"),
        },
    ]  # fmt: skip


def _listed(value: Any) -> list[Any]:
    return list(value)[:AUDIT_ROWS] if isinstance(value, list | tuple) else []


def _total(summary: dict[str, Any], kind: str) -> int:
    """How many findings of `kind` the audit counted (it stores only the first ones)."""
    counts = summary.get("counts")
    if isinstance(counts, dict) and isinstance(counts.get(kind), int):
        return int(counts[kind])
    return _count(summary.get(kind))


def _count(value: Any) -> int:
    return len(value) if isinstance(value, list | tuple) else 0


def _key_of(item: Any) -> str:
    if isinstance(item, dict):
        return str(item.get("operation_key") or item.get("key") or "")
    return str(item)


def _plain(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or "-"
    if isinstance(value, dict):  # a figure per name (the audit's checkpoint, ...)
        return ", ".join(f"{k.replace('_', ' ')}: {_plain(v)}" for k, v in value.items()) or "-"
    if value is None or value == "":
        return "-"
    if isinstance(value, str) and ISO_TIME.match(value):  # a time, read as the desk reads times
        return when(value)
    return str(value)


class _OperationLinks:
    """Links to the operations an audit names by key (one query for all of them)."""

    def __init__(self, summary: dict[str, Any], steps: dict[str, Any]) -> None:
        keys: set[str] = set()
        for item in _listed(summary.get("double_charges")):
            if isinstance(item, dict):
                keys.add(str(item.get("operation_key") or ""))
        for item in _listed(summary.get("double_charged_entities")):
            if isinstance(item, dict):
                keys.update(_key_of(o) for o in _listed(item.get("operations")))
        keys.update(str(v).rpartition("/")[0] for v in _listed(summary.get("stale_uncertain")))
        keys.update(str(v).rpartition("/")[0] for v in steps.values())
        keys.discard("")
        found: dict[str, list[int]] = defaultdict(list)
        for key, pk in Operation.objects.filter(key__in=keys).values_list("key", "pk"):
            found[key].append(pk)
        self.pks = dict(found)
        self.changelist = reverse("admin:payments_operation_changelist")

    def link(self, key: str) -> str:
        if not key:
            return "-"
        if key == OUTSIDE_THE_FENCE:  # the audit's words for a charge no operation made
            return format_html('<em class="desk-outside">{}</em>', key)
        pks = self.pks.get(key, [])
        if len(pks) == 1:
            url = reverse("admin:payments_operation_change", args=[pks[0]])
        elif pks:  # the same key in two scopes: let the list show both
            url = f"{self.changelist}?{urlencode({'q': key, 'followups': 'all'})}"
        else:
            return format_html("<code>{}</code> <small>(no such operation)</small>", key)
        return format_html('<a href="{}">{}</a>', url, key)
