"""The checkout's API: create and show orders, ask for a checkout (202; a worker charges)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.http import HttpRequest, JsonResponse

from payments.api.base import ApiError, api_view, idempotency_key, json_body, start_operation
from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import CURRENCIES, create_order
from payments.models import Order

MAX_PAYMENT_METHOD_LENGTH = 255
MAX_AMOUNT = 99_999_999  # the provider's limit for one charge, in minor units


def _order_json(order: Order) -> dict[str, Any]:
    return {
        "id": order.pk,
        "amount": order.amount,
        "currency": order.currency,
        "email": order.customer_email,
        "status": order.status,
        "refunded_amount": order.refunded_amount,
        "created_at": order.created_at.isoformat(),
    }


@api_view("POST")
def orders(request: HttpRequest) -> JsonResponse:
    """Create an order: {"amount": 1999, "currency": "eur", "email": "a@example.com"}."""
    body = json_body(request)
    amount = body.get("amount")
    if "amount" not in body:
        raise ApiError(400, "missing_field", "amount is required.", "amount")
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ApiError(400, "invalid_field", "amount must be an integer (minor units).", "amount")
    if not 0 < amount <= MAX_AMOUNT:
        raise ApiError(400, "invalid_field", f"amount must be 1..{MAX_AMOUNT}.", "amount")
    currency = body.get("currency")
    if "currency" not in body:
        raise ApiError(400, "missing_field", "currency is required.", "currency")
    if not isinstance(currency, str) or currency.lower() not in CURRENCIES:
        raise ApiError(400, "invalid_field", "currency must be a known ISO 4217 code.", "currency")
    email = body.get("email")
    if "email" not in body:
        raise ApiError(400, "missing_field", "email is required.", "email")
    try:
        if not isinstance(email, str) or len(email) > 254:
            raise ValidationError("not a string")
        validate_email(email)
    except ValidationError:
        raise ApiError(400, "invalid_field", "email must be a valid address.", "email") from None
    order = create_order(amount=amount, currency=currency, email=email)
    return JsonResponse(_order_json(order), status=201)


@api_view("GET")
def order_detail(request: HttpRequest, order_id: int) -> JsonResponse:
    """Show one order."""
    order = Order.objects.filter(pk=order_id).first()
    if order is None:
        raise ApiError(404, "order_not_found", f"Order {order_id} does not exist.")
    return JsonResponse(_order_json(order))


@api_view("POST")
def checkout(request: HttpRequest, order_id: int) -> JsonResponse:
    """Ask for a checkout; 202 with the operation key. Needs an Idempotency-Key header."""
    idempotency_key(request)  # a missing key is the first thing to say, before the body
    body = json_body(request)
    payment_method = body.get("payment_method")
    if "payment_method" not in body:
        raise ApiError(400, "missing_field", "payment_method is required.", "payment_method")
    if (
        not isinstance(payment_method, str)
        or not payment_method.strip()
        or len(payment_method) > MAX_PAYMENT_METHOD_LENGTH
    ):
        raise ApiError(
            400, "invalid_field", "payment_method must be a non-empty string.", "payment_method"
        )
    return start_operation(
        request,
        lambda key: request_checkout(
            order_id=order_id, key=key, payment_method=payment_method, actor="api"
        ),
        not_found=ApiError(404, "order_not_found", f"Order {order_id} does not exist."),
        not_allowed=(CheckoutNotAllowed, "order_not_open"),
        order=order_id,
    )
