"""Views that serve every kind of operation."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from payments.api.base import ApiError, _check_text, caller_client, operation_json
from payments.api.fields import ERRORS
from payments.api.schema import OPERATION_KEY
from payments.models import KeyScope, Operation


class StepOut(serializers.Serializer):
    step = serializers.CharField()
    state = serializers.CharField()
    provider_reference = serializers.CharField(allow_blank=True)
    idempotency_key = serializers.CharField(allow_blank=True)
    attempts = serializers.IntegerField()


class EntityOut(serializers.Serializer):
    type = serializers.CharField()
    id = serializers.CharField()


class OperationOut(serializers.Serializer):
    operation = serializers.CharField()
    kind = serializers.CharField()
    state = serializers.CharField()
    entity = EntityOut()
    attempts = serializers.IntegerField()
    last_error = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    steps = StepOut(many=True)


OPERATION_EXAMPLE = {
    "operation": "checkout-42-1",
    "kind": "checkout",
    "state": "succeeded",
    "entity": {"type": "order", "id": "42"},
    "attempts": 1,
    "last_error": "",
    "created_at": "2026-01-01T12:00:00+00:00",
    "updated_at": "2026-01-01T12:00:02+00:00",
    "steps": [
        {
            "step": "charge",
            "state": "done",
            "provider_reference": "ref_123",
            "idempotency_key": "op-1-charge",
            "attempts": 1,
        }
    ],
}


@extend_schema(
    responses={200: OperationOut, **ERRORS},
    parameters=[OPERATION_KEY],
    examples=[OpenApiExample("A paid checkout", value=OPERATION_EXAMPLE, response_only=True)],
    operation_id="get_operation",
)
@api_view(["GET"])
def operation_detail(request: Request, key: str) -> Response:
    """Show one of your operations by its Idempotency-Key: its state and its steps."""
    _check_text(key)  # a NUL would reach PostgreSQL as an error, not a 404
    op = Operation.objects.filter(
        tenant=caller_client(request).tenant, scope=KeyScope.CLIENT, key=key
    ).first()
    if op is None:
        raise ApiError(404, "operation_not_found", "No operation of yours has this key.")
    return Response(operation_json(op))
