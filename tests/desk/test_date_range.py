"""Operations and orders filtered by a range of days (both included)."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.utils import timezone

from payments.engine.writes import fence_writes
from payments.models import Operation, Order
from tests.support import builders
from tests.support.users import VIEW, client_for, make_user

pytestmark = pytest.mark.django_db


def created_on(op: Operation, day: str) -> None:
    at = timezone.make_aware(datetime.fromisoformat(f"{day}T12:00:00"))
    with fence_writes():  # hand-made dates, as the test says
        Operation.objects.filter(pk=op.pk).update(created_at=at)
    Order.objects.filter(pk=int(op.entity_id)).update(created_at=at)


def test_date_range__operations_and_orders_from_and_to_a_day(provider):
    early, late = builders.new_checkout("early"), builders.new_checkout("late")
    created_on(early, "2026-11-01")
    created_on(late, "2026-11-20")
    client = client_for(make_user("vera", *VIEW))
    one_day = {"created_at__from": "2026-11-20", "created_at__to": "2026-11-20"}

    operations = client.get("/admin/payments/operation/", one_day)
    orders = client.get("/admin/payments/order/", {"created_at__to": "2026-11-02"})
    everything = client.get("/admin/payments/operation/")

    assert [op.key for op in operations.context["cl"].result_list] == ["late"]
    assert [o.pk for o in orders.context["cl"].result_list] == [int(early.entity_id)]
    assert everything.context["cl"].result_count == 2
    assert 'type="date" name="created_at__from" value="2026-11-20"' in operations.content.decode()
