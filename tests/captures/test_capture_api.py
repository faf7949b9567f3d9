"""`POST /api/orders/<id>/captures`: 202 with the operation, a replay, a refusal (409)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from payments.checkout.orders import create_order
from payments.models import Operation
from payments.shop.models import OrderStatus

pytestmark = pytest.mark.django_db


def post_capture(settings, order_id: int, body: dict, key: str):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {settings.API_TOKEN}")
    return client.post(
        f"/api/orders/{order_id}/captures",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )


def test_capture_request__202_then_the_same_key_replays(settings, queue):
    order = create_order(amount=4000, currency="eur", email="api@example.com")
    body = {"payment_method": "pm_card_visa", "amount_to_capture": 2500}

    first = post_capture(settings, order.pk, body, "cap-api-1")
    again = post_capture(settings, order.pk, body, "cap-api-1")

    assert first.status_code == 202, first.content
    assert first.json()["order"] == order.pk
    assert again.status_code == 202 and again["Idempotent-Replayed"] == "true"
    (op,) = Operation.objects.filter(kind="capture")
    assert op.params["amount_to_capture"] == 2500
    order.refresh_from_db()
    assert order.status == OrderStatus.PROCESSING


def test_capture_request__more_than_the_order_or_a_second_key__is_409(settings, queue):
    order = create_order(amount=4000, currency="eur", email="api@example.com")
    too_much = post_capture(
        settings, order.pk, {"payment_method": "pm_card_visa", "amount_to_capture": 4001}, "k1"
    )
    assert (too_much.status_code, too_much.json()["error"]["code"]) == (
        409,
        "capture_not_allowed",
    )
    assert (
        post_capture(settings, order.pk, {"payment_method": "pm_card_visa"}, "k2").status_code
        == 202
    )
    second = post_capture(settings, order.pk, {"payment_method": "pm_card_visa"}, "k3")
    assert second.status_code == 409
    assert Operation.objects.filter(kind="capture").count() == 1
