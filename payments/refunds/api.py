"""The refund's API: `POST /api/orders/<id>/refunds {"amount": 500}` with an Idempotency-Key."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from payments.api.base import (
    idempotency_key,
    start_operation,
    validated,
)
from payments.api.fields import ERRORS, StrictIntegerField
from payments.api.schema import MAX_ID, ORDER_ID, idempotency_key_header
from payments.refunds.handler import RefundNotAllowed, request_refund
from payments.shop.api import caller_order, order_not_found


class RefundIn(serializers.Serializer):
    amount = StrictIntegerField(
        min_value=1, max_value=MAX_ID, help_text="Minor units to give back."
    )


class RefundAccepted(serializers.Serializer):
    operation = serializers.CharField()
    state = serializers.CharField()
    order = serializers.IntegerField()
    amount = serializers.IntegerField()


@extend_schema(
    request=RefundIn,
    responses={202: RefundAccepted, **ERRORS},
    parameters=[
        ORDER_ID,
        idempotency_key_header(required=True, description="The same key again replays."),
    ],
    examples=[
        OpenApiExample("Part of the charge", value={"amount": 500}, request_only=True),
        OpenApiExample(
            "Accepted",
            value={"operation": "refund-42-1", "state": "pending", "order": 42, "amount": 500},
            response_only=True,
            status_codes=["202"],
        ),
    ],
    operation_id="refund_order",
)
@api_view(["POST"])
def refunds(request: Request, order_id: int) -> Response:
    """Ask for a refund of `amount` minor units of a paid order; 202 with the operation key.

    The sum of an order's refunds never exceeds what was charged: a refund that
    would (refunds in flight counted) is 409 `refund_not_allowed`.
    """
    idempotency_key(request)
    amount = int(validated(RefundIn, request)["amount"])
    order = caller_order(request, order_id)  # another client's order: 404, nothing written
    return start_operation(
        request,
        lambda key, client: request_refund(
            order_id=order.pk, key=key, amount=amount, actor="api", client=client
        ),
        not_found=order_not_found(order_id),
        not_allowed=(RefundNotAllowed, "refund_not_allowed"),
        order=order_id,
        amount=amount,
    )
