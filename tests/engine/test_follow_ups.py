"""A package adds what follows a paid order by declaring it on its own operation.

Before, the follow-ups of a paid order were an if-chain in payments/entities.py that
each new system's package had to edit (the invoice export did), and an e-mail
provider's confirmation was sent beside the checkout's own (twice). Here an
operation declared in this module, outside every business package, follows the
paid order: the checkout writes it, the worker delivers it, and a follow-up that
replaces the checkout's confirmation e-mail keeps the checkout from sending its own.
Transactional: the in-process worker reads committed rows.
"""

from __future__ import annotations

import pytest
from django.core import mail
from django.db import transaction

from payments.captures.handler import request_capture
from payments.checkout import handler as checkout_handler
from payments.checkout.orders import create_order
from payments.engine import follow_ups, handlers
from payments.exceptions import ConfigurationError
from payments.fence import Follows, create_operation_in_tx, kinds_following, message
from payments.models import ClaimState, Operation, OperationState
from payments.shop.entities import ORDER_CONFIRMATION, ORDER_PAID
from tests.support import flows
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

NOTIFY = "test_notify_shop"
CONFIRM = "test_confirm_by_mailer"


@pytest.fixture(autouse=True)
def own_registries(monkeypatch):
    """Declarations made by a test are forgotten after it."""
    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    monkeypatch.setattr(follow_ups, "_FOLLOW_UPS", list(follow_ups._FOLLOW_UPS))


def declare(kind: str, follows: Follows) -> list[int]:
    """A message operation of `kind` following `follows`; returns the orders it saw."""
    seen: list[int] = []

    @message(kind, consumer=kind, follows=follows)
    def deliver(op: Operation) -> None:
        seen.append(op.params["order_id"])

    return seen


def test_an_operation_declared_to_follow_a_paid_order__is_written_and_delivered(provider, queue):
    seen = declare(NOTIFY, Follows(ORDER_PAID))
    order, op = flows.order_and_checkout(key="follows-1")

    run_worker(queue)

    assert NOTIFY in kinds_following(ORDER_PAID)
    (notify,) = Operation.objects.filter(parent=op, kind=NOTIFY)
    assert notify.state == OperationState.SUCCEEDED
    assert seen == [order.pk]
    assert len(mail.outbox) == 1  # the checkout's own confirmation: nothing replaces it


def test_a_follow_up_switched_off_by_its_when__is_not_written(provider, queue):
    declare(NOTIFY, Follows(ORDER_PAID, when=lambda: False))
    _, op = flows.order_and_checkout(key="follows-2")

    run_worker(queue)

    assert Operation.objects.get(pk=op.pk).state == OperationState.SUCCEEDED
    assert not Operation.objects.filter(parent=op, kind=NOTIFY).exists()
    assert NOTIFY not in kinds_following(ORDER_PAID)


def test_a_follow_up_replacing_the_confirmation__the_checkout_sends_none_of_its_own(
    provider, queue
):
    seen = declare(CONFIRM, Follows(ORDER_PAID, replaces=ORDER_CONFIRMATION))
    order, op = flows.order_and_checkout(key="follows-3")

    run_worker(queue)

    assert mail.outbox == []  # the customer is confirmed once, by the follow-up
    assert seen == [order.pk]
    email = op.claims.get(step="confirmation_email")
    assert email.state == ClaimState.DONE
    assert (email.result["sent"], email.result["sent_by"]) == (False, CONFIRM)


def test_a_kind_declared_to_follow_the_same_event_twice_otherwise__is_refused():
    declare(NOTIFY, Follows(ORDER_PAID))
    with pytest.raises(ConfigurationError, match="already declared a follow-up"):
        follow_ups.declare_follow_up(NOTIFY, Follows(ORDER_PAID, replaces=ORDER_CONFIRMATION))


@pytest.mark.parametrize("at_email, at_mark_paid", [(True, False), (False, True)])
def test_when_changes_between_the_email_and_mark_paid__the_customer_is_confirmed_once(
    at_email, at_mark_paid, provider, queue, monkeypatch
):
    """The deployment turns the replacing follow-up on or off between the checkout's
    e-mail step and mark_paid (a retry, a desk resume, a rolling deploy): what the e-mail
    step recorded decides, never the settings read again."""
    on = {"now": at_email}
    seen = declare(
        CONFIRM, Follows(ORDER_PAID, when=lambda: on["now"], replaces=ORDER_CONFIRMATION)
    )
    mark_paid = checkout_handler.mark_paid

    def settings_changed_meanwhile(*args):
        on["now"] = at_mark_paid
        return mark_paid(*args)

    monkeypatch.setattr(checkout_handler, "mark_paid", settings_changed_meanwhile)
    order, op = flows.order_and_checkout(key=f"follows-flip-{at_email}")

    run_worker(queue)

    confirmations = len(mail.outbox) + len(seen)
    assert confirmations == 1, (mail.outbox, seen)
    assert Operation.objects.filter(parent=op, kind=CONFIRM).exists() is at_email


def test_two_follow_ups_replacing_the_same_effect__the_second_is_refused():
    declare(CONFIRM, Follows(ORDER_PAID, replaces=ORDER_CONFIRMATION))
    with pytest.raises(ConfigurationError, match="both replace 'order_confirmation'"):
        declare(NOTIFY, Follows(ORDER_PAID, replaces=ORDER_CONFIRMATION))


def test_a_captured_order__gets_no_replacing_follow_up__the_capture_sends_no_confirmation(
    provider, queue
):
    seen = declare(CONFIRM, Follows(ORDER_PAID, replaces=ORDER_CONFIRMATION))
    order = create_order(amount=3000, currency="eur", email="cap@example.com")
    op, _ = request_capture(
        order_id=order.pk, key="follows-cap", payment_method="pm_card_visa", actor="t"
    )

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    assert seen == [] and mail.outbox == []
    assert not Operation.objects.filter(parent=op, kind=CONFIRM).exists()


def test_two_tenants_messages_under_one_key__each_delivered_once(queue):
    """A message operation's job id is its inbox message id: named by its key alone, two
    tenants' equal keys made one job (the second enqueue replaced the first) and one
    inbox row (the first skipped as the second's duplicate, its handler never run)."""
    seen: list[str] = []

    @message(NOTIFY, consumer=NOTIFY)
    def deliver(op: Operation) -> None:
        seen.append(op.tenant)

    ops = []
    for tenant in ("hotel:1", "hotel:2"):
        with transaction.atomic():
            op, _ = create_operation_in_tx(
                key="booking-7", kind=NOTIFY, entity_type="booking", entity_id="7",
                params={}, actor="t", tenant=tenant,
            )  # fmt: skip
        ops.append(op)

    run_worker(queue)

    assert ops[0].job_id != ops[1].job_id
    assert sorted(seen) == ["hotel:1", "hotel:2"]
    states = Operation.objects.filter(pk__in=[o.pk for o in ops]).values_list("state", flat=True)
    assert list(states) == [OperationState.SUCCEEDED] * 2
