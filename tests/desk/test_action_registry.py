"""The desk's action view dispatches on each action's declaration, never on its name (issue 40).

An action added to `DESK_ACTIONS` with its flags (one step or the whole
operation, an outright refusal, its page's words, its message's level) gets a
confirmation page, the refusal checked before anything, the audit entry and
the message, without a line of the view naming it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib import messages
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from payments.desk.views import actions
from payments.desk.views.actions import DESK_ACTIONS, DeskAction, ReasonForm
from tests.support import builders
from tests.support.users import RECONCILE, VIEW, client_for, make_user

pytestmark = pytest.mark.django_db

RAN: list[tuple[int, str, str]] = []


def _run_note(op: Any, step: str, request: Any, data: dict[str, Any]) -> str:
    RAN.append((op.pk, step, data["reason"]))
    return f"Noted step {step}: {data['reason']}"


NOTE_STEP = DeskAction(
    "note_step",
    "Note step",
    "Note it",
    ReasonForm,
    ("payments.reconcile_operation",),
    _run_note,
    per_step=True,
    refusal=lambda op, step: "this step was noted already" if RAN else "",
    page=lambda op, step: {"title": f"A note about {step}"},
    level_after=lambda op: messages.WARNING,
)


@pytest.fixture
def note_step(monkeypatch):
    RAN.clear()
    monkeypatch.setitem(DESK_ACTIONS, NOTE_STEP.name, NOTE_STEP)
    return NOTE_STEP


def url(op, step: str = "charge") -> str:
    return reverse("admin:payments_operation_desk_step", args=[op.pk, step, "note_step"])


def test_an_action_declared_only__confirms_runs_audits_and_warns(provider, note_step):
    op, _claim, _ = builders.uncertain(key="registry-1", charged=False)
    client = client_for(make_user("alice", *VIEW, RECONCILE))

    confirm = client.get(url(op))
    done = client.post(url(op), {"reason": "ticket 7"}, follow=True)

    assert confirm.status_code == 200
    assert "<title>A note about charge" in confirm.content.decode()  # its page's words
    assert RAN == [(op.pk, "charge", "ticket 7")]
    assert LogEntry.objects.filter(object_id=str(op.pk)).last().change_message == (
        "Noted step charge: ticket 7"
    )
    assert [(m.level, m.message) for m in done.context["messages"]] == [
        (messages.WARNING, "Noted step charge: ticket 7")
    ]


def test_an_action_declared_only__its_refusal_checked_first_409_nothing_run(provider, note_step):
    op, _claim, _ = builders.uncertain(key="registry-2", charged=False)
    client = client_for(make_user("alice", *VIEW, RECONCILE))
    RAN.append((0, "", "earlier"))

    answer = client.post(url(op), {"reason": "again"})

    assert answer.status_code == 409
    assert "this step was noted already" in answer.content.decode()
    assert RAN == [(0, "", "earlier")]


def test_a_per_step_action_without_a_step__or_an_unknown_action__404(provider, note_step):
    op, _claim, _ = builders.uncertain(key="registry-3", charged=False)
    client = client_for(make_user("alice", *VIEW, RECONCILE))
    whole = reverse("admin:payments_operation_desk", args=[op.pk, "note_step"])
    unknown = reverse("admin:payments_operation_desk", args=[op.pk, "no_such"])

    assert client.get(whole).status_code == 404
    assert client.get(unknown).status_code == 404
    assert actions.DESK_ACTIONS["mark_failed"].per_step  # the shipped ones declare it too


def test_an_action_declared_only__gets_its_button_on_the_operation_page(provider, note_step):
    """The operation page's button row is the declared actions, in their order, a per-step
    one once per step waiting to be settled, off with its own refusal: no name tested."""
    op, _claim, _ = builders.uncertain(key="registry-4", charged=False)
    client = client_for(make_user("alice", *VIEW, RECONCILE))
    change = reverse("admin:payments_operation_change", args=[op.pk])

    page = client.get(change).content.decode()
    buttons = re.findall(r'class="button desk-button (?:desk-button-off )?desk-([a-z_]+)', page)
    RAN.append((0, "", "earlier"))
    refused = client.get(change).content.decode()

    assert buttons == [*[a for a in DESK_ACTIONS if a != "note_step"], "note_step"]
    assert f'href="{url(op)}">Note charge</a>' in page  # its title, the step named
    assert "Note charge is unavailable: this step was noted already" in refused
    assert "desk-button-off desk-note_step" in refused
