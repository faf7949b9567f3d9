"""How the operators' pages render states, times and results: one place, one colour per state."""

from __future__ import annotations

import json
from typing import Any

from django.utils import timezone
from django.utils.html import format_html, format_html_join

from payments.models import ClaimState, OperationState

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
    OperationState.NEEDS_REVIEW: "#c2185b",
    ClaimState.CLAIMED: "#0b5ed7",
    ClaimState.DONE: "#146c43",
}
#: States whose age an operator watches: the longer, the likelier a customer waits.
AGED_STATES = frozenset({OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW})

LABELS = {**dict(OperationState.choices), **dict(ClaimState.choices)}


def state_badge(state: str) -> str:
    """Render a state as a coloured badge (white text; every colour passes WCAG AA)."""
    if not state:
        return "-"
    return format_html(
        '<span class="state-badge state-{}" style="background:{};color:#fff;padding:2px 8px;'
        'border-radius:10px;font-weight:600;white-space:nowrap">{}</span>',
        state,
        BADGE_COLOURS.get(state, "#000"),
        LABELS.get(state, state),
    )


def when(value: Any) -> str:
    """A compact local timestamp for tables, where the default format wraps over four lines."""
    if value is None:
        return "-"
    return f"{timezone.localtime(value):%Y-%m-%d %H:%M:%S}"


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
