"""Views that serve every kind of operation."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from payments.api.base import ApiError, api_view, operation_json
from payments.models import KeyScope, Operation


@api_view("GET")
def operation_detail(request: HttpRequest, key: str) -> JsonResponse:
    """Show an operation: its state and its steps with their provider references."""
    op = Operation.objects.filter(scope=KeyScope.CLIENT, key=key).first()
    if op is None:
        raise ApiError(404, "operation_not_found", "No operation has this key.")
    return JsonResponse(operation_json(op))
