"""The JSON API's plumbing, shared by every operation's views: auth, errors, idempotent POSTs.

Every request needs `Authorization: Bearer <API_TOKEN>`. Errors are
`{"error": {"code": ..., "message": ..., "field": ...}}` with a 4xx status,
and nothing is written when the input is bad. A POST that starts an operation
needs an `Idempotency-Key`: the same key with the same body answers the same
operation (202, `Idempotent-Replayed: true`); with another body, 409.
The synchronous API never calls the provider.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from payments.exceptions import InvalidTransition, OperationConflict
from payments.models import Operation

MAX_KEY_LENGTH = 255


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
                authenticate(request)
                return view(request, *args, **kwargs)
            except ApiError as exc:
                response = exc.response()
                if exc.status == 401:
                    response["WWW-Authenticate"] = 'Bearer realm="api"'
                return response

        return wrapped

    return decorate


def authenticate(request: HttpRequest) -> None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    expected = settings.API_TOKEN
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
        raise ApiError(401, "unauthorized", "Send Authorization: Bearer <API_TOKEN>.")


def json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        body = json.loads(request.body or b"")
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "malformed_json", "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "malformed_json", "The request body must be a JSON object.")
    return body


def idempotency_key(request: HttpRequest) -> str:
    """Return the request's Idempotency-Key, or raise ApiError (400) naming what is wrong."""
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
    return key


def start_operation(
    request: HttpRequest,
    start: Callable[[str], tuple[Operation, bool]],
    *,
    not_found: ApiError,
    not_allowed: tuple[type[InvalidTransition], str],
    **answer: Any,
) -> JsonResponse:
    """Start an operation under the request's Idempotency-Key; answer 202 with it.

    `start(key)` writes the operation (or returns the one the key names);
    `not_allowed` is the business refusal to answer 409 with, and its code.
    An unknown entity (DoesNotExist) is answered with `not_found`; a key reused with other
    parameters is 409 `idempotency_conflict`; a replay carries
    `Idempotent-Replayed: true`.
    """
    key = idempotency_key(request)
    refusal, refusal_code = not_allowed
    try:
        op, created = start(key)
    except ObjectDoesNotExist:
        raise not_found from None
    except OperationConflict as exc:
        raise ApiError(
            409,
            "idempotency_conflict",
            "This Idempotency-Key was already used for another request "
            f"({exc.existing_entity} or other parameters); use a new key.",
        ) from None
    except refusal as exc:
        raise ApiError(409, refusal_code, str(exc)) from None
    response = JsonResponse({"operation": op.key, "state": op.state, **answer}, status=202)
    if not created:
        response["Idempotent-Replayed"] = "true"
    return response


def operation_json(op: Operation) -> dict[str, Any]:
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
