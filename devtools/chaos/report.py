"""Render a chaos run: a text table, a JSON file and a one-page HTML report with charts."""

from __future__ import annotations

import json
from dataclasses import asdict
from html import escape
from pathlib import Path
from typing import cast

from devtools.chaos.ha import timeline_html
from devtools.chaos.incident import IncidentFigures
from devtools.chaos.run import ChaosResult
from devtools.chaos.webhooks import (
    ANSWER_LATE,
    ANSWER_LOST,
    CAUSES,
    LATENCY_KEY,
    OWNER_KILLED,
    SETTLER_ORDER,
)

ROWS = [
    ("orders", "orders"),
    ("orders paid (refunded ones included)", "orders_paid"),
    ("orders declined or failed", "orders_declined_or_failed"),
    ("provider successes", "provider_successes"),
    ("charge claims done", "charge_claims_done"),
    ("double charges", "double_charges"),
    ("orders shown failed but charged", "charged_but_failed_orders"),
    ("live payment intents per order (at most)", "live_payment_intents_per_order_max"),
    ("reckless operator's presses", "reckless_line"),
    ("  new attempts it started", "new_attempts_started"),
    ("provider successes without a done claim", "provider_successes_without_claim"),
    ("  of them never claimed", "provider_successes_never_claimed"),
    ("paid orders with exactly one invoice", "paid_orders_with_one_invoice"),
    ("paid orders with exactly one ledger line", "paid_orders_with_one_ledger_line"),
    ("uncertain outcomes", "uncertain_outcomes"),
    ("  settled automatically", "uncertain_settled_automatically"),
    ("  settled by an operator", "uncertain_settled_by_an_operator"),
    ("  left for review", "uncertain_left_for_review"),
    ("captures asked (authorise, then capture part or all)", "captures"),
    ("  captured", "captures_succeeded"),
    ("  orders captured twice", "double_captures"),
    ("  holds left on failed captures", "holds_left_after_failure"),
    ("refunds asked", "refunds_asked"),
    ("refunds refused by the API", "refunds_refused_by_api"),
    ("refunds succeeded", "refunds_succeeded"),
    ("provider refunds", "provider_refunds"),
    ("refund claims done", "refund_claims_done"),
    ("double refunds", "double_refunds"),
    ("over-refunds", "over_refunds"),
    ("provider refunds without a done claim", "refunds_without_claim"),
    ("  of them never claimed", "refunds_never_claimed"),
    ("credit notes", "credit_notes"),
    ("orders refunded", "orders_refunded"),
    ("orders partially refunded", "orders_partially_refunded"),
    ("orders with refunds", "orders_with_refunds"),
    ("  matching their refunded amount", "orders_with_refunds_matching"),
    ("uncertain refund outcomes", "refund_uncertain_outcomes"),
    ("  settled automatically", "refunds_settled_automatically"),
    ("workers SIGKILLed", "workers_killed"),
    ("Redis flushed", "redis_flushed"),
    ("time to drain (s)", "drain_seconds"),
]

#: Who settled an outcome its worker did not record, as the report names them.
SETTLER_LABELS = {
    "provider_event": "a provider event (webhook)",
    "catch_up": "the catch-up (sync_provider_events)",
    "reconciler": "the reconciler",
    "worker_replay": "a worker's same-key replay",
    "all": "any of them",
}

#: Provider success -> operation settled, for outcomes no worker had from its own answer.
CAUSE_LABELS = {
    ANSWER_LOST: "success -> settled (s), answer lost (dropped, 500)",
    ANSWER_LATE: "success -> settled (s), answer after the read timeout",
    OWNER_KILLED: "success -> settled (s), worker killed in its call",
}

WEBHOOK_ROWS = [
    ("webhook events sent by the provider", "webhook_events"),
    ("  deliveries answered 2xx", "webhook_deliveries"),
    ("  attempts failed (retried)", "webhook_failed_attempts"),
    ("  duplicated / reordered / delayed", "webhook_faults"),
    ("  given up", "webhook_gave_up"),
    ("endpoint down (s)", "webhook_endpoint_outages_seconds"),
    ("catch-up after the outage", "webhook_catch_up"),
]

STATE_COLOURS = {
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "needs_review": "#ef6c00",
    "uncertain": "#f9a825",
    "retrying": "#1565c0",
    "running": "#6a1b9a",
    "pending": "#757575",
}


def table(result: ChaosResult) -> list[str]:
    """Return the report as aligned text lines."""
    r = result.report
    rows: list[tuple[str, object]] = [
        ("checkout operations by state", _states(_by_state(r, "operations_by_state"))),
        ("refund operations by state", _states(_by_state(r, "refund_operations_by_state"))),
    ]
    shown = _shown(r)
    rows += [(label, shown.get(key, "-")) for label, key in ROWS]
    rows += adyen_rows(r)
    rows += export_rows(r)
    rows += webhook_rows(r)
    rows += incident_rows(r)
    rows += latency_rows(r)
    width = max(len(label) for label, _ in rows)
    return [f"  {label:<{width}}  {value}" for label, value in rows]


def _shown(r: dict[str, object]) -> dict[str, object]:
    """The report's figures, with the reckless operator's presses as one line."""
    presses = r.get("reckless_presses") or {}
    assert isinstance(presses, dict)
    line = ", ".join(f"{k} {n}" for k, n in sorted(presses.items())) or "none"
    return {**r, "reckless_line": line}


EXPORT_ROWS = [
    ("invoice exports (the accounting system)", "export_operations"),
    ("  by state", "states"),
    ("  faults at the accounting system", "export_faults"),
    ("  same-key replays it answered", "export_replays"),
    ("  invoices at the accounting system", "invoices_at_accounting"),
    ("  double invoices", "double_invoices"),
    ("  invoices outside the fence", "invoices_outside_the_fence"),
    ("  paid orders exported exactly once", "paid_orders_exported_once"),
]


ADYEN_ROWS = [
    ("orders through the Adyen shop", "orders"),
    ("  payments Adyen authorised", "adyen_payments_authorised"),
    ("  of them taken (not cancelled since)", "adyen_payments_taken"),
    ("  orders charged twice at Adyen", "adyen_double_charges"),
    ("  Adyen payments outside the fence", "adyen_payments_outside_the_fence"),
    ("  Adyen refunds", "adyen_refunds"),
    ("  refund steps refunded twice at Adyen", "adyen_double_refunds"),
    ("  Adyen payments refunded more than charged", "adyen_over_refunds"),
    ("  Adyen payments captured twice", "adyen_double_captures"),
    ("  faults at Adyen", "adyen_faults"),
    ("  same-key replays Adyen answered", "adyen_replays"),
    ("  notification items / accepted", "notifications_line"),
]


def adyen_rows(r: dict[str, object]) -> list[tuple[str, object]]:
    """The Adyen shop's figures (devtools.chaos.adyen), or "off"."""
    adyen = r.get("adyen")
    if not isinstance(adyen, dict):
        return [("orders through Adyen", "off")]
    sent = adyen.get("adyen_notifications") or {}
    line = (
        f"{sent.get('items', '-')} / {sent.get('accepted', '-')}" if isinstance(sent, dict) else "-"
    )
    values = {**adyen, "notifications_line": line}
    return [(label, values.get(key)) for label, key in ADYEN_ROWS]


def export_rows(r: dict[str, object]) -> list[tuple[str, object]]:
    """The invoice export's figures (devtools.chaos.export), or "off"."""
    export = r.get("export")
    if not isinstance(export, dict):
        return [("invoice export", "off")]
    values = {**export, "states": _states(cast(dict[str, int], export["export_by_state"]))}
    return [(label, values.get(key)) for label, key in EXPORT_ROWS]


def webhook_rows(r: dict[str, object]) -> list[tuple[str, object]]:
    """The provider events' figures: what the fake sent, its faults, the outage."""
    if not r.get("webhooks"):
        return [("webhooks", "off")]
    values = dict(r)
    values["webhook_faults"] = (
        f"{r.get('webhook_duplicated')} / {r.get('webhook_reordered')} / {r.get('webhook_delayed')}"
    )
    return [(label, values.get(key)) for label, key in WEBHOOK_ROWS]


def incident_rows(r: dict[str, object]) -> list[tuple[str, object]]:
    """The provider incident's lines (devtools.chaos.incident), or "off"."""
    found = r.get("incident")
    if not isinstance(found, dict):
        return [("provider incident", "off")]
    return IncidentFigures(**found).rows()


def latency_rows(r: dict[str, object]) -> list[tuple[str, object]]:
    """Provider success to operation settled, for outcomes no worker had from its own
    answer: p50, p95 and the count, by cause, then by who settled the claim."""
    figures = r.get(LATENCY_KEY)
    if not isinstance(figures, dict):
        return []
    rows: list[tuple[str, object]] = []
    for cause in CAUSES:
        rows.append((CAUSE_LABELS[cause], ""))
        for name in (*SETTLER_ORDER, "all"):
            rows.append((f"  settled by {SETTLER_LABELS[name]}", _latency(figures[cause][name])))
    return rows


def _latency(summary: dict[str, object]) -> str:
    if not summary["count"]:
        return "none"
    return f"p50 {summary['p50']:.2f} s, p95 {summary['p95']:.2f} s, n {summary['count']}"


def _count(r: dict[str, object], key: str) -> int:
    """The report's figure `key`, one of the counts chaos._measure puts there."""
    return cast(int, r[key])


def _by_state(r: dict[str, object], key: str) -> dict[str, int]:
    """The report's operations by state under `key` (chaos._measure counts them by state)."""
    return cast("dict[str, int]", r[key])


def _states(counts: dict[str, int]) -> str:
    return ", ".join(f"{s} {n}" for s, n in sorted(counts.items())) or "none"


def write_files(result: ChaosResult, directory: Path) -> tuple[Path, Path]:
    """Write report.json and report.html into `directory`; return both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "run_id": result.run_id,
        "config": asdict(result.config),
        "violations": result.violations,
        **result.report,
    }
    json_path = directory / "report.json"
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    html_path = directory / "report.html"
    html_path.write_text(_html(result))
    return json_path, html_path


def _bars(items: list[tuple[str, int, str]], width: int = 520) -> str:
    """Return an inline SVG horizontal bar chart of (label, value, colour)."""
    top = max((v for _, v, _ in items), default=1) or 1
    row = 28
    # 230 px of labels, the bars, then room for the value after the longest bar.
    parts = [f'<svg width="{230 + width + 80}" height="{row * len(items) + 10}" role="img">']
    for i, (label, value, colour) in enumerate(items):
        y = i * row + 5
        w = max(2, int(width * value / top)) if value else 0
        parts.append(
            f'<text x="0" y="{y + 17}" font-size="14">{escape(label)}</text>'
            f'<rect x="230" y="{y}" width="{w}" height="22" fill="{colour}"/>'
            f'<text x="{236 + w}" y="{y + 17}" font-size="14">{value}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _html(result: ChaosResult) -> str:
    r = result.report
    ok = not result.violations
    verdict = (
        "No double charge, no double refund, nothing lost."
        if ok
        else "Invariant violated: " + "; ".join(result.violations)
    )
    states = sorted(_by_state(r, "operations_by_state").items(), key=lambda kv: -kv[1])
    refund_states = sorted(
        _by_state(r, "refund_operations_by_state").items(), key=lambda kv: -kv[1]
    )
    state_chart = _bars(
        [(f"checkout {s}", n, STATE_COLOURS.get(s, "#999")) for s, n in states]
        + [(f"refund {s}", n, STATE_COLOURS.get(s, "#999")) for s, n in refund_states]
    )
    invariant_chart = _bars(
        [
            ("orders paid", _count(r, "orders_paid"), "#2e7d32"),
            ("provider successes", _count(r, "provider_successes"), "#1565c0"),
            ("charge claims done", _count(r, "charge_claims_done"), "#6a1b9a"),
            ("double charges", _count(r, "double_charges"), "#c62828"),
            ("unfenced charges", _count(r, "provider_successes_without_claim"), "#c62828"),
        ]
    )
    refund_chart = _bars(
        [
            ("refunds asked", _count(r, "refunds_asked"), "#1565c0"),
            ("refunds succeeded", _count(r, "refunds_succeeded"), "#2e7d32"),
            ("provider refunds", _count(r, "provider_refunds"), "#1565c0"),
            ("refund claims done", _count(r, "refund_claims_done"), "#6a1b9a"),
            ("credit notes", _count(r, "credit_notes"), "#6a1b9a"),
            ("double refunds", _count(r, "double_refunds"), "#c62828"),
            ("over-refunds", _count(r, "over_refunds"), "#c62828"),
            ("unfenced refunds", _count(r, "refunds_without_claim"), "#c62828"),
        ]
    )
    chaos_chart = _bars(
        [
            ("workers SIGKILLed", _count(r, "workers_killed"), "#424242"),
            ("uncertain charges", _count(r, "uncertain_outcomes"), "#f9a825"),
            ("settled automatically", _count(r, "uncertain_settled_automatically"), "#2e7d32"),
            ("uncertain refunds", _count(r, "refund_uncertain_outcomes"), "#f9a825"),
            ("settled automatically", _count(r, "refunds_settled_automatically"), "#2e7d32"),
        ]
    )
    cfg = result.config
    rows = "".join(
        f"<tr><td>{escape(label)}</td><td>{escape(str(value))}</td></tr>"
        for label, value in [
            ("checkout operations by state", _states(_by_state(r, "operations_by_state"))),
            ("refund operations by state", _states(_by_state(r, "refund_operations_by_state"))),
            *((label, _shown(r).get(key, "-")) for label, key in ROWS),
            *webhook_rows(r),
            *latency_rows(r),
        ]
    )
    latency = "".join(
        f"<tr><td>{escape(label)}</td><td>{escape(str(value))}</td></tr>"
        for label, value in latency_rows(r)
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Chaos run {result.run_id}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; max-width: 900px; }}
.verdict {{ padding: .8rem 1rem; border-radius: 6px; font-size: 1.2rem;
  background: {"#e8f5e9" if ok else "#ffebee"}; color: {"#1b5e20" if ok else "#b71c1c"}; }}
table {{ border-collapse: collapse; margin-top: 1rem; }}
td {{ padding: .2rem 1rem .2rem 0; border-bottom: 1px solid #eee; }}
h2 {{ margin-top: 2rem; font-size: 1.1rem; }}
</style></head><body>
<h1>Chaos run {result.run_id}</h1>
<p class="verdict">{escape(verdict)}</p>
<p>{r["orders"]} orders, {cfg.workers} workers, a worker SIGKILLed every
{cfg.kill_min}&ndash;{cfg.kill_max} s, provider faults on charges and refunds alike:
{cfg.drop_rate:.0%} accepted then dropped,
{cfg.slow_rate:.0%} answered after the client's timeout, {cfg.fail_rate:.0%} 500s,
{cfg.decline_rate:.0%} declined cards;
{cfg.refund_rate:.0%} of the orders chosen for a refund once paid, through the API, half partially
and half fully; {"Redis flushed once halfway" if r["redis_flushed"] else "no Redis flush"}; seed {cfg.seed}.
Drained in {r["drain_seconds"]} s.</p>
<h2>Where every operation ended</h2>{state_chart}
<h2>The invariant: one provider success per paid order, each with one claim</h2>{invariant_chart}
<h2>Refunds: one provider refund per refund, each with one claim and one credit note</h2>{refund_chart}
<h2>What went wrong on purpose, and what recovered</h2>{chaos_chart}
<h2>Provider success to operation settled, for outcomes no worker had from its answer</h2>
<p>Seconds from the charge or refund succeeding at the provider (the fake's clock) to the
operation's settled audit row, by cause (the answer lost at once, late, or its worker
killed in the call: each has its own floor) and by who settled the step's claim.</p>
<table>{latency}</table>
{timeline_html(r)}
<h2>All figures</h2><table>{rows}</table>
</body></html>
"""
