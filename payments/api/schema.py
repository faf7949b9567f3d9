"""What the OpenAPI schema says beyond the serializers: authentication, shared parameters.

Every rule the API enforces is in the schema (a fuzzer reading it must find
nothing refused that it was told is valid, nothing taken that it was told is
not): the Idempotency-Key's length and pattern, ids' range, no unknown fields.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiParameter

from payments.api.fields import IDEMPOTENCY_KEY_PATTERN, MAX_KEY_LENGTH, ecma

KEY_SCHEMA_PATTERN = ecma(IDEMPOTENCY_KEY_PATTERN)


class ClientKeyScheme(OpenApiAuthenticationExtension):
    """`Authorization: Bearer <key>`: a client's API key (admin: "Client API keys")."""

    target_class = "payments.api.base.ClientKeyAuthentication"
    name = "clientKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A client's API key, sent as `Authorization: Bearer <key>`.",
        }


# --- what every operation's schema shares ---------------------------------------------------

#: The largest id PostgreSQL's bigint primary keys reach.
MAX_ID = 2**63 - 1

ORDER_ID = OpenApiParameter(
    "order_id",
    {"type": "integer", "minimum": 1, "maximum": MAX_ID},
    OpenApiParameter.PATH,
    description="The id of one of your orders (another client's answers 404).",
)
OPERATION_KEY = OpenApiParameter(
    "key",
    {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": KEY_SCHEMA_PATTERN},
    OpenApiParameter.PATH,
    description="The Idempotency-Key one of your operations was asked for with.",
)


def idempotency_key_header(*, required: bool, description: str) -> OpenApiParameter:
    """The Idempotency-Key header as the API checks it (payments.api.base.idempotency_key)."""
    return OpenApiParameter(
        "Idempotency-Key",
        {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_KEY_LENGTH,
            "pattern": KEY_SCHEMA_PATTERN,
        },
        OpenApiParameter.HEADER,
        required=required,
        description=f"1-{MAX_KEY_LENGTH} printable ASCII characters, not starting or ending "
        f"with a space; scoped to your client. {description}",
    )


def refuse_unknown_fields(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Postprocessing hook: every request body refuses fields it does not name.

    As the API does (payments.api.base.validated): the schema must not promise
    that an unknown field is taken.
    """
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result
