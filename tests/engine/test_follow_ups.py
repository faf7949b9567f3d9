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

from payments.engine import follow_ups, handlers
from payments.entities import ORDER_CONFIRMATION, ORDER_PAID
from payments.entities import follow_ups as paid_order_kinds
from payments.exceptions import ConfigurationError
from payments.fence import Follows, message
from payments.models import ClaimState, Operation, OperationState
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

    assert NOTIFY in paid_order_kinds()
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
    assert NOTIFY not in paid_order_kinds()


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
