"""`/healthz`: is the database reachable, is the queue's Redis reachable?

For a load balancer or an orchestrator's probe: no authentication, no secrets
and no error text in the answer (an exception message can carry a host name
or a URL with a password), only which component failed. The provider is not
checked: a provider outage must not take the web tier out of rotation, since
the synchronous API never calls it.
"""

from __future__ import annotations

import logging

from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from payments.engine.queues import PROBE_TIMEOUT, redis_client

logger = logging.getLogger("payments.observability.health")


def database_ok() -> bool:
    """Tell whether the default database answers a trivial query."""
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception:  # any failure means "not usable"; the type is logged, not returned
        logger.warning("health: database unreachable", exc_info=True)
        return False
    return True


def redis_ok() -> bool:
    """Tell whether the payments queue's Redis answers PING."""
    try:
        return bool(redis_client(timeout=PROBE_TIMEOUT).ping())
    except Exception:
        logger.warning("health: queue redis unreachable", exc_info=True)
        return False


@never_cache
@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    """Answer 200 when the database and Redis are reachable, else 503 naming the failure."""
    components = {
        "database": "ok" if database_ok() else "unreachable",
        "redis": "ok" if redis_ok() else "unreachable",
    }
    healthy = all(state == "ok" for state in components.values())
    return JsonResponse(
        {"status": "ok" if healthy else "error", **components}, status=200 if healthy else 503
    )
