"""Attempts count requests sent for the work; look-ups apart; the first error beside the last."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from payments.engine import fence
from payments.models import ClaimState, OperationState, StepClaim
from tests.support import builders
from tests.support.users import VIEW, client_for, make_user

pytestmark = pytest.mark.django_db


def page_of(op) -> str:
    client = client_for(make_user("vera", *VIEW))
    return client.get(reverse("admin:payments_operation_change", args=[op.pk])).content.decode()


def test_note_request_sent__counts_a_replay_as_an_attempt(provider):
    op = builders.new_checkout("replayed-once")
    claim = builders.claim_charge(op)
    fence.take_over_claim(claim, owner=builders.WORKER, lease_seconds=30)
    fence.note_request_sent(claim, actor=builders.WORKER)

    claim.refresh_from_db()
    assert claim.requests_sent == 1
    assert re.search(r'field-attempts_shown.*?<div class="readonly">2</div>', page_of(op), re.S)


def test_not_found_after_a_lost_answer__says_charged_and_answer_lost_beside_the_first_error(
    provider,
):
    op, claim, _ = builders.uncertain(key="lost-answer", charged=False)
    builders.move(op, OperationState.NEEDS_REVIEW, reason="not found", last_error="not found at "
                  "the provider (consistent list) a grace period after the last request")  # fmt: skip

    page = page_of(op)

    shown = re.search(r'field-last_error_shown.*?<div class="readonly">(.*?)</div>', page, re.S)
    assert "not found at the provider" in shown.group(1)
    assert "first error: ReadTimeout" in shown.group(1)
    assert "Not found: charged and its answer lost?" in shown.group(1)
    assert StepClaim.objects.get(pk=claim.pk).error == "ReadTimeout"


@pytest.mark.parametrize(
    "error", ["AdyenError: POST /payments: 502", "LedgerUnreachable: no answer in 10 s"]
)
def test_not_found_after_any_systems_lost_answer__read_from_the_claims_state_not_its_name(
    provider, error
):
    """The engine recorded the claim uncertain: the first request may have run, whatever
    the system's error class is called (Adyen's is AdyenError, a project's own anything)."""
    op = builders.new_checkout("lost-answer-any")
    claim = fence.settle_claim(
        builders.claim_charge(op), ClaimState.UNCERTAIN, actor=builders.WORKER, error=error
    )
    builders.move(op, OperationState.NEEDS_REVIEW, reason="not found",
                  last_error="not found at the system a grace period after the last request")  # fmt: skip

    shown = re.search(
        r'field-last_error_shown.*?<div class="readonly">(.*?)</div>', page_of(op), re.S
    ).group(1)

    assert f"first error: {error}" in shown
    assert "Not found: charged and its answer lost?" in shown
    assert StepClaim.objects.get(pk=claim.pk).state == ClaimState.UNCERTAIN


def test_not_found_after_a_release_then_a_lost_answer__not_said_never_reached(provider):
    """A review's catch: the hint read only the first error. A step released after a
    refusal (nothing ran) and then held uncertain (a read timeout) may have charged."""
    op = builders.new_checkout("released-then-lost")
    claim = builders.claim_charge(op)
    fence.release_claim(claim, actor=builders.WORKER, reason="TransientError: HTTP 503")
    claim = fence.take_over_claim(claim, owner=builders.WORKER, lease_seconds=30)
    fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=builders.WORKER, error="ReadTimeout")
    builders.move(op, OperationState.NEEDS_REVIEW, reason="not found",
                  last_error="not found at the provider a grace period after the last request")  # fmt: skip

    shown = re.search(
        r'field-last_error_shown.*?<div class="readonly">(.*?)</div>', page_of(op), re.S
    ).group(1)

    assert "first error: released after transient failure" in shown
    assert "Not found: charged and its answer lost?" in shown
    assert "never reached" not in shown


def test_steps_row__a_look_overwrote_the_claims_error__the_first_one_shown_beside_it(provider):
    """The operator's try: a look-up's "not found" replaced "ReadTimeout" on the Steps row
    while the step stayed uncertain, hiding what the first request met."""
    op, claim, _ = builders.uncertain(key="looked-over", charged=False)
    fence.settle_claim(claim, ClaimState.UNCERTAIN, actor=builders.WORKER, error="not found")

    row = re.search(r'<td class="field-outcome">(.*?)</td>', page_of(op), re.S).group(1)

    assert "not found" in row and "first error: ReadTimeout" in row


def test_steps_row__one_error_only__shown_once(provider):
    op, claim, _ = builders.uncertain(key="one-error", charged=False)

    row = re.search(r'<td class="field-outcome">(.*?)</td>', page_of(op), re.S).group(1)

    assert row.count("ReadTimeout") == 1 and "first error" not in row
