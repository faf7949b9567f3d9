"""The checkout's API: create and show orders, ask for a checkout (202; a worker charges)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from payments.api.base import (
    caller_client,
    idempotency_conflict,
    idempotency_key,
    optional_idempotency_key,
    start_operation,
    validated,
)
from payments.api.fields import (
    ERRORS,
    PAYMENT_METHOD_PATTERN,
    PatternField,
    StrictEmailField,
    StrictIntegerField,
)
from payments.api.schema import ORDER_ID, idempotency_key_header
from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import CURRENCIES, create_order, create_order_once
from payments.exceptions import OperationConflict
from payments.shop.api import caller_order, order_not_found
from payments.shop.models import Order

MAX_AMOUNT = 99_999_999  # the provider's limit for one charge, in minor units

ORDER_EXAMPLE = {
    "id": 42,
    "amount": 1999,
    "currency": "eur",
    "email": "a@example.com",
    "status": "pending",
    "refunded_amount": 0,
    "created_at": "2026-01-01T12:00:00+00:00",
}
EXAMPLES = {
    "order_in": OpenApiExample(
        "An order",
        value={"amount": 1999, "currency": "eur", "email": "a@example.com"},
        request_only=True,
    ),
    "order_out": OpenApiExample("The order", value=ORDER_EXAMPLE, response_only=True),
    "created": OpenApiExample(
        "Created", value=ORDER_EXAMPLE, response_only=True, status_codes=["201"]
    ),
    "checkout_in": OpenApiExample(
        "A card", value={"payment_method": "pm_card_visa"}, request_only=True
    ),
    "accepted": OpenApiExample(
        "Accepted",
        value={"operation": "checkout-42-1", "state": "pending", "order": 42},
        response_only=True,
        status_codes=["202"],
    ),
}


class OrderIn(serializers.Serializer):
    amount = StrictIntegerField(min_value=1, max_value=MAX_AMOUNT, help_text="Minor units.")
    currency = serializers.ChoiceField(
        choices=sorted(CURRENCIES | {c.upper() for c in CURRENCIES}),
        help_text="ISO 4217, either case.",
    )
    email = StrictEmailField(
        help_text="ASCII only: 1-64 characters before the @, a domain with a dot (an "
        "internationalised domain in its xn-- form; stored lower-cased)."
    )

    def validate_currency(self, value: str) -> str:
        return value.lower()


class OrderOut(serializers.Serializer):
    id = serializers.IntegerField()
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    email = serializers.EmailField()
    status = serializers.CharField()
    refunded_amount = serializers.IntegerField()
    created_at = serializers.DateTimeField()


class CheckoutIn(serializers.Serializer):
    payment_method = PatternField(
        PAYMENT_METHOD_PATTERN,
        "A payment method is the provider's id of one: 1-255 printable ASCII, no spaces.",
        max_length=255,
        help_text="The provider's payment method id (pm_...).",
    )


class Accepted(serializers.Serializer):
    operation = serializers.CharField()
    state = serializers.CharField()
    order = serializers.IntegerField()


def order_json(order: Order) -> dict[str, Any]:
    return {
        "id": order.pk,
        "amount": order.amount,
        "currency": order.currency,
        "email": order.customer_email,
        "status": order.status,
        "refunded_amount": order.refunded_amount,
        "created_at": order.created_at.isoformat(),
    }


@extend_schema(
    request=OrderIn,
    responses={201: OrderOut, **ERRORS},
    parameters=[
        idempotency_key_header(
            required=False,
            description="Optional here: a retry with the same key and body answers the same order.",
        )
    ],
    examples=[EXAMPLES["order_in"], EXAMPLES["created"]],
    operation_id="create_order",
)
@api_view(["POST"])
def orders(request: Request) -> Response:
    """Create an order: {"amount": 1999, "currency": "eur", "email": "a@example.com"}.

    With an Idempotency-Key, a retry answers the order the key created
    (`Idempotent-Replayed: true`), and the key with another body is 409.
    """
    key = optional_idempotency_key(request)  # a bad key is the first thing to say
    data = validated(OrderIn, request)
    values = {"amount": data["amount"], "currency": data["currency"], "email": data["email"]}
    client = caller_client(request)
    if key is None:
        return Response(order_json(create_order(client=client, **values)), status=201)
    try:
        order, created = create_order_once(key=key, client=client, **values)
    except OperationConflict as exc:
        raise idempotency_conflict(exc) from None
    response = Response(order_json(order), status=201)
    if not created:
        response["Idempotent-Replayed"] = "true"
    return response


@extend_schema(
    responses={200: OrderOut, **ERRORS},
    parameters=[ORDER_ID],
    examples=[EXAMPLES["order_out"]],
    operation_id="get_order",
)
@api_view(["GET"])
def order_detail(request: Request, order_id: int) -> Response:
    """Show one of your orders (another client's is 404, as an unknown one)."""
    return Response(order_json(caller_order(request, order_id)))


@extend_schema(
    request=CheckoutIn,
    responses={202: Accepted, **ERRORS},
    parameters=[
        ORDER_ID,
        idempotency_key_header(required=True, description="The same key again replays."),
    ],
    examples=[EXAMPLES["checkout_in"], EXAMPLES["accepted"]],
    operation_id="checkout_order",
)
@api_view(["POST"])
def checkout(request: Request, order_id: int) -> Response:
    """Ask for a checkout; 202 with the operation key. A worker charges the order."""
    idempotency_key(request)  # a missing key is the first thing to say, before the body
    data = validated(CheckoutIn, request)
    order = caller_order(request, order_id)  # another client's order: 404, nothing written
    return start_operation(
        request,
        lambda key, client: request_checkout(
            order_id=order.pk,
            key=key,
            payment_method=data["payment_method"],
            actor="api",
            client=client,
        ),
        not_found=order_not_found(order_id),
        not_allowed=(CheckoutNotAllowed, "order_not_open"),
        order=order_id,
    )
