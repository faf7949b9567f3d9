"""The synchronous JSON API. It writes orders and operations; it never calls the provider.

Every request needs `Authorization: Bearer <API_TOKEN>`. Errors are
`{"error": {"code": ..., "message": ..., "field": ...}}` with a 4xx status,
and nothing is written when the input is bad.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from payments.checkout.handler import CheckoutNotAllowed, request_checkout
from payments.checkout.orders import CURRENCIES, create_order
from payments.exceptions import OperationConflict
from payments.models import KeyScope, Operation, Order

MAX_KEY_LENGTH = 255
MAX_PAYMENT_METHOD_LENGTH = 255
MAX_AMOUNT = 99_999_999  # the provider's limit for one charge, in minor units


class ApiError(Exception):
    """A client error to answer with `status` and a JSON body naming the field."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field

    def response(self) -> JsonResponse:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field:
            body["field"] = self.field
        return JsonResponse({"error": body}, status=self.status)


def api_view(*methods: str) -> Callable:
    """Wrap a view: token auth, allowed methods, ApiError -> JSON response."""

    def decorate(view: Callable[..., JsonResponse]) -> Callable[..., JsonResponse]:
        @csrf_exempt  # token-authenticated machine API: no cookies, no CSRF
        @require_http_methods(list(methods))
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
            try:
                _authenticate(request)
                return view(request, *args, **kwargs)
            except ApiError as exc:
                response = exc.response()
                if exc.status == 401:
                    response["WWW-Authenticate"] = 'Bearer realm="api"'
                return response

        return wrapped

    return decorate


def _authenticate(request: HttpRequest) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    expected = settings.API_TOKEN
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise ApiError(401, "unauthorized", "Send Authorization: Bearer <API_TOKEN>.")


def _json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        body = json.loads(request.body or b"")
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "malformed_json", "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "malformed_json", "The request body must be a JSON object.")
    return body


def _order_json(order: Order) -> dict[str, Any]:
    return {
        "id": order.pk,
        "amount": order.amount,
        "currency": order.currency,
        "email": order.customer_email,
        "status": order.status,
        "created_at": order.created_at.isoformat(),
    }


def _operation_json(op: Operation) -> dict[str, Any]:
    return {
        "operation": op.key,
        "kind": op.kind,
        "state": op.state,
        "entity": {"type": op.entity_type, "id": op.entity_id},
        "attempts": op.attempts,
        "last_error": op.last_error,
        "created_at": op.created_at.isoformat(),
        "updated_at": op.updated_at.isoformat(),
        "steps": [
            {
                "step": c.step,
                "state": c.state,
                "provider_reference": c.provider_reference,
                "idempotency_key": c.idempotency_key,
                "attempts": c.attempts,
            }
            for c in op.claims.order_by("claimed_at", "id")
        ],
    }


@api_view("POST")
def orders(request: HttpRequest) -> JsonResponse:
    """Create an order: {"amount": 1999, "currency": "eur", "email": "a@example.com"}."""
    body = _json_body(request)
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
    key = request.headers.get("Idempotency-Key")
    if key is None or not key.strip():
        raise ApiError(
            400, "missing_field", "The Idempotency-Key header is required.", "Idempotency-Key"
        )
    if len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise ApiError(
            400,
            "invalid_field",
            f"Idempotency-Key must be 1..{MAX_KEY_LENGTH} printable characters.",
            "Idempotency-Key",
        )
    body = _json_body(request)
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
    try:
        op, created = request_checkout(
            order_id=order_id, key=key, payment_method=payment_method, actor="api"
        )
    except Order.DoesNotExist:
        raise ApiError(404, "order_not_found", f"Order {order_id} does not exist.") from None
    except OperationConflict as exc:
        raise ApiError(
            409,
            "idempotency_conflict",
            "This Idempotency-Key was already used for another request "
            f"({exc.existing_entity} or other parameters); use a new key.",
        ) from None
    except CheckoutNotAllowed as exc:
        raise ApiError(409, "order_not_open", str(exc)) from None
    response = JsonResponse({"operation": op.key, "state": op.state, "order": order_id}, status=202)
    if not created:
        response["Idempotent-Replayed"] = "true"
    return response


@api_view("GET")
def operation_detail(request: HttpRequest, key: str) -> JsonResponse:
    """Show an operation: its state and its steps with their provider references."""
    op = Operation.objects.filter(scope=KeyScope.CLIENT, key=key).first()
    if op is None:
        raise ApiError(404, "operation_not_found", "No operation has this key.")
    return JsonResponse(_operation_json(op))
