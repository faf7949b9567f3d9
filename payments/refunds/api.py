"""The refund's API: `POST /api/orders/<id>/refunds {"amount": 500}` with an Idempotency-Key."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from payments.api.base import (
    caller_order,
    idempotency_key,
    json_object,
    order_not_found,
    start_operation,
)
from payments.api.fields import ERRORS, StrictIntegerField
from payments.refunds.handler import RefundNotAllowed, request_refund


class RefundIn(serializers.Serializer):
    amount = StrictIntegerField(min_value=1, help_text="Minor units to give back.")


class RefundAccepted(serializers.Serializer):
    operation = serializers.CharField()
    state = serializers.CharField()
    order = serializers.IntegerField()
    amount = serializers.IntegerField()


@extend_schema(
    request=RefundIn,
    responses={202: RefundAccepted, **ERRORS},
    parameters=[OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER, required=True)],
    operation_id="refund_order",
)
@api_view(["POST"])
def refunds(request: Request, order_id: int) -> Response:
    """Ask for a refund of `amount` minor units of a paid order; 202 with the operation key.

    The sum of an order's refunds never exceeds what was charged: a refund that
    would (refunds in flight counted) is 409 `refund_not_allowed`.
    """
    idempotency_key(request)
    serializer = RefundIn(data=json_object(request))
    serializer.is_valid(raise_exception=True)
    amount = int(serializer.validated_data["amount"])
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
