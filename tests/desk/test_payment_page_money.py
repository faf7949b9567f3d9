"""An order's Money box counts what the provider showed, and the page reads one moment.

Issue 37, findings 3 and 7, on the order's page: a refund not settled yet is in the Money
box (labelled so), a manual capture shows its hold, what was captured and what was
released, and a refund that finishes while the page is read is shown at one moment.

Transactional: the checkouts, refunds and captures run in a real worker against the real
fake provider (a claim must commit before its call), and the worker that finishes a refund
while the page reads runs on a connection of its own.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from payments.captures.handler import request_capture
from payments.checkout.orders import create_order
from payments.desk.views import payment
from payments.engine import fence, runtime
from payments.engine.effects import EffectResult
from payments.engine.failpoints import AFTER_PROVIDER_ACCEPT, hooked
from payments.engine.outcomes import Outcome
from payments.engine.recovery import reconcile
from payments.models import ClaimState, Operation, OperationState
from payments.refunds.handler import request_refund
from payments.shop.models import Order
from tests.support import flows
from tests.support.concurrency import on_another_connection
from tests.support.users import VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def order_page(order: Order) -> str:
    url = reverse("admin:shop_order_change", args=[order.pk])
    return client_for(make_user("vera", *VIEW)).get(url).content.decode()


def words(html: str) -> str:
    """The words of a piece of the page, without tags or repeated spaces."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def money_box(page: str) -> str:
    return words(page.split('id="desk-money-heading"', 1)[1].split("</fieldset>", 1)[0])


def number(page: str, name: str) -> str:
    """One figure of the Money box with its notes ("Refunded €0.00 refunds not settled...")."""
    return words(page.split(f'id="desk-{name}"', 1)[1].split("</div>", 1)[0].split(">", 1)[1])


def movement_rows(page: str, what: str) -> list[str]:
    """The words of each row of the charges and refunds table that is a `what`."""
    table = page.split('id="desk-movements"', 1)[1].split("</table>", 1)[0]
    return [
        words("<tr" + row)
        for row in table.split("<tbody>", 1)[1].split("<tr")[1:]
        if f"desk-movement-{what}" in row.split(">", 1)[0]
    ]


def uncertain_refund(provider, queue, *, key: str) -> tuple[Order, Operation]:
    """A €20.00 paid order and a €10.00 refund the provider made but whose answer was lost."""
    order = flows.paid_order(queue)
    provider.state.enqueue_faults("drop_after_accept", 1)
    op, _ = request_refund(order_id=order.pk, key=key, amount=1000, actor="t")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return order, op


def test_money_box__an_uncertain_refund__counted_as_not_settled_yet(provider, queue):
    """Finding 3: "An uncertain €10 refund is missing from the Money box"."""
    order, _ = uncertain_refund(provider, queue, key="money-uncertain")

    page = order_page(order)

    assert number(page, "refunded") == "Refunded €0.00 refunds not settled yet: €10.00"
    assert number(page, "net") == "Net €20.00"
    [row] = movement_rows(page, "refund")
    assert "€10.00" in row and "Uncertain" in row


def test_money_box__a_refund_the_provider_showed_succeeded__says_so(provider, queue):
    order, op = uncertain_refund(provider, queue, key="money-shown")
    claim = op.claims.get(step="refund")
    shown = {"status": "succeeded", "amount": 1000, "currency": "eur"}
    fence.note_provider_view(
        claim, EffectResult(Outcome.SUCCESS, reference="re_shown", data=shown), source="list"
    )

    refunded = number(order_page(order), "refunded")

    assert refunded == (
        "Refunded €0.00 refunds not settled yet: €10.00 (the provider showed €10.00 of it "
        "succeeded)"
    )


def test_money_box__a_refund_asked_and_not_claimed_yet__listed_and_not_settled_yet(provider, queue):
    """Right after a desk refund its operation is pending, with no step claimed yet."""
    order = flows.paid_order(queue)
    request_refund(order_id=order.pk, key="money-pending", amount=1000, actor="t")

    page = order_page(order)

    assert number(page, "refunded") == "Refunded €0.00 refunds not settled yet: €10.00"
    [row] = movement_rows(page, "refund")
    assert "€10.00" in row and "Pending" in row
    queue.empty()  # the refund's job is not run here


def captured(queue, *, amount: int, capture: int) -> tuple[Order, Operation]:
    order = create_order(amount=amount, currency="eur", email="capture@example.com")
    op, _ = request_capture(
        order_id=order.pk, key=f"cap-{order.pk}", payment_method="pm_card_visa",
        amount_to_capture=capture, actor="t",
    )  # fmt: skip
    run_worker(queue)
    op.refresh_from_db()
    return Order.objects.get(pk=order.pk), op


def test_capture__part_captured__the_hold_what_was_captured_and_the_rest_released(provider, queue):
    """Finding 3: a captured payment showed neither the €60 hold nor the €15 released, and
    its hold read "requires capture" once captured."""
    order, op = captured(queue, amount=6000, capture=4500)
    assert op.state == OperationState.SUCCEEDED

    page = order_page(order)

    assert number(page, "held") == "Held €60.00 €45.00 captured, €15.00 released"
    assert number(page, "charged") == "Charged €45.00"
    [hold] = movement_rows(page, "hold")
    assert "€60.00" in hold and "Done" in hold and "captured" in hold
    [release] = movement_rows(page, "release")
    assert "€15.00" in release and "released" in release
    assert "requires capture" not in words(page).lower()
    assert "requires_capture" not in page


def test_capture__given_up__the_whole_hold_released_nothing_charged(provider, queue):
    faults: list[int] = []

    def refuse_the_captures() -> None:
        if not faults:  # after the authorisation's 200: every capture try gets a 429
            faults.append(provider.state.enqueue_faults("rate_limit", 10))

    with hooked(AFTER_PROVIDER_ACCEPT, refuse_the_captures):
        order, op = captured(queue, amount=6000, capture=6000)
    assert op.claims.get(step="release").state == ClaimState.DONE

    page = order_page(order)

    assert number(page, "held") == "Held €60.00 €60.00 released"
    assert number(page, "charged") == "Charged €0.00"
    [release] = movement_rows(page, "release")
    assert "€60.00" in release and "Done" in release


def test_capture__held_not_captured_yet__says_so(provider, queue):
    """The hold is made, the capture's answer was lost: held, its capture not settled yet."""
    dropped: list[int] = []

    def drop_the_captures_answer() -> None:
        if not dropped:  # after the authorisation's 200: the capture's answer is lost
            dropped.append(provider.state.enqueue_faults("drop_after_accept", 1))

    with hooked(AFTER_PROVIDER_ACCEPT, drop_the_captures_answer):
        order, op = captured(queue, amount=6000, capture=4500)
    assert op.claims.get(step="capture").state == ClaimState.UNCERTAIN

    page = order_page(order)

    assert number(page, "held") == "Held €60.00 not captured yet (its capture is not settled)"
    [hold] = movement_rows(page, "hold")
    assert "held, its capture not settled yet" in hold


def test_order_page__a_refund_settled_while_the_page_reads__shown_at_one_moment(
    provider, queue, monkeypatch
):
    """Finding 7: the page read "Refunded €0.00" and the refund's row from its first reads,
    and the rest after the refund was settled ("Two moments on one page"). Here the
    reconciler and a worker settle an uncertain refund (on their own connection) right after
    the page read the order's operations and their steps: every part of the page shows the
    same moment, before or after."""
    order, refund = uncertain_refund(provider, queue, key="one-moment")
    read = payment.audit_duplicates  # read after the operations and their steps

    def read_then_the_refund_settles(*args, **kwargs):
        found = read(*args, **kwargs)
        if Operation.objects.get(pk=refund.pk).state == OperationState.UNCERTAIN:

            def settle() -> None:
                reconcile(operation_ids=[refund.pk])
                runtime.execute(refund.pk, worker_id="worker-b/1")

            on_another_connection(settle)
        return found

    monkeypatch.setattr(payment, "audit_duplicates", read_then_the_refund_settles)

    page = order_page(order)

    queue.empty()  # the job the reconciler enqueued ran above
    assert Operation.objects.get(pk=refund.pk).state == OperationState.SUCCEEDED
    timeline = page.split('id="desk-timeline"', 1)[1].split("</table>", 1)[0]
    done = [words(r) for r in timeline.split("<tr")[1:] if "/ refund" in r and "→ done" in r]
    [row] = movement_rows(page, "refund")
    refunded = number(page, "refunded")
    before = not done and "Uncertain" in row and refunded.startswith("Refunded €0.00 refunds not")
    after = bool(done) and "Succeeded" in row and refunded == "Refunded €10.00"
    assert before or after, (money_box(page), row, done)


def test_order_page__status_field_and_money_box__read_at_one_moment(provider, queue, monkeypatch):
    """Finding 7 as the operator saw it: "Partially refunded" (the order's field) beside
    "Refunded €0.00" (the Money box). The refund is settled right after the payment's part
    of the page was read, before the admin reads the order's fields."""
    import payments.shop.admin

    order, refund = uncertain_refund(provider, queue, key="one-moment-fields")
    read = payments.shop.admin.payment_context

    def read_then_the_refund_settles(*args, **kwargs):
        context = read(*args, **kwargs)

        def settle() -> None:
            reconcile(operation_ids=[refund.pk])
            runtime.execute(refund.pk, worker_id="worker-b/1")

        on_another_connection(settle)
        return context

    monkeypatch.setattr(payments.shop.admin, "payment_context", read_then_the_refund_settles)

    page = order_page(order)

    queue.empty()
    status = words(
        page.split("field-status", 1)[1].split('class="readonly">', 1)[1].split("<", 1)[0]
    )
    refunded = number(page, "refunded")
    assert ("Partially refunded" in status) == (refunded == "Refunded €10.00"), (status, refunded)
