"""How the OpenAPI schema describes the API's authentication (drf-spectacular extension)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


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
