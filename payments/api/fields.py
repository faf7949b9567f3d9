"""Serializer fields that accept exactly the JSON types they name (DRF coerces by default)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer: not a string, a float or a boolean."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class StrictCharField(serializers.CharField):
    """A JSON string: not a number."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class ErrorDetail(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    field = serializers.CharField(required=False)


class ErrorOut(serializers.Serializer):
    """Every answer that is not a success: `{"error": {"code", "message", "field"?}}`."""

    error = ErrorDetail()


#: The errors every endpoint may answer, for the OpenAPI schema.
ERRORS = {code: ErrorOut for code in (400, 401, 404, 405, 409, 413, 415, 429)}
