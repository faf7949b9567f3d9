"""Operations and orders filtered by a range of days (both included)."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.utils import timezone

from payments.engine.writes import fence_writes
from payments.models import Operation
from payments.shop.models import Order
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
    orders = client.get("/admin/shop/order/", {"created_at__to": "2026-11-02"})
    everything = client.get("/admin/payments/operation/")

    assert [op.key for op in operations.context["cl"].result_list] == ["late"]
    assert [o.pk for o in orders.context["cl"].result_list] == [int(early.entity_id)]
    assert everything.context["cl"].result_count == 2
    assert 'type="date" name="created_at__from" value="2026-11-20"' in operations.content.decode()


@pytest.mark.parametrize("changelist", ["/admin/payments/operation/", "/admin/shop/order/"])
def test_date_range__to_the_last_day_of_the_calendar__every_row_no_error(provider, changelist):
    created_on(builders.new_checkout("late"), "2026-11-20")
    client = client_for(make_user("vera", *VIEW))

    response = client.get(changelist, {"created_at__to": "9999-12-31"})

    assert response.status_code == 200
    assert response.context["cl"].result_count == 1


@pytest.mark.parametrize("changelist", ["/admin/payments/operation/", "/admin/shop/order/"])
@pytest.mark.parametrize("bad", ["2026-02-30", "abc"])
def test_date_range__a_day_that_is_no_date__named_in_a_message_not_filtered(
    provider, changelist, bad
):
    created_on(builders.new_checkout("late"), "2026-11-20")
    client = client_for(make_user("vera", *VIEW))

    response = client.get(changelist, {"created_at__from": bad})

    assert response.status_code == 200
    assert response.context["cl"].result_count == 1  # not filtered by it
    said = [str(m) for m in response.context["messages"]]
    assert any(f"“{bad}” is not a day" in m for m in said), said
