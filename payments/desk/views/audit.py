"""The last fence audit's summary as tables, with links to operations, orders and references.

An audit is a snapshot; the fence moves on. Each finding is shown with what the fence
holds of it now (`_FindingsNow`): settled since the audit, or still open; only the open
ones are red, and a line counts those settled until the next audit confirms it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.timesince import timesince

from payments.desk.display import entity_model, entity_named, reference_link, when
from payments.models import ClaimState, FenceAuditRun, Operation, StepClaim

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
    # Shown as "Refunded in full" (the references) under Other; the order page marks the
    # entities' duplicates (payments.desk.views.payment.audit_duplicates).
    "refunded_in_full_count",
    "refunded_in_full_entities",
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

    def where(reference: str) -> str:
        place = str(steps.get(reference) or "")
        if not place or "/" not in place:
            return place or "-"
        key, step = place.rsplit("/", 1)
        return format_html("{} / {}", links.link(key), step)

    def entity(item: dict[str, Any]) -> str:
        kind, pk = str(item.get("entity_type") or ""), str(item.get("entity_id") or "")
        model = entity_model(kind)
        if model is not None and pk:
            return entity_named(model, pk, admin.site, request.user, css_class="desk-entity")
        return f"{kind} {pk}".strip() or "-"

    def references(refs: Any) -> str:
        return format_html_join(", ", "{}", ((reference_link(str(r)),) for r in _listed(refs)))

    def operations(ops: Any) -> str:
        keys = [_key_of(o) for o in _listed(ops)]
        return format_html_join(", ", "{}", ((links.link(k),) for k in keys if k))

    now = _FindingsNow(summary, steps, links)
    double = [
        {"operation": links.link(str(d.get("operation_key") or "")), "step": d.get("step", ""),
         "references": references(d.get("references")), "now": DOUBLE_CHARGE}
        for d in _listed(summary.get("double_charges")) if isinstance(d, dict)
    ]  # fmt: skip
    entities = [
        {"entity": entity(d), "references": references(d.get("references")),
         "operations": operations(d.get("operations")), "now": DOUBLE_CHARGE}
        for d in _listed(summary.get("double_charged_entities")) if isinstance(d, dict)
    ]  # fmt: skip
    unfenced = [
        {"reference": reference_link(str(r)), "where": where(str(r)), "now": now.unfenced(str(r))}
        for r in _listed(summary.get("unfenced"))
    ]
    unknown = [
        {"reference": reference_link(str(r)), "where": where(str(r)), "now": now.unknown(str(r))}
        for r in _listed(summary.get("unknown_references"))
    ]
    stale = []
    for item in _listed(summary.get("stale_uncertain")):
        key, _, step = str(item).rpartition("/")
        stale.append(
            {"operation": links.link(key or str(item)), "step": step if key else "-",
             "now": now.stale(str(item))}
        )  # fmt: skip
    # "counts" is shown as each table's total; the rest is a figure or a table of its own.
    known = {name for name, _ in AUDIT_FIGURES} | set(AUDIT_TABLES) | {"counts"}
    tables = [
        _with_now(table) for table in _tables(summary, double, entities, unfenced, unknown, stale)
    ]
    refunds = _refunds_now(summary.get("refunds"), now)
    found = _findings(summary, tables, refunds)
    settled = sum(t["settled"] for t in tables) + refunds["settled"]
    return {
        "clean": summary.get("clean"),
        "finished": when(run.finished_at),
        "finished_ago": timesince(run.finished_at, timezone.now()),
        "window_start": when(run.window_start),
        "figures": [(label, summary.get(name, "-")) for name, label in AUDIT_FIGURES],
        "tables": tables,
        "refunds": refunds,
        # Findings the audit counted and what the fence settled of them since (listed ones).
        "findings": found,
        "settled": settled,
        "open": max(found - settled, 0),
        "other": [
            (name.replace("_", " ").capitalize(), _plain(value))
            for name, value in sorted(summary.items())
            if name not in known and name != "not_audited"
        ],
        # The systems this audit did not judge, each in its own words, and why.
        "not_audited": [
            (str(item.get("label") or item.get("system") or "?"), str(item.get("why") or ""))
            for item in _listed(summary.get("not_audited"))
            if isinstance(item, dict)
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
            "columns": ("Operation", "Step", "References", "Now"),
            "rows": [(d["operation"], d["step"], d["references"], d["now"]) for d in double],
            "total": _total(summary, "double_charges"),
        },
        {
            "id": "audit-double-charged-entities",
            "title": "Double charges per order",
            "columns": ("Order", "References", "Operations", "Now"),
            "rows": [(d["entity"], d["references"], d["operations"], d["now"]) for d in entities],
            "total": _total(summary, "double_charged_entities"),
            "absent": "double_charged_entities" not in summary,
        },
        {
            "id": "audit-unfenced",
            "title": "Provider successes without a done claim (unfenced)",
            "columns": ("Reference", "Operation / step (from the provider's metadata)", "Now"),
            "rows": [(u["reference"], u["where"], u["now"]) for u in unfenced],
            "total": _total(summary, "unfenced"),
        },
        {
            "id": "audit-unknown",
            "title": "Done claims the provider does not show succeeded",
            "columns": ("Reference", "Operation / step", "Now"),
            "rows": [(u["reference"], u["where"], u["now"]) for u in unknown],
            "total": _total(summary, "unknown_references"),
        },
        {
            "id": "audit-stale",
            "title": "Uncertain past the grace period",
            "columns": ("Operation", "Step", "Now"),
            "rows": [(u["operation"], u["step"], u["now"]) for u in stale],
            "total": _total(summary, "stale_uncertain"),
        },
    ]  # fmt: skip


# --- what each finding is now -------------------------------------------------------------


@dataclass(frozen=True)
class Now:
    """What the fence holds now of one finding: settled since the audit, or still open."""

    settled: bool
    words: str

    def __str__(self) -> str:
        label = "Settled since" if self.settled else "Open"
        return format_html('<span class="desk-audit-now">{}: {}</span>', label, self.words)


#: The desk cannot tell a double charge is settled (the provider still shows both charges
#: succeeded; their refunds are its lists'): it stays open, with its next step, until an
#: audit finds the extra charge refunded in full (payments.observability.audit_window).
DOUBLE_CHARGE = Now(
    False,
    "refund the extra charge from the order's page, then run fence_audit again with --since "
    "reaching back to the charge",
)


class _FindingsNow:
    """What the fence holds now of the audit's findings: a few indexed reads for all of them."""

    def __init__(self, summary: dict[str, Any], steps: dict[str, Any], links: _OperationLinks):
        raw_refunds = summary.get("refunds")
        refunds: dict[str, Any] = raw_refunds if isinstance(raw_refunds, dict) else {}
        refs = {
            str(r)
            for kind in ("unfenced", "unknown_references")
            for r in (*_listed(summary.get(kind)), *_listed(refunds.get(kind)))
        }
        #: reference -> "operation key/step" of the done claim carrying it now.
        self.carried: dict[str, str] = {
            str(ref): f"{key}/{step}"
            for ref, key, step in StepClaim.objects.filter(
                state=ClaimState.DONE, provider_reference__in=refs
            )
            .exclude(provider_reference="")  # the partial index, whatever the list's length
            .values_list("provider_reference", "operation__key", "step")
        }
        # A step may keep the object the audit counts in its result (a capture: its intent):
        # the done claims of the operations the provider's metadata names.
        named = [
            pk
            for ref in refs
            for pk in links.pks.get(str(steps.get(ref) or "").rpartition("/")[0], [])
        ]
        claims = StepClaim.objects.filter(operation_id__in=named, state=ClaimState.DONE)
        for key, step, result in claims.values_list("operation__key", "step", "result"):
            for value in result.values() if isinstance(result, dict) else ():
                if isinstance(value, str) and value in refs:
                    self.carried.setdefault(value, f"{key}/{step}")
        stale = [str(item).rpartition("/") for item in _listed(summary.get("stale_uncertain"))]
        pks = [pk for key, _, _ in stale for pk in links.pks.get(key, [])]
        #: (operation key, step) -> the states of its claims now (a key may be in two scopes).
        self.states: dict[tuple[str, str], list[str]] = defaultdict(list)
        rows = StepClaim.objects.filter(operation_id__in=pks, step__in={s for _, _, s in stale})
        for key, step, state in rows.values_list("operation__key", "step", "state"):
            self.states[(key, step)].append(state)

    def stale(self, item: str) -> Now:
        """An uncertain claim past the grace: settled once no claim of its step is uncertain."""
        key, _, step = item.rpartition("/")
        states = self.states.get((key, step))
        if not states:
            return Now(False, "no such step now")
        if ClaimState.UNCERTAIN in states:
            return Now(False, "still uncertain")
        if ClaimState.CLAIMED in states:  # someone works on it now: not settled yet
            return Now(False, "claimed, being settled now")
        return Now(True, " / ".join(sorted({ClaimState(s).label for s in states})))

    def unfenced(self, reference: str) -> Now:
        """A provider success no done claim carried: settled once one carries it."""
        where = self.carried.get(reference)
        if where is None:
            return Now(False, "no done claim carries it yet")
        return Now(True, f"carried by {where}")

    def unknown(self, reference: str) -> Now:
        """A done claim the provider did not show succeeded: open while a done claim has it."""
        where = self.carried.get(reference)
        if where is not None:
            return Now(False, f"{where} is still done with it")
        return Now(True, "no done claim carries it now")


def _with_now(table: dict[str, Any]) -> dict[str, Any]:
    """A finding table with its rows' cells, each row settled or open, and its open count."""
    body = [
        {"cells": list(zip(table["columns"], row, strict=True)), "settled": row[-1].settled}
        for row in table["rows"]
    ]
    settled = sum(1 for row in body if row["settled"])
    # Findings the audit counted but did not list are not known settled: still open.
    return {**table, "body": body, "settled": settled, "open": max(table["total"] - settled, 0)}


def _refunds_now(found: Any, now: _FindingsNow) -> dict[str, Any]:
    """The refund audit's references, each with what the fence holds of it now."""
    if not isinstance(found, dict):
        return {"unfenced": [], "unknown": [], "settled": 0, "open": 0, "findings": 0}
    unfenced = [
        (reference_link(str(r)), now.unfenced(str(r))) for r in _listed(found.get("unfenced"))
    ]
    unknown = [
        (reference_link(str(r)), now.unknown(str(r)))
        for r in _listed(found.get("unknown_references"))
    ]
    settled = sum(1 for _, state in (*unfenced, *unknown) if state.settled)
    findings = found.get("findings")
    total = findings if isinstance(findings, int) else len(unfenced) + len(unknown)
    return {
        "unfenced": unfenced,
        "unknown": unknown,
        "settled": settled,
        "open": max(total - settled, 0),
        "findings": total,
    }


def _findings(
    summary: dict[str, Any], tables: list[dict[str, Any]], refunds: dict[str, Any]
) -> int:
    """How many findings the audit counted: its own figure, else its tables' totals."""
    findings = summary.get("findings")
    charges = findings if isinstance(findings, int) else sum(t["total"] for t in tables)
    return charges + int(refunds["findings"])


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
