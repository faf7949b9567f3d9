"""`POST /adyen/notifications/`: Adyen's standard webhooks, answered `[accepted]`.

* 200 `[accepted]`: every item is signed with the configured HMAC key; each was stored
  and applied once (a duplicate too: Adyen must stop sending it);
* 401: an item unsigned or signed with another key, or no HMAC key configured: nothing
  is written (Adyen retries; a forger learns nothing);
* 400: a body that is not a notification; 413 above `MAX_BODY_BYTES`; 405 but POST.

CSRF-exempt: Adyen has no session; the HMAC signature is the authentication. Adyen
expects an answer within 10 seconds; the work done here is a few rows in one
transaction per item, and no call to Adyen.
"""

from __future__ import annotations

import json
import logging

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from payments.adyen.notifications import items_of, receive, signed
from payments.adyen.system import NAME
from payments.conf import payments_settings

logger = logging.getLogger("payments.adyen.notifications")

#: A standard webhook carries one item of a few hundred bytes.
MAX_BODY_BYTES = 256 * 1024
ACCEPTED = "[accepted]"


@csrf_exempt
@require_POST
def notifications(request: HttpRequest) -> HttpResponse:
    """Verify every item, then store and apply each once; answer `[accepted]`."""
    if len(request.body) > MAX_BODY_BYTES:
        return HttpResponse(status=413)
    entry = payments_settings().system(NAME)
    hmac_key = str(entry.option("HMAC_KEY") or "") if entry is not None else ""
    merchant = str(entry.option("MERCHANT_ACCOUNT") or "") if entry is not None else ""
    try:
        items = items_of(json.loads(request.body))
    except ValueError as exc:  # JSONDecodeError is one
        logger.warning("Adyen notification refused: not a notification (%s)", exc)
        return HttpResponse("not a notification", status=400, content_type="text/plain")
    if not all(signed(item, hmac_key) for item in items):
        logger.warning("Adyen notification refused: an item's HMAC signature does not verify")
        return HttpResponse("invalid signature", status=401, content_type="text/plain")
    for item in items:
        receive(item, merchant_account=merchant)
    return HttpResponse(ACCEPTED, content_type="text/plain")
