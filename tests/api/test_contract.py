"""The contract: what the API refuses, the schema says; what the schema allows, the API takes."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from django.test import Client

from payments.api.fields import EMAIL_PATTERN
from payments.shop.models import Order

pytestmark = pytest.mark.django_db

ORDER = {"amount": 1999, "currency": "eur", "email": "a@example.com"}


@pytest.fixture
def served_schema() -> dict:
    return json.loads(Client().get("/api/schema", headers={"Accept": "application/json"}).content)


def create(api: Client, body: object, content_type: str = "application/json", **extra):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api.generic("POST", "/api/orders", data, content_type=content_type, **extra)


# --- the schema says what is enforced --------------------------------------------------------


def header(schema: dict, path: str, name: str) -> dict:
    (operation,) = schema["paths"][path].values()
    return next(p for p in operation["parameters"] if p["name"] == name)


def test_schema__idempotency_key_has_its_length_and_pattern(served_schema):
    for path in (
        "/api/orders/{order_id}/checkout",
        "/api/orders/{order_id}/refunds",
        "/api/orders/{order_id}/captures",
    ):
        key = header(served_schema, path, "Idempotency-Key")["schema"]
        assert (key["minLength"], key["maxLength"]) == (1, 255)
        assert key["pattern"]
    assert header(served_schema, "/api/orders", "Idempotency-Key").get("required", False) is False


def test_schema__every_operation_lists_406_and_has_examples(served_schema):
    for path, operations in served_schema["paths"].items():
        for method, operation in operations.items():
            assert "406" in operation["responses"], (method, path)
            success = next(v for k, v in operation["responses"].items() if k.startswith("2"))
            assert success["content"]["application/json"].get("examples"), (method, path)


def test_schema__bodies_refuse_unknown_fields_and_nul_in_strings(served_schema):
    bodies = {
        name: component
        for name, component in served_schema["components"]["schemas"].items()
        if name.endswith("Request")
    }
    assert bodies
    for name, component in bodies.items():
        assert component["additionalProperties"] is False, name
        for field, spec in component["properties"].items():
            if spec.get("type") == "string" and "enum" not in spec:
                assert "\\x00" not in spec["pattern"] and spec["pattern"].startswith("^"), field


def test_accept_html__is_406_json(api):
    response = api.get("/api/orders/1", headers={"Accept": "text/html"})
    assert response.status_code == 406
    assert response.json()["error"]["code"] == "not_acceptable"


# --- the Idempotency-Key as the schema states it -------------------------------------------


@pytest.mark.parametrize("key", [" leading", "trailing ", "tab\tinside"])
def test_idempotency_key__outside_the_pattern_is_400(api, key):
    response = create(api, ORDER, HTTP_IDEMPOTENCY_KEY=key)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "Idempotency-Key"


def test_idempotency_key__inner_spaces_and_punctuation_are_accepted(api):
    assert create(api, ORDER, HTTP_IDEMPOTENCY_KEY="order 42/try:1").status_code == 201


# --- bodies ------------------------------------------------------------------------------------


def test_unknown_field__is_400_naming_it_and_writes_nothing(api):
    response = create(api, {**ORDER, "note": "x"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "code": "invalid_field",
        "message": "note: unknown field.",
        "field": "note",
    }
    assert not Order.objects.exists()


def test_chunked_body__without_content_length_is_read(api):
    body = json.dumps(ORDER).encode()
    response = create(
        api,
        body,
        CONTENT_LENGTH="",
        HTTP_TRANSFER_ENCODING="chunked",
        **{"wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True},
    )
    assert response.status_code == 201, response.content
    assert Order.objects.count() == 1


def test_chunked_body__over_the_limit_is_413(api, settings):
    body = json.dumps({**ORDER, "email": "a" * 100 + "@example.com"}).encode()
    settings.API_MAX_BODY_BYTES = 64
    response = create(
        api,
        body,
        CONTENT_LENGTH="",
        HTTP_TRANSFER_ENCODING="chunked",
        **{"wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True},
    )
    assert response.status_code == 413


@pytest.mark.parametrize(
    "content_type",
    ["application/json;;;", "*/*", "application/*", "application/json; version=2"],
)
def test_media_type__anything_but_json_is_415(api, content_type):
    response = create(api, ORDER, content_type=content_type)
    assert response.status_code == 415, response.content
    assert not Order.objects.exists()


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "APPLICATION/JSON", "application/json; charset=utf-8"],
)
def test_media_type__json_is_taken(api, content_type):
    assert create(api, ORDER, content_type=content_type).status_code == 201


# --- e-mail addresses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "email",
    [
        "a" * 65 + "@example.com",  # RFC 5321: at most 64 octets before the @
        "a@localhost",  # no dot: not an address on the Internet
        "a@-example.com",
        "a@example.com.",
        "é@example.com",  # a non-ASCII local part needs SMTPUTF8
        "a@@example.com",
        ".a@example.com",
    ],
)
def test_email__outside_the_rules_is_400(api, email):
    response = create(api, {**ORDER, "email": email})
    assert response.status_code == 400, email
    assert response.json()["error"]["field"] == "email"


def test_email__64_octets_before_the_at_is_accepted(api):
    assert create(api, {**ORDER, "email": "a" * 64 + "@example.com"}).status_code == 201


@pytest.mark.parametrize(
    "email",
    [
        "Kim@Bücher.Example",
        "a@exa\u00admple.com",  # soft hyphen: IDNA 2003 mapped it away
        "a@example\u3002com",  # ideographic full stop
        "a@\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.com",  # fullwidth letters
        "a@x\u200b.io",  # zero-width space
    ],
)
def test_email__a_non_ascii_domain_the_schema_refuses_is_refused(api, email):
    assert not re.search(EMAIL_PATTERN, email)
    response = create(api, {**ORDER, "email": email})
    assert response.status_code == 400, response.content
    assert response.json()["error"]["field"] == "email"
    assert "xn--" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("email", "stored"),
    [
        ("Kim@xn--bcher-kva.Example", "Kim@xn--bcher-kva.example"),
        ("a@EXAMPLE.COM", "a@example.com"),
    ],
)
def test_email__what_the_schema_pattern_takes_is_accepted(api, email, stored):
    assert re.search(EMAIL_PATTERN, email)
    response = create(api, {**ORDER, "email": email})
    assert response.status_code == 201, response.content
    assert Order.objects.get().customer_email == stored


# --- RQ_API_TOKEN ---------------------------------------------------------------------------------


def test_rq_api_token__is_read_from_the_environment():
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DEBUG": "1",
        "RQ_API_TOKEN": "rq-token-from-the-environment",
    }
    out = subprocess.run(
        [sys.executable, "-c", "from django.conf import settings; print(settings.RQ_API_TOKEN)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "rq-token-from-the-environment"
