"""The refund's API: `POST /api/orders/<id>/refunds {"amount": 500}` with an Idempotency-Key."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from payments.api.base import ApiError, api_view, idempotency_key, json_body, start_operation
from payments.refunds.handler import RefundNotAllowed, request_refund


@api_view("POST")
def refunds(request: HttpRequest, order_id: int) -> JsonResponse:
    """Ask for a refund of `amount` minor units of a paid order; 202 with the operation key.

    The sum of an order's refunds never exceeds what was charged: a refund that
    would (refunds in flight counted) is 409 `refund_not_allowed`.
    """
    idempotency_key(request)
    body = json_body(request)
    amount = body.get("amount")
    if "amount" not in body:
        raise ApiError(400, "missing_field", "amount is required.", "amount")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise ApiError(
            400, "invalid_field", "amount must be a positive integer (minor units).", "amount"
        )
    return start_operation(
        request,
        lambda key: request_refund(order_id=order_id, key=key, amount=amount, actor="api"),
        not_found=ApiError(404, "order_not_found", f"Order {order_id} does not exist."),
        not_allowed=(RefundNotAllowed, "refund_not_allowed"),
        order=order_id,
        amount=amount,
    )
