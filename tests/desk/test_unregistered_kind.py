"""An operation whose kind no handler registers any more (a deploy renamed or removed it).

The runtime sends such an operation to a person ("no handler registered for
operation kind ..."): the desk must then show it, say why nothing can be done
from it, and never answer 500. Each page is the real admin view.
"""

from __future__ import annotations

import html

import pytest
from django.urls import reverse

from payments.engine.writes import fence_writes
from payments.models import Operation, OperationState
from tests.support import builders
from tests.support.users import NEW_ATTEMPT, RECONCILE, VIEW, client_for, make_user

pytestmark = pytest.mark.django_db

GONE = "renamed_away"


@pytest.fixture
def rosa(db):
    return make_user("rosa", *VIEW, RECONCILE, NEW_ATTEMPT, "shop.refund_order")


def kind_gone(state: OperationState) -> Operation:
    """An uncertain charge, moved to `state`, whose kind a deploy then renamed."""
    op, _claim, _ = builders.uncertain(key="gone-kind", charged=True)
    builders.move(op, state, reason="no handler registered", last_error="no handler registered")
    with fence_writes():
        Operation.objects.filter(pk=op.pk).update(kind=GONE)
    op.refresh_from_db()
    return op


@pytest.mark.parametrize(
    "state", [OperationState.NEEDS_REVIEW, OperationState.UNCERTAIN, OperationState.FAILED]
)
def test_operation_page__shown__every_action_refused_with_why(provider, rosa, state):
    op = kind_gone(state)

    page = client_for(rosa).get(reverse("admin:payments_operation_change", args=[op.pk]))

    assert page.status_code == 200
    text = html.unescape(page.content.decode())
    assert f"no handler is registered for kind {GONE!r}" in text


@pytest.mark.parametrize(
    "url",
    [
        lambda op: reverse("admin:shop_order_change", args=[op.entity_id]),
        lambda op: reverse("admin:shop_order_refund", args=[op.entity_id]),
        lambda op: reverse("admin:payments_operation_changelist") + "?q=gone-kind",
        lambda op: reverse("admin:payments_operation_changelist"),
        lambda op: reverse("admin:payments_operation_needs_attention"),
        lambda op: reverse("admin:index"),
    ],
    ids=["payment", "refund", "search", "operations", "attention", "index"],
)
def test_the_other_pages__shown(provider, rosa, url):
    op = kind_gone(OperationState.NEEDS_REVIEW)

    assert client_for(rosa).get(url(op)).status_code == 200


@pytest.mark.parametrize("method", ["get", "post"])
def test_every_desk_action__refused_with_why__nothing_changed(provider, rosa, method):
    from payments.desk.views.actions import DESK_ACTIONS
    from payments.models import OperationEvent, StepClaim

    op = kind_gone(OperationState.NEEDS_REVIEW)
    before = (op.state, OperationEvent.objects.count(), list(StepClaim.objects.values()))
    client = client_for(rosa)
    for action in DESK_ACTIONS.values():
        url = (
            reverse("admin:payments_operation_desk_step", args=[op.pk, "charge", action.name])
            if action.per_step
            else reverse("admin:payments_operation_desk", args=[op.pk, action.name])
        )
        data = {"reason": "checked", "reference": "pi_x", "confirm": "on"}
        answer = getattr(client, method)(url, data if method == "post" else None, follow=True)

        assert answer.status_code in (200, 409), action.name
        assert f"no handler is registered for kind {GONE!r}" in html.unescape(
            answer.content.decode()
        ), action.name
    op.refresh_from_db()
    assert (op.state, OperationEvent.objects.count(), list(StepClaim.objects.values())) == before


def test_bulk_query__the_operation_without_a_handler_reported__the_other_queried(provider, rosa):
    from payments.models import ClaimState, StepClaim

    gone = kind_gone(OperationState.NEEDS_REVIEW)
    other, other_claim, _ = builders.uncertain(key="still-known", charged=True)
    changelist = reverse("admin:payments_operation_changelist")
    selection = {"action": "query_selected", "_selected_action": [gone.pk, other.pk]}
    client = client_for(rosa)

    confirm = client.post(changelist, selection)
    done = client.post(changelist, {**selection, "post": "yes"}, follow=True)

    assert confirm.status_code == done.status_code == 200
    report = html.unescape(done.content.decode()).split('class="messagelist"', 1)[1]
    assert "gone-kind</a>: no handler (state unchanged: needs review)" in report
    assert StepClaim.objects.get(pk=other_claim.pk).state == ClaimState.DONE


@pytest.mark.django_db(transaction=True)  # the outage's refund runs on a worker
def test_needs_attention__a_case_failed_before_running_whose_kind_lost_its_handler(
    provider, queue, rosa
):
    """A review's catch: the case's words name where a new attempt is asked, from the
    kind's handler; with none, Needs attention answered 500."""
    from tests.support import flows

    refund = flows.refund_failed_by_an_outage(provider, queue, key="outage-refund")
    with fence_writes():
        Operation.objects.filter(pk=refund.pk).update(kind=GONE)

    page = client_for(rosa).get(reverse("admin:payments_operation_needs_attention"))

    assert page.status_code == 200
    assert f"no handler is registered for kind {GONE!r}" in html.unescape(page.content.decode())


@pytest.mark.django_db(transaction=True)  # the checkout runs on a worker
def test_payment_page__a_charge_whose_kind_lost_its_handler__said_not_counted(
    provider, queue, rosa
):
    """A review's catch: the order's page read "Charged €0.00" for an order charged by an
    operation whose kind no handler registers now, without a word."""
    from tests.support import flows

    order = flows.paid_order(queue, amount=2500, key="paid-then-renamed")
    with fence_writes():
        Operation.objects.filter(key="paid-then-renamed").update(kind=GONE)

    page = client_for(rosa).get(reverse("admin:shop_order_change", args=[order.pk]))

    text = html.unescape(page.content.decode())
    assert page.status_code == 200
    assert "Not counted above:" in text and "paid-then-renamed" in text.split("Not counted")[1]
