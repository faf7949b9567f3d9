"""How the operators' pages render states, times, money and the provider's view: one place."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.contrib.admin import AdminSite
from django.contrib.admin.utils import quote
from django.contrib.auth import get_permission_codename
from django.db.models import Model
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from payments.conf import payments_settings
from payments.engine.handlers import entity_models, get_handler, registered_handlers
from payments.exceptions import ConfigurationError
from payments.models import ClaimState, Operation, OperationState
from payments.money import format_money, money_of

#: One colour per state, for operations and claims alike. ClaimState's `failed`
#: and `uncertain` are the same values as OperationState's, with the same meaning.
#: A test asserts every state of both enums is mapped.
BADGE_COLOURS: dict[str, str] = {
    OperationState.PENDING: "#5c636a",
    OperationState.RUNNING: "#0b5ed7",
    OperationState.RETRYING: "#9a5b00",
    OperationState.SUCCEEDED: "#146c43",
    OperationState.FAILED: "#b02a37",
    OperationState.UNCERTAIN: "#6f42c1",
    # Teal: far in hue from failed's red and uncertain's purple, for colour-blind eyes too.
    OperationState.NEEDS_REVIEW: "#087990",
    ClaimState.CLAIMED: "#0b5ed7",
    ClaimState.DONE: "#146c43",
}
#: States whose age an operator watches (every unfinished one): the longer an
#: operation waits, the likelier a customer waits too.
AGED_STATES = frozenset(
    {
        OperationState.PENDING,
        OperationState.RUNNING,
        OperationState.RETRYING,
        OperationState.UNCERTAIN,
        OperationState.NEEDS_REVIEW,
    }
)
#: The colour of the "stale" badge: running, but its worker's lease ran out.
STALE_COLOUR = "#842029"

LABELS = {**dict(OperationState.choices), **dict(ClaimState.choices)}

_BADGE_STYLE = "color:#fff;padding:2px 8px;border-radius:10px;font-weight:600;white-space:nowrap"


def state_badge(state: str) -> str:
    """Render a state as a coloured badge (white text; every colour passes WCAG AA)."""
    if not state:
        return "-"
    return format_html(
        '<span class="state-badge state-{}" style="background:{};{}">{}</span>',
        state,
        BADGE_COLOURS.get(state, "#000"),
        _BADGE_STYLE,
        LABELS.get(state, state),
    )


def is_stale(op: Any, now: datetime | None = None) -> bool:
    """Tell whether a running operation's lease has run out (its worker died or hangs)."""
    expires = getattr(op, "lease_expires_at", None)
    return (
        getattr(op, "state", None) == OperationState.RUNNING
        and expires is not None
        and expires < (now or timezone.now())
    )


def stale_badge(op: Any, now: datetime | None = None) -> str:
    """The "stale" badge of a running operation whose lease expired; "" otherwise."""
    if not is_stale(op, now):
        return ""
    return format_html(
        '<span class="desk-stale-badge" title="lease of {} expired at {}" '
        'style="background:{};{}">stale</span>',
        op.lease_owner or "its worker",
        when(op.lease_expires_at),
        STALE_COLOUR,
        _BADGE_STYLE,
    )


def money_line(op: Operation) -> str:
    """The money at stake in the handler's own words ("€6.00 refund of order 3").

    Each handler says what its operations do with the money (`DeskHooks.describe`):
    the desk never words a refund as a charge. A kind without desk hooks (or
    without a handler) shows its amount alone.
    """
    try:
        hooks = get_handler(op.kind).desk
    except ConfigurationError:
        hooks = None
    return hooks.describe(op) if hooks is not None else money_of(op.params)


def entity_link(op: Operation, site: AdminSite, user: Any = None) -> str:
    """The operation's entity in its handler's words (the model's verbose name), linked to
    its admin page when the model has one (and `user`, if given, may view it): "Order 42",
    "Booking 7d1c…". An entity of no handler's model: its stored type and key."""
    spec = registered_handlers().get(op.kind)
    model = spec.entity if spec is not None else None
    if model is None or model._meta.model_name != op.entity_type:
        return f"{op.entity_type} {op.entity_id}"
    return entity_named(model, op.entity_id, site, user)


def entity_model(entity_type: str) -> type[Model] | None:
    """The entity model a handler declares under this name (an operation's entity_type)."""
    return next((m for m in entity_models() if m._meta.model_name == entity_type), None)


def entity_named(
    model: type[Model], entity_id: str, site: AdminSite, user: Any = None, css_class: str = ""
) -> str:
    """An entity of `model` by its key in the desk's words ("Order 42"), linked to its admin
    page when the model has one there and `user` (if given) may view it."""
    meta = model._meta
    name = str(meta.verbose_name).capitalize()
    may_view = user is None or user.has_perm(
        f"{meta.app_label}.{get_permission_codename('view', meta)}"
    )
    if not site.is_registered(model) or not may_view:
        return f"{name} {entity_id}"
    url = reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[quote(entity_id)])
    if css_class:  # in a table's cell (the audit's), where it may wrap
        return format_html('<a class="{}" href="{}">{} {}</a>', css_class, url, name, entity_id)
    return format_html('<a href="{}">{}&nbsp;{}</a>', url, name, entity_id)


def when(value: Any) -> str:
    """The one timestamp format of the desk: "2026-11-30 20:41:10 UTC" (ISO-like, with its zone).

    Takes a datetime or an ISO 8601 string (as JSON fields keep them).
    """
    if isinstance(value, str):
        value = parse_datetime(value)
    if not isinstance(value, datetime):
        return "-"
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    local = timezone.localtime(value)
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or ''}".rstrip()


#: How the desk logs a look-up in the admin's History (payments.desk.views.actions): the
#: bulk action follows it with the outcome's code ("retry_later"), the button with words.
QUERIED = "Queried the provider: "
#: A code as the engine names things: lower-case words joined by "_" (`needs_review`).
_CODE = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b")


def history_message(message: str, outcome_words: Mapping[str, str]) -> str:
    """An admin History message in an operator's words.

    A look-up logged with its outcome's code ("Queried the provider:
    retry_later") reads as that outcome's words (`outcome_words`, the desk's
    QUERY_WORDS); a state's code (`needs_review`) anywhere else as its label.
    Every other word stays as written (a reason is the operator's own).
    """
    if message.startswith(QUERIED):
        code = message[len(QUERIED) :].strip().rstrip(".")
        if code in outcome_words:
            return f"{QUERIED}{outcome_words[code]}"
    return _CODE.sub(lambda found: str(LABELS.get(found.group(0), found.group(0))), message)


def succeeded_at_provider(claim: Any) -> str:
    """The reference the provider's last look-up showed an unsettled step succeeded under.

    "" when the step is recorded done already, or the provider showed anything else.
    """
    view = claim.provider_view if isinstance(claim.provider_view, dict) else {}
    if claim.state == ClaimState.DONE or view.get("status") != "succeeded":
        return ""
    return str(view.get("reference") or "")


def dashboard_url(reference: str) -> str | None:
    """The provider's own page of a reference (PROVIDER_DASHBOARD_URL), or None when not set."""
    template = payments_settings().provider_dashboard_url
    if not template or not reference:
        return None
    return template.replace("{reference}", reference)


def reference_link(reference: str) -> str:
    """A provider reference in code type, linked to the provider's dashboard when configured."""
    if not reference:
        return "-"
    url = dashboard_url(reference)
    if url is None:
        return format_html('<code class="desk-ref">{}</code>', reference)
    return format_html(
        '<a class="desk-dashboard-link" href="{}" target="_blank" rel="noopener noreferrer" '
        'title="open at the provider"><code class="desk-ref">{}</code>&nbsp;↗</a>',
        url,
        reference,
    )


#: How the provider's statuses read to an operator.
PROVIDER_STATUS_COLOURS = {
    "succeeded": "#146c43",
    "not_found": "#5c636a",
}


def provider_status(view: dict[str, Any], *, settled_since: bool = False) -> str:
    """The status a lookup found, as a small badge (red for a refusal).

    `settled_since`: the step was recorded done after this look (a hold's
    `requires_capture` seen before its capture): grey, and said so, never red.
    """
    status = str(view.get("status") or view.get("outcome") or "unknown")
    colour = PROVIDER_STATUS_COLOURS.get(status, "#b02a37" if status != "unknown" else "#5c636a")
    label = status.replace("_", " ")
    if view.get("code"):
        label = f"{label} ({view['code']})"
    if settled_since and status != "succeeded":
        colour, label = "#5c636a", f"{label}: seen before the step was recorded done"
    return format_html(
        '<span class="desk-provider-status provider-{}" style="background:{};{}">{}</span>',
        status,
        colour,
        _BADGE_STYLE,
        label,
    )


def provider_requests(requests: Any) -> str:
    """The provider requests a row carries, one a line: HTTP status, request id, method, path.

    A request without an answer says why (`no answer: ReadTimeout`); "-" when none.
    """
    if not isinstance(requests, list) or not requests:
        return "-"
    lines = []
    for sent in requests:
        if not isinstance(sent, dict):
            continue
        status = sent.get("status")
        lines.append(
            (
                status if status is not None else f"no answer: {sent.get('error') or 'unknown'}",
                sent.get("request_id") or "no request id",
                sent.get("method", ""),
                sent.get("path", ""),
                " (replayed)" if sent.get("replayed") else "",
            )
        )
    return format_html(
        '<ul class="desk-requests">{}</ul>',
        format_html_join(
            "",
            '<li><span class="desk-http" title="HTTP status">{}</span> '
            '<code class="desk-request-id">{}</code> '
            '<small class="desk-request-path">{} {}{}</small></li>',
            lines,
        ),
    )


def request_ids(requests: Any) -> set[str]:
    """The provider request ids a row's `requests` name."""
    if not isinstance(requests, list):
        return set()
    return {str(r["request_id"]) for r in requests if isinstance(r, dict) and r.get("request_id")}


def provider_view_rows(claims: Any, params: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What the provider showed at the last lookup of each step, ready for a table.

    `params` is the operation's: an amount at the provider that differs from
    ours is flagged.
    """
    ours = (params or {}).get("amount"), str((params or {}).get("currency") or "").lower()
    rows = []
    for claim in claims:
        view = claim.provider_view
        if not isinstance(view, dict):
            continue
        amount = view.get("amount")
        theirs = amount, str(view.get("currency") or "").lower()
        rows.append(
            {
                "step": claim.step,
                "charged_unrecorded": view.get("status") == "succeeded"
                and claim.state != ClaimState.DONE,
                "claim_state": LABELS.get(claim.state, claim.state),
                "reference_text": str(view.get("reference") or ""),
                "status": provider_status(view, settled_since=claim.state == ClaimState.DONE),
                "amount": format_money(amount, view.get("currency")),
                "amount_differs": amount is not None and ours[0] is not None and theirs != ours,
                "reference": reference_link(str(view.get("reference") or "")),
                "checked_at": when(view.get("checked_at")),
                "source": _asked_by(view),
                "requests": provider_requests(view.get("requests")),
            }
        )
    return rows


def _asked_by(view: dict[str, Any]) -> str:
    """Which lookup it was and who asked ("reconciler, reconciler:host:12:ab")."""
    source, actor = str(view.get("source") or "-"), str(view.get("actor") or "")
    return f"{source}, {actor}" if actor and actor not in source else source


def provider_view_table(claims: Any, params: dict[str, Any] | None, *, what: str = "") -> str:
    """The provider's view of every step as an HTML table ("" when no step was looked up).

    `what` is the operation's money line (`money_line`): a success at the provider
    on a step we have not recorded done says that this money moved.
    """
    rows = provider_view_rows(claims, params)
    if not rows:
        return ""
    body = format_html_join(
        "",
        '<tr><td data-label="step">{}</td><td data-label="status">{}</td>'
        '<td data-label="amount">{}{}</td><td data-label="reference">{}</td>'
        '<td data-label="checked at">{}</td><td data-label="by">{}</td>'
        '<td data-label="requests">{}</td></tr>',
        (
            (
                r["step"],
                r["status"],
                r["amount"],
                mark_safe(' <strong class="desk-warning">≠ ours</strong>')
                if r["amount_differs"]
                else "",
                r["reference"],
                r["checked_at"],
                r["source"],
                r["requests"],
            )
            for r in rows
        ),
    )
    warnings = format_html_join(
        "",
        '<p class="desk-provider-warning"><strong>The provider shows step {} succeeded ({})'
        "</strong> while ours is {}: {} took place at the provider. Query the provider, or "
        "mark the step succeeded.</p>",
        ((r["step"], r["reference_text"], r["claim_state"].lower(), f"the {what}" if what else "it")
         for r in rows if r["charged_unrecorded"]),
    )  # fmt: skip
    return format_html(
        '<table class="desk-table desk-stack desk-provider-view"><thead><tr><th>Step</th><th>Status</th>'
        "<th>Amount</th><th>Reference</th><th>Checked at</th><th>By</th><th>Requests</th>"
        "</tr></thead>"
        "<tbody>{}</tbody></table>{}",
        body,
        warnings,
    )


def key_values(value: Any) -> str:
    """A small dict as `key: value` lines; anything else as JSON."""
    if value in (None, {}, []):
        return "-"
    if not isinstance(value, dict):
        return pretty_json(value)
    items = (
        (k, json.dumps(v) if isinstance(v, dict | list) else v) for k, v in sorted(value.items())
    )
    return format_html(
        '<ul class="desk-kv">{}</ul>', format_html_join("", "<li>{}: {}</li>", items)
    )


def pretty_json(value: Any) -> str:
    if value in (None, {}, []):
        return "-"
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', text)
