"""The JSON API's plumbing on Django REST framework: clients, errors, idempotent POSTs.

Why DRF: its request parsing, content negotiation (415), throttling and the
OpenAPI schema (drf-spectacular) are well kept and known to every Django
team; the per-client keys are djangorestframework-api-key's hashed keys with a
visible prefix. What is ours is small and here: the error shape, the strict
JSON parser and the idempotent start of an operation.

Every request needs `Authorization: Bearer <key>`: a client's key (admin:
"Client API keys"), or `API_TOKEN`, the bootstrap client for development and
the local tools. Every answer under `/api/` that is not a success is
`{"error": {"code": ..., "message": ..., "field": ...}}`, and nothing is
written when the input is bad. A POST that starts an operation needs an
`Idempotency-Key` (1-255 printable ASCII characters), scoped to its client:
the same key and body answer the same operation (202, `Idempotent-Replayed:
true`), another body 409. The synchronous API never calls the provider.
"""

from __future__ import annotations

import hmac
import io
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.http import Http404, HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.authentication import BaseAuthentication
from rest_framework.parsers import JSONParser
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer

from payments.api.fields import IDEMPOTENCY_KEY_PATTERN, MAX_KEY_LENGTH, matches
from payments.api.keys import BOOTSTRAP_CLIENT
from payments.api.limits import (
    RateLimiterUnavailable,
    Window,
    WindowThrottle,
    client_address,
    take_back,
)
from payments.exceptions import InvalidTransition, OperationConflict
from payments.models import ApiClient, ClientApiKey, Operation

#: JSON nested deeper than this is refused (a recursion bomb must not reach the parser's limit).
MAX_JSON_DEPTH = 32
#: What a key can be: printable ASCII (anything else is a wrong key, never looked up).
KEY_TEXT = re.compile(r"\A[!-~]+\Z")


class ApiError(exceptions.APIException):
    """A client error answered with `status` and a JSON body naming the field."""

    def __init__(self, status_code: int, code: str, message: str, field: str | None = None):
        super().__init__(detail=message, code=code)
        self.status_code, self.code, self.message, self.field = status_code, code, message, field


class PayloadTooLarge(ApiError):
    def __init__(self) -> None:
        limit = settings.API_MAX_BODY_BYTES
        super().__init__(413, "payload_too_large", f"The body is larger than {limit} bytes.")


# --- who is calling ----------------------------------------------------------------


class ApiCaller:
    """The authenticated caller: an API client (DRF's `request.user`)."""

    is_authenticated = True

    def __init__(self, client: ApiClient) -> None:
        self.client = client

    def __str__(self) -> str:
        return f"api:{self.client.name}"


def bootstrap_client() -> ApiClient:
    """The client API_TOKEN stands for (created on first use)."""
    client, _ = ApiClient.objects.get_or_create(name=BOOTSTRAP_CLIENT)
    return client


class ClientKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer <key>`: a client's hashed key, or the bootstrap API_TOKEN.

    A wrong key counts against the caller's address (`failed_auth` rate): past
    it, every attempt is 429 until the window passes, right key or not. Every
    attempt is counted (one atomic increment) before its key is looked at, so
    N wrong keys at once get at most the limit of lookups; a right key takes
    its count back (else a shop's own traffic from one address would lock it
    out), and so does a refused one: only wrong keys stay counted.
    """

    def authenticate(self, request: Request) -> tuple[ApiCaller, str] | None:
        raw = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = raw.partition(" ")
        token = token.strip()
        attempt = FailedAuthThrottle().count(request)
        if scheme.lower() != "bearer" or not KEY_TEXT.match(token):
            self._failed()
        bootstrap = getattr(settings, "API_TOKEN", "")
        if bootstrap and hmac.compare_digest(token.encode(), bootstrap.encode()):
            client = bootstrap_client()
        else:
            client = self._client_of(token)
        if attempt is not None:
            take_back(attempt)
        return ApiCaller(client), token

    def _client_of(self, token: str) -> ApiClient:
        try:
            key = cast(ClientApiKey, ClientApiKey.objects.get_from_key(token))
        except ClientApiKey.DoesNotExist:
            self._failed()
        if key.has_expired or not key.client.is_active:
            self._failed()
        return key.client

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'

    @staticmethod
    def _failed() -> Any:
        raise exceptions.AuthenticationFailed("Send Authorization: Bearer <your API key>.")


class IsApiClient(BasePermission):
    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, ApiCaller)


class ClientRateThrottle(WindowThrottle):
    """Requests per client (`API_RATE_PER_CLIENT`), counted atomically (payments.api.limits)."""

    scope = "client"

    def ident(self, request: Request) -> str | None:
        caller = request.user
        return str(caller.client.pk) if isinstance(caller, ApiCaller) else None


class FailedAuthThrottle(WindowThrottle):
    """Wrong keys per address (`API_RATE_FAILED_AUTH`); the address is `client_address`'s."""

    scope = "failed_auth"

    def ident(self, request: Request) -> str:
        return client_address(request)

    def count(self, request: Request) -> Window | None:
        """Count an attempt, before its key is looked at; 429 once over the limit.

        Return the window it was counted in (None: no limit), to take it back if
        the key is right. A refused attempt is not counted (it was not looked at):
        a client that keeps retrying is let in once the wrong keys have aged out.
        """
        if not self.allow_request(request, None):
            if self.window is not None:
                take_back(self.window)
            raise exceptions.Throttled(wait=self.wait())
        return self.window


# --- what is accepted --------------------------------------------------------------


def _clean_strings(value: Any, depth: int = 0) -> None:
    """Refuse NUL characters and lone surrogates anywhere in a JSON value, and deep nesting."""
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, "malformed_json", f"The JSON is nested deeper than {MAX_JSON_DEPTH}.")
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _clean_strings(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _clean_strings(item, depth + 1)


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise ApiError(400, "invalid_text", "Text must not contain NUL characters.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, "invalid_text", "Text must be valid Unicode (no lone surrogates)."
        ) from None


#: The one media type a body may have: `application/json`, with at most a UTF-8 charset.
JSON_MEDIA_TYPE = re.compile(
    r"\Aapplication/json[ \t]*(;[ \t]*charset[ \t]*=[ \t]*(utf-?8|\"utf-?8\")[ \t]*)?\Z",
    re.IGNORECASE,
)


class StrictJSONParser(JSONParser):
    """JSON only (anything else is 415), UTF-8, at most API_MAX_BODY_BYTES, no NUL or surrogates.

    DRF picks this parser for any content type that matches `application/json`
    loosely (`*/*`, `application/*`, `application/json;;;`): the exact one is
    checked here.
    """

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        if not JSON_MEDIA_TYPE.match((media_type or "").strip()):
            raise ApiError(415, "unsupported_media_type", "Send JSON encoded as UTF-8.")
        raw = stream.read(settings.API_MAX_BODY_BYTES + 1) if stream is not None else b""
        if len(raw) > settings.API_MAX_BODY_BYTES:
            raise PayloadTooLarge()
        try:
            data = json.loads(raw.decode("utf-8") or "null")
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ApiError(400, "malformed_json", "The request body is not valid JSON.") from None
        _clean_strings(data)
        return data


def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON body, which must be an object (sized, or sent chunked)."""
    sent_length = str(request.META.get("CONTENT_LENGTH") or "0").strip()
    if not re.fullmatch(r"[0-9]+", sent_length):
        raise ApiError(400, "bad_request", "Content-Length must be a number of bytes.")
    length = int(sent_length)
    if length > settings.API_MAX_BODY_BYTES:
        raise PayloadTooLarge()
    body = _unsized_body(request) if length == 0 else request.data
    if not isinstance(body, dict):
        raise ApiError(400, "malformed_json", "The request body must be a JSON object.")
    return body


def _unsized_body(request: Request) -> Any:
    """A body sent without Content-Length (`Transfer-Encoding: chunked`), parsed; else None.

    Django and DRF read CONTENT_LENGTH bytes, none without it; the WSGI server
    (gunicorn) has undone the chunking and says so with `wsgi.input_terminated`:
    its input ends where the body does.
    """
    environ = request._request.environ  # the WSGI environ: Django keeps it on the request
    chunked = "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower()
    if not (chunked and environ.get("wsgi.input_terminated")):
        return None
    parser = request.negotiator.select_parser(request, request.parsers)
    if parser is None:
        raise ApiError(415, "unsupported_media_type", "Send JSON encoded as UTF-8.")
    raw = environ["wsgi.input"].read(settings.API_MAX_BODY_BYTES + 1)
    return parser.parse(io.BytesIO(raw), request.content_type, request.parser_context)


def validated(serializer_class: type[Serializer], request: Request) -> dict[str, Any]:
    """The body's fields, checked by `serializer_class`; an unknown field is 400 naming it.

    The schema says `additionalProperties: false`: a field the API does not
    know (a typo, a field of another version) is refused, never ignored.
    """
    body = json_object(request)
    serializer = serializer_class(data=body)
    unknown = sorted(set(body) - set(serializer.fields))
    if unknown:
        raise ApiError(400, "invalid_field", f"{unknown[0]}: unknown field.", unknown[0])
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def optional_idempotency_key(request: Request) -> str | None:
    """The request's Idempotency-Key where it may be left out: None without the header."""
    if request.META.get("HTTP_IDEMPOTENCY_KEY") is None:
        return None
    return idempotency_key(request)


def idempotency_key(request: Request) -> str:
    """Return the request's Idempotency-Key, or raise ApiError (400) naming what is wrong."""
    key = request.META.get("HTTP_IDEMPOTENCY_KEY")
    if key is None or not key.strip():
        raise ApiError(
            400, "missing_field", "The Idempotency-Key header is required.", "Idempotency-Key"
        )
    if not matches(IDEMPOTENCY_KEY_PATTERN, key):
        raise ApiError(
            400,
            "invalid_field",
            f"Idempotency-Key must be 1..{MAX_KEY_LENGTH} printable ASCII characters, "
            "not starting or ending with a space.",
            "Idempotency-Key",
        )
    return key


def caller_client(request: Request) -> ApiClient:
    caller = request.user
    assert isinstance(caller, ApiCaller)  # IsApiClient let the request in
    return caller.client


def start_operation(
    request: Request,
    start: Callable[[str, ApiClient], tuple[Operation, bool]],
    *,
    not_found: ApiError,
    not_allowed: tuple[type[InvalidTransition], str],
    **answer: Any,
) -> Response:
    """Start an operation under the request's Idempotency-Key (its client's); answer 202.

    `start(key, client)` writes the operation (or returns the one the key names);
    `not_allowed` is the business refusal to answer 409 with, and its code.
    An unknown entity (DoesNotExist) is answered with `not_found`; a key
    reused with other parameters is 409 `idempotency_conflict`; a replay
    carries `Idempotent-Replayed: true`.
    """
    key = idempotency_key(request)
    refusal, refusal_code = not_allowed
    try:
        op, created = start(key, caller_client(request))
    except ObjectDoesNotExist:
        raise not_found from None
    except OperationConflict as exc:
        raise idempotency_conflict(exc) from None
    except refusal as exc:
        raise ApiError(409, refusal_code, str(exc)) from None
    response = Response({"operation": op.key, "state": op.state, **answer}, status=202)
    if not created:
        response["Idempotent-Replayed"] = "true"
    return response


def idempotency_conflict(exc: OperationConflict) -> ApiError:
    """The 409 for a key used before with other parameters."""
    return ApiError(
        409,
        "idempotency_conflict",
        "This Idempotency-Key was already used for another request "
        f"({exc.existing_entity} or other parameters); use a new key.",
    )


# --- every error in one shape ----------------------------------------------------------


def _first_error(detail: Any, field: str | None = None) -> Iterator[tuple[str | None, Any]]:
    if isinstance(detail, dict):
        for name, inner in detail.items():
            yield from _first_error(inner, None if name == "non_field_errors" else str(name))
    elif isinstance(detail, list):
        for inner in detail:
            yield from _first_error(inner, field)
    else:
        yield field, detail


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if field:
        body["field"] = field
    return {"error": body}


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Answer every error under /api/ as `{"error": {"code", "message", "field"}}`."""
    if isinstance(exc, ApiError):
        return Response(error_body(exc.code, exc.message, exc.field), status=exc.status_code)
    if isinstance(exc, Http404):
        return Response(error_body("not_found", "Nothing is here."), status=404)
    if isinstance(exc, RateLimiterUnavailable):
        body = error_body("rate_limiter_unavailable", str(exc.detail))
        return Response(body, status=503, headers={"Retry-After": str(exc.retry_after)})
    from rest_framework.views import exception_handler  # it imports this module's classes

    response = exception_handler(exc, context)
    if response is None:
        return None  # a bug: Django's 500 (the admins are told)
    if isinstance(exc, exceptions.ValidationError):
        field, detail = next(_first_error(exc.detail), (None, "Invalid input."))
        code = "missing_field" if getattr(detail, "code", "") == "required" else "invalid_field"
        response.data = error_body(code, f"{field}: {detail}" if field else str(detail), field)
        response.status_code = 400
        return response
    codes = {
        status.HTTP_401_UNAUTHORIZED: "unauthorized",
        status.HTTP_403_FORBIDDEN: "unauthorized",
        status.HTTP_405_METHOD_NOT_ALLOWED: "method_not_allowed",
        status.HTTP_406_NOT_ACCEPTABLE: "not_acceptable",
        status.HTTP_415_UNSUPPORTED_MEDIA_TYPE: "unsupported_media_type",
        status.HTTP_429_TOO_MANY_REQUESTS: "rate_limited",
    }
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        response.status_code = 401
        response["WWW-Authenticate"] = 'Bearer realm="api"'
        message = "Send Authorization: Bearer <your API key>."
    else:
        message = str(getattr(exc, "detail", exc))
    code = codes.get(response.status_code, "bad_request")
    response.data = error_body(code, message)
    return response


@csrf_exempt  # a machine API: a POST to a wrong path is a 404, not a CSRF page
def json_not_found(request: HttpRequest, path: str = "") -> JsonResponse:
    """Any other path under /api/: the documented JSON 404 (no authentication needed)."""
    return JsonResponse(error_body("not_found", "No such API endpoint."), status=404)


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
