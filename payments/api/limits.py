"""The API's rate limits: atomic fixed-window counters, and the address a request came from.

Why not DRF's own throttle storage: `SimpleRateThrottle` reads a request
history from the cache and writes it back (get, then set), so N requests at
once all read the same history and all pass (60 concurrent got 60 x 200 at
30/min). Here every request is one atomic increment: in Redis an `INCR` and
an `EXPIRE` sent as one MULTI/EXEC transaction (redis-py's pipeline), so each
of N concurrent requests gets its own count and at most `limit` of them pass,
whatever the number of web processes. The windows are fixed and aligned to the
clock (the key names the window), so no counter needs a TTL to be right: the
EXPIRE only removes it once its window is over. Small enough to own; the
libraries that do the same (django-ratelimit: cache `add` + `incr`, two
commands; pyrate-limiter: a sliding log per key) would be a new dependency for
twenty lines, or weaker. Without `API_RATE_REDIS_URL` (development, tests)
the counters live in the process's cache, whose `add`/`incr` hold its lock.

The address (for the wrong-key limit) is the peer's, `REMOTE_ADDR`: a client
writes whatever it likes into `X-Forwarded-For`. Behind `API_TRUSTED_PROXIES`
proxies that each append to that header, it is the right-most entry not
written by one of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import cache
from redis import Redis
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

KEY_PREFIX = "api-limit"
#: Seconds of each period DRF's rates name by their first letter ("600/min", "20/m").
PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

_redis_clients: dict[str, Redis] = {}


@dataclass(frozen=True)
class Window:
    """One counter's state: requests counted in the current window, seconds until it ends."""

    count: int
    retry_after: int


def _redis() -> Redis | None:
    url = getattr(settings, "API_RATE_REDIS_URL", "")
    if not url:
        return None
    if url not in _redis_clients:  # one connection pool per process (thread-safe)
        _redis_clients[url] = Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    return _redis_clients[url]


def _window(name: str, seconds: int) -> tuple[str, int]:
    """The key of `name`'s current window, and the seconds left in it."""
    now = time.time()
    number = int(now // seconds)
    left = max(1, math.ceil((number + 1) * seconds - now))
    return f"{KEY_PREFIX}:{name}:{seconds}:{number}", left


def hit(name: str, seconds: int) -> Window:
    """Count one request against `name` in its `seconds`-long window; return the new count."""
    key, left = _window(name, seconds)
    redis = _redis()
    if redis is not None:
        pipe = redis.pipeline(transaction=True)  # MULTI ... EXEC: both or neither
        pipe.incr(key)
        pipe.expire(key, seconds + 1)
        count, _ = pipe.execute()
        return Window(int(count), left)
    cache.add(key, 0, timeout=seconds + 1)
    try:
        return Window(int(cache.incr(key)), left)
    except ValueError:  # evicted between the two calls: this request starts the window
        cache.add(key, 1, timeout=seconds + 1)
        return Window(1, left)


def peek(name: str, seconds: int) -> Window:
    """The count of `name` in its current window, without counting."""
    key, left = _window(name, seconds)
    redis = _redis()
    raw: Any = redis.get(key) if redis is not None else cache.get(key)  # sync client: bytes
    return Window(int(raw or 0), left)


def client_address(request: Any) -> str:
    """The address the request came from: the peer, or the client behind trusted proxies.

    With `API_TRUSTED_PROXIES` = n, each of n proxies appended the address it
    got the request from to `X-Forwarded-For`, so the n-th entry from the right
    was written by the first proxy about the client; anything to its left is
    the client's own text. Fewer entries than n: the left-most, the farthest a
    proxy wrote.
    """
    peer = str(request.META.get("REMOTE_ADDR", ""))
    proxies = int(getattr(settings, "API_TRUSTED_PROXIES", 0))
    forwarded = str(request.META.get("HTTP_X_FORWARDED_FOR", ""))
    if proxies <= 0 or not forwarded:
        return peer
    entries = [entry.strip() for entry in forwarded.split(",")]
    return entries[max(len(entries) - proxies, 0)] or peer


def parse_rate(rate: str | None) -> tuple[int | None, int]:
    """`"600/min"` -> (600, 60), as DRF reads its rates (s, m, h, d); None: no limit."""
    if rate is None:
        return None, 1
    number, period = rate.split("/")
    return int(number), PERIODS[period[0]]


class WindowThrottle(BaseThrottle):
    """A DRF throttle counting in `hit` windows; the rate from REST_FRAMEWORK's rates.

    The rate is read per request (DRF reads its settings once, at import; tests
    and a changed setting need the current one).
    """

    scope: str

    def __init__(self) -> None:
        from rest_framework.settings import api_settings

        self.limit, self.seconds = parse_rate(api_settings.DEFAULT_THROTTLE_RATES.get(self.scope))
        self.window: Window | None = None

    def ident(self, request: Request) -> str | None:
        """Who is counted (None: this throttle does not apply)."""
        raise NotImplementedError

    def allow_request(self, request: Request, view: Any) -> bool:
        ident = self.ident(request)
        if self.limit is None or ident is None:
            return True
        self.window = hit(f"{self.scope}:{ident}", self.seconds)
        return self.window.count <= self.limit

    def wait(self) -> float | None:
        return self.window.retry_after if self.window is not None else None
