"""`/healthz`: is the database reachable, is the queue's Redis reachable?

For a load balancer or an orchestrator's probe: no authentication, no secrets
and no error text in the answer (an exception message can carry a host name
or a URL with a password), only which component failed. The provider is not
checked: a provider outage must not take the web tier out of rotation, since
the synchronous API never calls it.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from django_rq.connection_utils import get_redis_connection
from redis import Redis

from payments.conf import payments_setting

logger = logging.getLogger("payments.health")

#: Seconds to wait for Redis in a probe; a blackholed host must not hang the probe.
PROBE_TIMEOUT = 2.0


def queue_config(name: str | None = None) -> dict[str, Any]:
    """Return the RQ_QUEUES entry of `name` (default: the payments queue), read afresh."""
    return settings.RQ_QUEUES[name or payments_setting("QUEUE")]


def queue_connection(name: str | None = None, *, timeout: float | None = None) -> Redis:
    """Build a Redis client for a queue from the current settings.

    Read from `settings.RQ_QUEUES` on each call (django-rq freezes its copy at
    import), so `override_settings` and the test configuration apply. With
    `timeout`, connect and socket timeouts are bounded.
    """
    config = queue_config(name)
    if "URL" in config and timeout is not None:
        return Redis.from_url(
            config["URL"],
            db=config.get("DB"),
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
        )
    return get_redis_connection(config)


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
    client = queue_connection(timeout=PROBE_TIMEOUT)
    try:
        return bool(client.ping())
    except Exception:
        logger.warning("health: queue redis unreachable", exc_info=True)
        return False
    finally:
        client.close()


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
