"""`POST /webhooks/provider`: the provider's signed events, stored and acknowledged at once.

Answers, as Stripe expects of an endpoint (a 2xx quickly, the work later):

* 200 `{"received": true}`: a valid event, stored (once: a duplicate delivery
  is 200 too, with `"duplicate": true`) and handled by a job after the commit;
* 200 `{"received": true, "ignored": true}`: a valid event of a type this
  app does not handle. Stripe's practice: acknowledge what you do not use, or
  it is retried for days and the endpoint is flagged as failing. Nothing is
  written (no row, no job): there is nothing it could settle;
* 400: a missing or bad signature, a timestamp outside the tolerance (a
  replayed delivery), no webhook secret configured, or a body that is not an
  event (not JSON, no id/type/created/data.object, or a handled type whose
  object is malformed). Nothing is written; a WARNING names the reason, never
  the payload or the header;
* 413 for a body above `MAX_BODY_BYTES`, 405 for any method but POST.

CSRF-exempt: the provider has no session; the signature is the authentication.
"""

from __future__ import annotations

import json
import logging

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from payments.conf import payments_settings
from payments.provider import signature
from payments.provider.client import Event
from payments.webhooks.events import facts_of, handled_types
from payments.webhooks.handling import store_event

logger = logging.getLogger("payments.webhooks")

#: Stripe's events are a few KiB; anything this large is not one of them.
MAX_BODY_BYTES = 512 * 1024


@csrf_exempt
@require_POST
def provider_webhook(request: HttpRequest) -> HttpResponse:
    """Verify, store and acknowledge one provider event (see the module docstring)."""
    length = request.headers.get("Content-Length") or "0"
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        return _refused(request, "body too large", status=413)
    body = request.body
    if len(body) > MAX_BODY_BYTES:
        return _refused(request, "body too large", status=413)
    conf = payments_settings()
    try:
        signature.verify(
            body,
            request.headers.get(signature.SIGNATURE_HEADER),
            conf.provider_webhook_secrets,
            tolerance=conf.provider_webhook_tolerance,
        )
    except signature.SignatureError as exc:
        return _refused(request, str(exc))
    try:
        event = Event.from_json(json.loads(body))
        if event.type in handled_types():
            facts_of(event.type, event.raw)  # a handled type must carry an object we can read
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8 and shape errors alike
        return _refused(request, f"not an event: {type(exc).__name__}: {_short(exc)}")
    if event.type not in handled_types():
        logger.info("provider event %s of type %s acknowledged; not handled", event.id, event.type)
        return JsonResponse({"received": True, "ignored": True})
    row, created = store_event(event)
    if not created:
        logger.info("provider event %s delivered again; already stored", event.id)
    return JsonResponse({"received": True, "duplicate": not created})


def _refused(request: HttpRequest, reason: str, *, status: int = 400) -> HttpResponse:
    # The reason only: never the body, the signature header or a secret.
    logger.warning(
        "provider webhook refused (%s) from %s: %s",
        status,
        request.META.get("REMOTE_ADDR", "?"),
        reason,
    )
    return JsonResponse({"error": {"type": "invalid_webhook", "message": reason}}, status=status)


def _short(exc: BaseException) -> str:
    """An error's message without any part of the body (json's messages quote none)."""
    if isinstance(exc, UnicodeDecodeError):
        return "the body is not UTF-8"
    return str(exc)[:200]
