"""The capture's API: `POST /api/orders/<id>/captures` with an Idempotency-Key; 202."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from payments.api.base import idempotency_key, validated
from payments.api.fields import ERRORS, PAYMENT_METHOD_PATTERN, PatternField, StrictIntegerField
from payments.api.schema import MAX_ID, ORDER_ID, idempotency_key_header
from payments.captures.handler import CaptureNotAllowed, request_capture
from payments.fence import start_operation
from payments.shop.api import caller_order, order_not_found


class CaptureIn(serializers.Serializer):
    payment_method = PatternField(
        PAYMENT_METHOD_PATTERN,
        "A payment method is the provider's id of one: 1-255 printable ASCII, no spaces.",
        max_length=255,
        help_text="The provider's payment method id (pm_...).",
    )
    amount_to_capture = StrictIntegerField(
        min_value=1,
        max_value=MAX_ID,
        required=False,
        help_text="Minor units to capture of the hold (default: the order's amount).",
    )


class CaptureAccepted(serializers.Serializer):
    operation = serializers.CharField()
    state = serializers.CharField()
    order = serializers.IntegerField()


@extend_schema(
    request=CaptureIn,
    responses={202: CaptureAccepted, **ERRORS},
    parameters=[
        ORDER_ID,
        idempotency_key_header(required=True, description="The same key again replays."),
    ],
    examples=[
        OpenApiExample(
            "Capture part",
            value={"payment_method": "pm_card_visa", "amount_to_capture": 1500},
            request_only=True,
        ),
        OpenApiExample(
            "Accepted",
            value={"operation": "capture-42-1", "state": "pending", "order": 42},
            response_only=True,
            status_codes=["202"],
        ),
    ],
    operation_id="capture_order",
)
@api_view(["POST"])
def captures(request: Request, order_id: int) -> Response:
    """Hold a new order's amount on the card, then capture all or part of it; 202.

    An order tried before, or more than its amount, is 409 `capture_not_allowed`.
    """
    idempotency_key(request)
    data = validated(CaptureIn, request)
    order = caller_order(request, order_id)  # another client's order: 404, nothing written
    return start_operation(
        request,
        lambda key, client: request_capture(
            order_id=order.pk,
            key=key,
            payment_method=data["payment_method"],
            amount_to_capture=data.get("amount_to_capture"),
            actor="api",
            client=client,
        ),
        not_found=order_not_found(order_id),
        not_allowed=(CaptureNotAllowed, "capture_not_allowed"),
        order=order_id,
    )
