"""The desk during a provider incident: evidence shown, a next step for every case, one banner.

Findings 1-5 of issue 37, each on the real desk pages: the operation page, the
query's answer (one and many), the mark-failed button, Needs attention and the
home page. Real PostgreSQL and the real HTTP fake provider; a provider that does
not answer is a port nothing listens on.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.desk.views.queries import attempts_of
from payments.engine import fence
from payments.engine.effects import EffectResult
from payments.engine.outcomes import Outcome
from payments.engine.recovery import reconcile
from payments.engine.writes import fence_writes
from payments.models import (
    ClaimLook,
    ClaimState,
    LookShowed,
    Operation,
    OperationEvent,
    OperationState,
    StepClaim,
)
from tests.support import builders, flows
from tests.support.users import client_for
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/payments/operation/"
NEEDS_ATTENTION = "/admin/payments/operation/needs-attention/"
DOWN = "http://127.0.0.1:9"


def change_url(op: Operation) -> str:
    return reverse("admin:payments_operation_change", args=[op.pk])


def text(response) -> str:
    """The page's words, without tags or repeated spaces."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", response.content.decode()))


def provider_down(settings) -> None:
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": DOWN}


def test_operation_page__an_unanswered_look__shows_the_real_error_and_the_next_step(
    provider, viewer, settings
):
    """Finding 1 and 5: "Not looked up yet" after 36 looks; the why was "lookup failed"."""
    op, _, _ = builders.uncertain(key="inc-page", charged=True)
    provider_down(settings)
    reconcile(operation_ids=[op.pk])
    reconcile(operation_ids=[op.pk])

    page = text(client_for(viewer).get(change_url(op)))

    assert "Not looked up yet" not in page
    assert "Looked 2 times" in page
    assert "the provider has not answered since" in page
    assert "ConnectionError" in page  # the real error, not "lookup failed; next round"
    assert "Waiting: the provider has not answered since" in page
    assert "next look at" in page
    assert "it goes to review" in page


@pytest.mark.django_db(transaction=True)
def test_operation_page__the_money_the_provider_showed__while_a_request_is_in_flight(
    provider, viewer, queue, settings
):
    """Finding 3: the provider's list showed the intent (declined, €74.50) while every
    same-key replay answered 409: the page shows that object, its amount and the wait."""
    op = flows.declined_charge_held_in_flight(provider, queue, "inc-held-page")

    page = text(client_for(viewer).get(change_url(op)))

    assert "in flight at the provider since" in page
    assert "requires payment method, €74.50" in page
    assert "Waiting: a request under its key is in flight at the provider" in page
    assert provider.state.wait_idle(timeout=10)


def test_mark_failed__refused_while_unanswered__names_the_wait_not_a_query(
    provider, operator, settings
):
    """Finding 1: the disabled button pointed to "Query the provider now", which could not succeed."""
    op, _, _ = builders.uncertain(key="inc-mark", charged=False)
    provider_down(settings)
    reconcile(operation_ids=[op.pk])
    url = reverse("admin:payments_operation_desk_step", args=[op.pk, "charge", "mark_failed"])

    page = text(client_for(operator).get(url))

    assert "Query the provider now” first" not in page
    assert "has not given an answer about step charge" in page
    assert "the fence looks again at" in page


def test_query_now__an_unanswered_provider__reads_not_read_with_its_error_never_a_tick(
    provider, operator, settings
):
    """Finding 2: the bulk query over uncertain charges settled none and read "✓ ... could
    not be read"; it now counts settled / still waiting / not read, with each one's why."""
    first, _, _ = builders.uncertain(key="inc-bulk-a", charged=True)
    second, _, _ = builders.uncertain(key="inc-bulk-b", charged=False)
    provider_down(settings)
    selection = {"action": "query_selected", "_selected_action": [first.pk, second.pk]}

    response = client_for(operator).post(CHANGELIST, {**selection, "post": "yes"}, follow=True)

    page = response.content.decode()
    assert "0 settled, 0 still waiting, 2 not read" in page
    assert 'class="success"' not in page  # Django's green ✓ message
    assert "<strong>Not read</strong>" in page and "the provider did not answer" in page
    assert "ConnectionError" in page
    assert "the fence looks again at" in page


def test_looks__write_no_audit_rows__and_attempts_count_requests_that_could_move_money(
    provider, viewer, settings
):
    """Finding 4: 190-203 audit rows after 16 minutes and "Attempts" 25-93 for a charge
    sent once. Six looks at an unanswering provider: one row for the reconciler taking the
    claim over from the worker, none after; attempts still 1."""
    op, _, _ = builders.uncertain(key="inc-count", charged=True)
    provider_down(settings)
    reconcile(operation_ids=[op.pk])
    rows = OperationEvent.objects.filter(operation=op).count()

    for _ in range(5):
        reconcile(operation_ids=[op.pk])

    assert OperationEvent.objects.filter(operation=op).count() == rows
    op = Operation.objects.prefetch_related("claims").get(pk=op.pk)
    assert attempts_of(op) == 1
    assert ClaimLook.objects.get(claim__operation=op).looks == 6


def test_incident_banner__on_needs_attention_and_home__once_with_the_money_at_stake(
    provider, viewer, settings
):
    """One incident, one banner: since when, how many wait, the money, the next look."""
    for n in range(3):
        builders.uncertain(key=f"inc-banner-{n}", charged=True)
    provider_down(settings)
    reconcile()

    attention = text(client_for(viewer).get(NEEDS_ATTENTION))
    home = text(client_for(viewer).get("/admin/"))

    for page in (attention, home):
        assert page.count("Incident at the provider since") == 1
        assert "3 operations wait for an answer" in page
        assert "at stake" in page
        assert "next look" in page  # at a time, or due since one on a slow host
    assert ClaimLook.objects.filter(showed=LookShowed.UNREADABLE).count() == 3


def test_incident_banner__none_for_one_unanswered_operation(provider, viewer, settings):
    builders.uncertain(key="inc-one", charged=True)
    provider_down(settings)
    reconcile()

    assert "Incident at" not in text(client_for(viewer).get(NEEDS_ATTENTION))


def test_needs_attention__money_the_provider_showed_taken__counted_as_not_settled_yet(
    provider, viewer
):
    """Finding 3: money at risk from evidence, labelled as not settled yet."""
    op, claim, reference = builders.uncertain(key="inc-taken", charged=True)
    shown = {"status": "succeeded", "amount": 7450, "currency": "eur"}
    fence.note_provider_view(
        claim, EffectResult(Outcome.SUCCESS, reference=reference, data=shown), source="query"
    )

    page = text(client_for(viewer).get(NEEDS_ATTENTION))

    assert "Done at their systems, not settled yet: €74.50 checkout" in page


def test_needs_attention__money_shown_taken__every_step_counted__not_the_first_rows(
    provider, viewer, monkeypatch
):
    """The line read the first 5,000 such steps only (INCIDENT_MONEY_ROWS) and added them up
    in Python: in an outage of more, the figure was short and said nothing of it (here the
    rows cut to 2 of 3, as on the old code). It is summed in the database now, every step;
    an amount that is not a whole number of minor units is left out."""
    from payments.desk import evidence

    monkeypatch.setattr(evidence, "INCIDENT_MONEY_ROWS", 2, raising=False)
    for n, amount in enumerate([7450, 7450, 7450, "74.50"]):
        _, claim, reference = builders.uncertain(key=f"inc-taken-all-{n}", charged=True)
        shown = {"status": "succeeded", "amount": amount, "currency": "eur"}
        fence.note_provider_view(
            claim, EffectResult(Outcome.SUCCESS, reference=reference, data=shown), source="query"
        )

    page = text(client_for(viewer).get(NEEDS_ATTENTION))

    assert "Done at their systems, not settled yet: €223.50 checkout" in page


def test_needs_attention__a_refund_shown_done__never_added_to_a_charge(provider, viewer):
    """A review's catch: the line added a refund the provider showed done to the charges
    ("€80.50"), the defect the incident banner's money had."""
    from django.db import transaction

    _, charge, reference = builders.uncertain(key="inc-taken-2", charged=True)
    shown = {"status": "succeeded", "amount": 7450, "currency": "eur"}
    fence.note_provider_view(
        charge, EffectResult(Outcome.SUCCESS, reference=reference, data=shown), source="query"
    )
    with transaction.atomic():  # a refund's row as the API writes it (its job never runs)
        refund, _ = fence.create_operation_in_tx(
            key="refund-shown", kind="refund", entity_type="order", entity_id=1,
            params={"amount": 600, "currency": "eur"}, actor="api",
        )  # fmt: skip
    with fence_writes():  # its claim as claim_step inserts it (hand-made, as builders do)
        claim = StepClaim.objects.create(
            operation=refund, step="refund", state=ClaimState.CLAIMED, claimed_by="w/1",
            claimed_at=timezone.now(), lease_expires_at=timezone.now(),
        )  # fmt: skip
    refunded = {"status": "succeeded", "amount": 600, "currency": "eur"}
    fence.note_provider_view(
        claim, EffectResult(Outcome.SUCCESS, reference="re_1", data=refunded), source="query"
    )

    page = text(client_for(viewer).get(NEEDS_ATTENTION))

    assert "not settled yet: €74.50 checkout and €6.00 refund" in page


def test_operation_page__a_look_from_before_the_step_was_done__grey_not_a_refusal(provider, viewer):
    """Finding 3: a captured payment still showed a red "requires capture" badge: the
    authorisation's last look, taken before its lost answer was settled."""
    op, claim = builders.failed_after_charge(key="inc-old-look")
    seen = {"status": "requires_capture", "amount": 6000, "currency": "eur"}
    fence.note_provider_view(
        claim, EffectResult(Outcome.SUCCESS, reference="pi_old", data=seen), source="query"
    )

    page = client_for(viewer).get(change_url(op)).content.decode()

    assert "requires capture: seen before the step was recorded done" in page
    assert (
        'background:#b02a37;color:#fff;padding:2px 8px;border-radius:10px;font-weight:600;white-space:nowrap">requires capture'
        not in page
    )


@pytest.mark.django_db(transaction=True)
def test_mark_failed__refused_while_a_request_is_in_flight__nothing_failed(
    provider, operator, queue
):
    """Review of #37: mark failed decided from the grace alone while the provider still
    executed a request under the key (it could take the money after the step was failed)."""
    from payments.desk import services as desk

    provider.state.configure(slow_delay=4.0)
    provider.state.enqueue_faults("slow", 1)
    order = create_order(amount=7450, currency="eur", email="held@example.com")
    op, _ = request_checkout(
        order_id=order.pk, key="inc-mark-held", payment_method="pm_card_chargeDeclined", actor="t"
    )
    run_worker(queue)
    reconcile(operation_ids=[op.pk])  # 409: in flight

    with pytest.raises(desk.DeskError, match="still in flight"):
        desk.mark_step_failed(op, "charge", user=operator, reason="the customer gave up")

    op.refresh_from_db()
    assert op.state != "failed"
    assert provider.state.wait_idle(timeout=10)


def test_a_bulk_query_past_its_time_budget__the_rest_not_asked_and_not_audited(
    provider, settings, monkeypatch
):
    """An operator's try: six uncertain operations took a bulk query 37 s in an outage,
    past gunicorn's 30 s, and the page died. Past QUERY_BUDGET_SECONDS the rest are
    reported not asked (nothing sent, no audit row) instead."""
    from payments.desk import services
    from payments.desk.evidence import query_tally
    from tests.support.users import RECONCILE, VIEW, make_user

    ops = [builders.uncertain(key=f"budget-{n}", charged=False)[0] for n in range(3)]
    provider_down(settings)
    monkeypatch.setattr(services, "QUERY_BUDGET_SECONDS", 0.0)
    before = {op.pk: OperationEvent.objects.filter(operation=op).count() for op in ops}

    report = services.query_provider(
        [op.pk for op in ops], user=make_user("rita", *VIEW, RECONCILE)
    )

    outcomes = [row.outcome for row in report.rows]
    assert outcomes[1:] == [services.NOT_ASKED, services.NOT_ASKED]
    assert query_tally(outcomes).endswith("3 not read")  # one unanswered, two not asked
    after = {op.pk: OperationEvent.objects.filter(operation=op).count() for op in ops}
    assert after[ops[0].pk] > before[ops[0].pk]  # asked: its rows
    assert [after[op.pk] - before[op.pk] for op in ops[1:]] == [0, 0]  # not asked: none
    # Pressed again: the ones not reached go first (the first now has a look).
    again = services.query_provider([op.pk for op in ops], user=make_user("olga", *VIEW, RECONCILE))
    asked = [r.operation_id for r in again.rows if r.outcome != services.NOT_ASKED]
    assert asked == [ops[1].pk]


@pytest.mark.django_db(transaction=True)
def test_a_key_used_with_other_parameters__held_for_a_person_at_once_not_looked_at_again(
    provider, queue, monkeypatch
):
    """A newcomer's try: a 422 "key reused" read "Under review for want of a decisive
    answer. The fence keeps looking ... settles it by itself": a look replays the same
    request into the same refusal. The worker's conflict holds the looks, as the
    reconciler's did, and the desk says a person decides."""
    from payments.checkout.charge import PaymentIntentCharge
    from payments.desk.evidence import evidence_html
    from payments.models import OperationState
    from payments.provider.errors import IdempotencyConflict

    def refused(self, request, idempotency_key):
        raise IdempotencyConflict(
            "POST /v1/payment_intents: HTTP 400 idempotency_error", http_status=400
        )

    monkeypatch.setattr(PaymentIntentCharge, "send", refused)
    order = create_order(amount=1999, currency="eur", email="x@example.com")
    op, _ = request_checkout(order_id=order.pk, key="reused", payment_method="pm_card_visa",
                             actor="t")  # fmt: skip
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.NEEDS_REVIEW

    shown = text_of(str(evidence_html(op)))

    assert "Held for a person: idempotency conflict" in shown
    assert "settles it by itself" not in shown
    assert "Looked 0 times" not in shown and "Not looked up: held for a person" in shown
    assert ClaimLook.objects.get(claim__operation=op).next_look_at is None  # no more looks


def text_of(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_the_banner_names_the_systems_that_do_not_answer():
    """A review's catch: "Provider incident … the provider's answer" for any system."""
    from datetime import UTC, datetime

    from payments.desk.evidence import Incident, incident_html

    found = Incident(
        since=datetime(2026, 12, 7, 3, 12, tzinfo=UTC),
        operations=4,
        in_flight=1,
        unreadable=3,
        systems=["Adyen", "the accounting system"],
    )

    banner = incident_html(found)

    assert "Incident at Adyen and the accounting system since 2026-12-07 03:12" in banner
    assert "provider" not in banner


@pytest.mark.django_db(transaction=True)  # the refund runs in a real worker
def test_incident_banner__says_which_cases_do_need_a_person(provider, viewer, settings, queue):
    """An operator's walk: the banner said "nothing needs pressing for them" above refunds
    the fence had given up on after the outage's refusals, each waiting for a new attempt.
    The waiting ones need nothing; the banner now names those that need a person."""
    flows.refund_failed_by_an_outage(provider, queue, key="given-up")
    for n in range(3):
        builders.uncertain(key=f"inc-waiting-{n}", charged=True)
    provider_down(settings)
    reconcile()

    attention = text(client_for(viewer).get(NEEDS_ATTENTION))

    assert "nothing needs pressing for them" in attention
    assert (
        "1 operation failed before anything ran and waits for a person: "
        "a new attempt, where it is still wanted (in the cases below)" in attention
    )


def test_the_banner__a_next_look_already_past__says_it_is_due_not_a_time_gone_by():
    """An operator's walk: each look waited 10 s on the provider's timeouts, and the banner
    read "next look at 15:44:43" when that was already past. A next look in the past is due:
    the banner says since when it is due, not "next look at" a time gone by."""
    from datetime import UTC, datetime, timedelta

    from django.utils import timezone

    from payments.desk.evidence import Incident, incident_html

    due = timezone.now() - timedelta(seconds=40)
    found = Incident(
        since=datetime(2026, 12, 7, 3, 12, tzinfo=UTC),
        operations=4,
        in_flight=1,
        unreadable=3,
        next_look=due,
    )

    banner = text_of(incident_html(found))

    assert "next look at" not in banner
    assert "the next look has been due since" in banner
    assert "the provider's answers are slow" in banner


def test_query_now__finished_operations_in_the_selection__counted_apart_not_as_waiting(
    provider, operator, settings
):
    """An operator's walk: a bulk query over eight ticked rows, five of them finished long
    ago, read "0 settled, 6 still waiting, 2 not read": the finished ones had nothing to
    wait for. They are counted apart, each line says which of the four it is, and the
    one uncertain operation the provider could not read is the only one not read."""
    finished = [builders.succeeded(key=f"tally-done-{n}")[0] for n in range(2)]
    lost, _, _ = builders.uncertain(key="tally-lost", charged=False)
    provider_down(settings)
    selection = {
        "action": "query_selected",
        "_selected_action": [op.pk for op in finished] + [lost.pk],
    }

    response = client_for(operator).post(CHANGELIST, {**selection, "post": "yes"}, follow=True)

    page = response.content.decode()
    assert "0 settled, 0 still waiting, 1 not read, 2 with nothing to settle" in page
    report = page.split('class="desk-query-report"', 1)[1].split("</ul>", 1)[0]
    kinds = re.findall(r'<li class="desk-query-row desk-query-([a-z-]+)">', report)
    assert sorted(kinds) == ["not-read", "nothing", "nothing"]


@pytest.mark.django_db(transaction=True)
def test_mark_failed__a_request_in_flight__refused_even_after_a_look__and_names_the_object(
    provider, operator, queue, settings
):
    """An operator's walk: with a same-key request held in flight at the provider (409) and
    its list showing the declined intent, the red "Mark charge failed" was on (the look
    counted as asked) and its page said "No object at the provider is known" above that
    very intent; only the press was refused. The page now refuses as the press does (409,
    the wait named) and its plan names the object the look found."""
    op = flows.declined_charge_held_in_flight(provider, queue, "inc-held-mark")
    seen = StepClaim.objects.get(operation=op, step="charge").provider_view["reference"]
    url = reverse("admin:payments_operation_desk_step", args=[op.pk, "charge", "mark_failed"])

    response = client_for(operator).get(url)
    page = text(response)

    assert response.status_code == 409
    assert "in flight at the provider since" in page
    assert "No object at the provider is known" not in page
    plan = response.content.decode().split('<ul class="desk-plan">', 1)[1].split("</ul>", 1)[0]
    assert seen in plan  # the plan's own words, not the provider's table below them
    assert provider.state.wait_idle(timeout=10)


def test_refusals_name_the_state_in_words_not_its_code(provider, senior):
    """An operator's walk read "Start a new attempt is unavailable: it is needs_review"."""
    from payments.desk import services as desk

    op, _, _ = builders.uncertain(key="words-review", charged=False)
    builders.move(op, OperationState.NEEDS_REVIEW)
    retrying, _, _ = builders.uncertain(key="words-retrying", charged=False)
    builders.move(retrying, OperationState.RETRYING)

    with pytest.raises(desk.DeskError) as new_attempt:
        desk.start_new_attempt(op, user=senior, reason="try again")
    with pytest.raises(desk.DeskError) as resume:
        desk.resume(retrying, user=senior, reason="push it")

    assert "it is needs review; only a failed operation" in str(new_attempt.value)
    assert "it is retrying and will run" in str(resume.value)
    assert "needs_review" not in str(new_attempt.value)


def test_operation_page__the_grace_period_over__review_at_the_next_look_not_a_past_time(
    provider, viewer, settings
):
    """An operator's walk: a refund's page said "If it is still unknown at 23:14:03 it goes
    to review" at 23:14:17. Past the grace period, the move waits for the next look: the
    page says so instead of naming a time already gone."""
    from datetime import timedelta

    op, claim, _ = builders.uncertain(key="past-grace", charged=False)
    provider_down(settings)
    reconcile(operation_ids=[op.pk])  # a look: unanswered, still within the grace
    from payments.conf import payments_settings

    grace = payments_settings().reconcile_grace
    builders.backdate_last_request(claim, timedelta(seconds=grace + 60))

    page = text(client_for(viewer).get(change_url(op)))

    assert "it goes to review at its next look" in page and "The grace period ended at" in page
    assert "If it is still unknown at" not in page


def test_query_kind__a_look_that_could_not_read_is_not_read_whatever_its_words():
    """Review of the bulk query's kinds: a read-only look at a retrying operation whose
    lookup failed, a look that raised, and an operation no handler can ask were counted
    "still waiting" (amber) though nothing was read."""
    from payments.desk.evidence import query_kind

    failed_look = "read only, a worker may still run it: charge: lookup failed (ReadTimeout)"
    assert query_kind(failed_look) == "not-read"
    assert query_kind("error") == "not-read"
    assert query_kind("no_handler") == "not-read"
    assert query_kind("read only, a worker may still run it: charge: not found yet") == "waiting"
    assert query_kind("still_uncertain") == "waiting"
    assert query_kind("done") == "settled"


def test_new_attempt_page__during_an_incident__warns_it_waits_for_the_provider(
    provider, senior, settings
):
    """An operator's walk: with the incident banner up, "Start a new attempt" offered
    itself with no word of the outage, then waited 3.2 s for its correct refusal. Its
    page now says the provider is not answering, what that means for the new attempt's
    call, and when the press asks the provider first."""
    declined, _ = builders.declined(key="inc-new-attempt")
    lost = [builders.uncertain(key=f"inc-new-{n}", charged=False)[0] for n in range(3)]
    provider_down(settings)
    reconcile(operation_ids=[op.pk for op in lost])
    url = reverse("admin:payments_operation_desk", args=[declined.pk, "new_attempt"])

    page = text(client_for(senior).get(url))

    assert "is not answering now" in page
    assert "counts 3 operations waiting for an answer" in page
    assert "its step may fail or be left uncertain" in page
    assert "is refused until it answers" in page
