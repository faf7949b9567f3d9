"""The desk's actions ordered by safety: "mark failed" waits for a look-up in this state."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib import messages
from django.urls import reverse

from payments.desk.services import QueryOutcome
from payments.desk.views.actions import query_level, query_words
from payments.engine import fence
from payments.engine.effects import EffectResult
from payments.engine.outcomes import Outcome
from tests.support import builders
from tests.support.users import RECONCILE, VIEW, client_for, make_user

pytestmark = pytest.mark.django_db


def change_url(op) -> str:
    return reverse("admin:payments_operation_change", args=[op.pk])


def mark_failed_url(op) -> str:
    return reverse("admin:payments_operation_desk_step", args=[op.pk, "charge", "mark_failed"])


def buttons(page: str) -> list[str]:
    block = page.split('class="desk-buttons"', 1)[1].split("</div>", 1)[0]
    return re.findall(r">([^<>]+)</(?:a|span)>", block)


# Transactional: a look-up is stamped with the database's now(), which inside one test
# transaction would be that transaction's start, before the state it looks at.
@pytest.mark.django_db(transaction=True)
def test_mark_failed__off_until_the_provider_is_asked_in_this_state_and_last(provider):
    op, claim, _ = builders.uncertain(key="ask-first", charged=False, age=timedelta(hours=1))
    operator = make_user("alice", *VIEW, RECONCILE)
    client = client_for(operator)

    before = client.get(change_url(op)).content.decode()
    confirm = client.get(mark_failed_url(op)).content.decode()
    fence.note_provider_view(claim, None, source="desk")  # a look-up that found nothing
    after = client.get(change_url(op)).content.decode()

    assert (
        buttons(before)[0] == "Query the provider now"
        and buttons(before)[-1] == "Mark charge failed"
    )
    assert re.search(r'<span class="[^"]*desk-mark_failed desk-danger"[^>]*aria-disabled', before)
    assert "nobody has asked the provider about step charge" in before
    assert re.search(r'<input type="submit" class="default desk-danger"[^>]*disabled', confirm)
    assert f'href="{mark_failed_url(op)}"' in after and "desk-danger" in after


def test_mark_succeeded__reference_prefilled_from_what_the_provider_showed(provider):
    op, claim, reference = builders.uncertain(key="prefill", charged=True)
    found = EffectResult(Outcome.SUCCESS, reference=reference, data={"status": "succeeded"})
    fence.note_provider_view(claim, found, source="desk")
    url = reverse("admin:payments_operation_desk_step", args=[op.pk, "charge", "mark_succeeded"])

    page = client_for(make_user("alice", *VIEW, RECONCILE)).get(url).content.decode()

    assert re.search(rf'name="reference" value="{reference}"', page)


@pytest.mark.parametrize(
    ("outcome", "before", "after", "words", "success"),
    [
        ("done", "uncertain", "retrying", "recorded done; now retrying (the operation runs", True),
        ("still_uncertain", "uncertain", "uncertain", "still waiting (state unchanged", False),
        ("needs_review", "needs_review", "needs_review", "(state unchanged: needs review)", False),
    ],
)
def test_query_words__say_what_the_provider_showed_and_succeed_only_when_settled(
    outcome, before, after, words, success
):
    row = QueryOutcome(1, "k", outcome, before, after)
    assert words in query_words(row)
    assert (query_level([row]) == messages.SUCCESS) is success


def test_query__off_for_an_operation_whose_steps_call_no_external_system(monkeypatch):
    """A newcomer's operation with local steps and a side effect only: "Query the provider
    now" asked nothing and said nothing; the button is off, with the reason."""
    from django.db import transaction

    from payments.engine import handlers
    from payments.fence import create_operation_in_tx, operation

    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    operation("local-only", steps={"note": None})(lambda run: run.local("note", lambda: None))
    with transaction.atomic():
        op, _ = create_operation_in_tx(
            key="local-1", kind="local-only", entity_type="rental", entity_id="R-1",
            params={}, actor="t",
        )  # fmt: skip

    page = client_for(make_user("alice", *VIEW, RECONCILE)).get(change_url(op)).content.decode()

    assert re.search(r'<span class="[^"]*desk-query_provider[^"]*"[^>]*aria-disabled', page), page
    assert "its steps call no external system that can be asked" in page
