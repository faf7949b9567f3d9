""" "Mark failed" decides only from reads that cannot lag, and voids what the provider holds.

The reproduced double charges of issue "No second charge by construction": each
started where "not found" came from a lagging search. The search here lags by an
hour in every test; the answers the provider drops are dropped for real, over HTTP.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from rq import SimpleWorker

from payments.checkout.charge import PaymentIntentCharge
from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.names import CHARGE
from payments.desk import services as desk
from payments.desk.services import DeskError
from payments.engine import failpoints
from payments.models import ClaimState, Operation, OperationState
from payments.shop.models import OrderStatus
from tests.support import builders
from tests.support.builders import order_of

OLD = timedelta(minutes=20)  # older than the grace period (RECONCILE_GRACE, 15 min)
LAGGING = 3600  # the provider's search shows nothing younger than an hour


class Killed(BaseException):
    """The worker process dies here (SIGKILL): no `except Exception` runs."""


def charged(provider) -> list[str]:
    return [i["id"] for i in provider.state.intents() if i["status"] == "succeeded"]


@pytest.mark.django_db
def test_mark_failed__a_replay_whose_answer_is_lost__is_found_and_recorded_done(
    provider, operator, senior
):
    """Hole 1: the first request never reached the provider; past the grace the operator marks
    the charge failed. The desk's same-key replay executed it, its answer was lost, and the
    lagging search found nothing: "not found" was accepted (the grace counted from the claim),
    the order said failed, the provider held the money, and a new attempt charged again."""
    op, claim, _ = builders.uncertain(charged=False, age=OLD)
    provider.state.configure(search_lag=LAGGING)
    provider.state.enqueue_faults("drop_after_accept", 1)

    marked = desk.mark_step_failed(op, CHARGE, user=operator, reason="not in the search")
    assert marked.found_succeeded and re.search("succeeded", marked.detail), marked

    [reference] = charged(provider)
    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert order_of(op).status != OrderStatus.PAYMENT_FAILED
    with pytest.raises(DeskError):
        desk.start_new_attempt(op, user=senior, reason="customer asked to retry")
    with pytest.raises(CheckoutNotAllowed):  # the shop's own retry with a new key
        request_checkout(
            order_id=op.params["order_id"], key="shop-retry", payment_method="pm_card_visa",
            actor="api",
        )  # fmt: skip
    assert charged(provider) == [reference]


@pytest.mark.django_db
def test_mark_failed__an_intent_that_did_not_succeed__is_cancelled_first(provider, operator):
    """A decline whose answer was lost: the intent exists. "Mark failed" cancels it at the
    provider, so that it can never be charged, and says so."""
    # Past the provider's key retention: no replay, only reads and the cancel.
    op, claim, reference = builders.uncertain(
        charged=True, pm="pm_card_chargeDeclined", age=timedelta(days=2)
    )
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")

    settled = desk.mark_step_failed(op, CHARGE, user=operator, reason="customer gave up").claim

    assert (settled.state, settled.provider_reference) == (ClaimState.FAILED, reference)
    assert settled.result["status"] == "canceled"
    [intent] = provider.state.intents()
    assert intent["status"] == "canceled"
    assert "canceled at the provider" in Operation.objects.get(pk=op.pk).last_error
    assert order_of(op).status == OrderStatus.PAYMENT_FAILED


@pytest.mark.django_db
def test_mark_failed__a_success_the_list_shows__is_recorded_done_without_a_cancel(
    provider, operator
):
    op, claim, reference = builders.uncertain(charged=True, age=timedelta(days=2))
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")
    provider.state.configure(search_lag=LAGGING)

    marked = desk.mark_step_failed(op, CHARGE, user=operator, reason="looks failed")
    assert marked.found_succeeded and re.search(f"succeeded \\({reference}\\)", marked.detail), (
        marked
    )

    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert provider.state.stats()["cancel_requests"] == 0  # found by the list, not cancelled
    assert charged(provider) == [reference]


@pytest.mark.django_db
def test_mark_failed__the_cancel_refused_because_it_succeeded_meanwhile__recorded_done(
    provider, operator, monkeypatch
):
    """The intent is declined when looked up; before the cancel reaches the provider it is
    confirmed with another card (the provider's own answer decides): the cancel is refused
    with payment_intent_unexpected_state, the step is recorded done, nothing marked failed."""
    op, claim, reference = builders.uncertain(
        charged=True, pm="pm_card_chargeDeclined", age=timedelta(days=2)
    )
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")
    looked_up = PaymentIntentCharge.find

    def find_then_confirmed_meanwhile(self, view):
        found = looked_up(self, view)
        self.client.confirm_payment_intent(
            reference, payment_method="pm_card_visa", idempotency_key="confirm-meanwhile"
        )
        return found

    monkeypatch.setattr(PaymentIntentCharge, "find", find_then_confirmed_meanwhile)

    marked = desk.mark_step_failed(op, CHARGE, user=operator, reason="customer gave up")
    assert marked.found_succeeded and "refused to cancel it" in marked.detail, marked

    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert provider.state.stats()["cancel_requests"] == 1
    assert charged(provider) == [reference]
    assert order_of(op).status != OrderStatus.PAYMENT_FAILED


@pytest.mark.django_db
def test_mark_failed__nothing_at_the_provider__counts_the_grace_from_the_last_request(
    provider, operator
):
    """A request sent a minute ago under the key (a replay) keeps "not found" from counting,
    however old the claim: the grace runs from the last request, not from the claim."""
    op, claim, _ = builders.uncertain(charged=False, age=timedelta(days=2))
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")
    builders.backdate_last_request(claim, timedelta(minutes=1))

    with pytest.raises(DeskError, match="less than 15 min ago"):
        desk.mark_step_failed(op, CHARGE, user=operator, reason="nothing there")

    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN
    builders.backdate_last_request(claim, OLD)
    settled = desk.mark_step_failed(op, CHARGE, user=operator, reason="nothing there").claim
    assert settled.state == ClaimState.FAILED
    assert settled.result == {"status": "not_found"}


@pytest.mark.django_db(transaction=True)  # the worker's claim and replay commit for real
def test_mark_failed__after_a_worker_died_just_past_the_providers_accept__is_refused(
    provider, queue, operator
):
    """Hole 1, second variant: a worker's replay is accepted by the provider, the worker is
    SIGKILLed before it records, the claim is older than the grace, and the operator marks
    the charge failed before the sweeper dispatches it again (no replay from the desk while a
    worker may run it): the lagging search said "not found"."""
    op = builders.new_checkout()
    builders.claim_charge(op, age=OLD)  # claimed long ago; its request never arrived
    provider.state.configure(search_lag=LAGGING)

    def die() -> None:
        raise Killed

    with failpoints.hooked(failpoints.AFTER_PROVIDER_ACCEPT, die):
        try:
            SimpleWorker([queue], connection=queue.connection).work(burst=True, max_jobs=1)
        except Killed:
            pass
    [reference] = charged(provider)
    time.sleep(3.2)  # the dead worker's lease (CLAIM_LEASE, 3 s) runs out
    op.refresh_from_db()
    assert op.state == OperationState.RUNNING  # as the dead worker left it

    marked = desk.mark_step_failed(op, CHARGE, user=operator, reason="the search shows nothing")
    assert marked.found_succeeded and re.search(f"succeeded \\({reference}\\)", marked.detail), (
        marked
    )

    claim = op.claims.get(step=CHARGE)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert order_of(op).status == OrderStatus.PROCESSING
    assert charged(provider) == [reference]


@pytest.mark.django_db(transaction=True)  # the replay's claim writes commit for real
def test_mark_failed__the_checks_own_replay_got_no_answer__says_pressing_again_replays_again(
    provider, operator, monkeypatch
):
    """An outsider's catch (a label service answering 500, which its effect counts as
    uncertain): each press replayed under the key, the replay became the last request, and
    the refusal said "try again after the grace period": the next press did the same, until
    the key's retention ran out. The refusal now says what the press did and what ends it."""
    from payments.engine.outcomes import UncertainError

    op, claim, _ = builders.uncertain(charged=False, age=OLD)
    builders.move(op, OperationState.NEEDS_REVIEW, reason="outcome unknown")

    def no_answer(self, *args, **kwargs):
        raise UncertainError("POST /v1/payment_intents: HTTP 500")

    monkeypatch.setattr(PaymentIntentCharge, "send", no_answer)

    with pytest.raises(DeskError) as refused:
        desk.mark_step_failed(op, CHARGE, user=operator, reason="nothing there")

    words = refused.value.detail
    assert "this check replayed the request under its key" in words
    assert "after the grace period" not in words and "pressing again replays it again" in words
    assert "once the provider answers a replay" in words
    claim.refresh_from_db()
    assert claim.state == ClaimState.UNCERTAIN and charged(provider) == []
