"""The API's rate limits: atomic sliding-window counters, and the address a request came from.

Why not DRF's own throttle storage: `SimpleRateThrottle` reads a request
history from the cache and writes it back (get, then set), so N requests at
once all read the same history and all pass (60 concurrent got 60 x 200 at
30/min). Here every request is one atomic increment: in Redis one Lua script
(`INCR` and `EXPIRE` of the current window, `GET` of the previous one), so
each of N concurrent requests gets its own count and at most `limit` of them
pass, whatever the number of web processes. The windows are aligned to the
clock (the key names the window) and the count is sliding: this window's
count plus the previous one's weighted by the share of it the last period
still covers, so a burst at the end of one window and another at the start of
the next pass about the limit, not twice it. Small enough to own; the
libraries that do the same (django-ratelimit: cache `add` + `incr`, two
commands, fixed windows; pyrate-limiter: a sliding log per key) would be a new
dependency for thirty lines, or weaker. Without `API_RATE_REDIS_URL`
(development, tests) the counters live in the process's cache, whose
`add`/`incr` hold its lock. With the Redis unreachable (0.5 s timeouts) a
request is refused with 503 `rate_limiter_unavailable` (fail closed: an
unlimited API would let wrong keys be tried without end), logged at WARNING.

The address (for the wrong-key limit) is the peer's, `REMOTE_ADDR`: a client
writes whatever it likes into `X-Forwarded-For`. Behind `API_TRUSTED_PROXIES`
proxies that each append to that header, it is the right-most entry not
written by one of them. IPv6 addresses count by their /64.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, cast

from django.conf import settings
from django.core.cache import cache
from redis import Redis, RedisError
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle

KEY_PREFIX = "api-limit"
#: Seconds of each period DRF's rates name by their first letter ("600/min", "20/m").
PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: An IPv6 client is counted by its /64: one host is given a whole /64 to pick from.
IPV6_PREFIX = 64
#: Seconds a request waits for the limits' Redis before it is refused (503).
REDIS_TIMEOUT = 0.5
RETRY_AFTER_UNAVAILABLE = 5

logger = logging.getLogger(__name__)
_redis_clients: dict[str, Redis] = {}

#: Count one request in the current window; return it and the previous window's count.
#: KEYS: current, previous window; ARGV: the current key's time to live (two windows).
SLIDING_HIT = """
local current = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {current, tonumber(redis.call('GET', KEYS[2]) or '0')}
"""
#: Take one count back, unless the counter is gone (a DECR would make one without a TTL).
TAKE_BACK = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('DECR', KEYS[1]) end
return 0
"""


class RateLimiterUnavailable(exceptions.APIException):
    """The limits cannot be counted (their Redis is down): refuse rather than not limit."""

    status_code = 503
    default_code = "rate_limiter_unavailable"
    default_detail = "The rate limiter is unavailable; try again shortly."
    retry_after = RETRY_AFTER_UNAVAILABLE


@dataclass(frozen=True)
class Window:
    """One counter's state: the requests it weighs (this one included), seconds until its window
    ends, and the key it was counted under (to take a count back)."""

    count: int
    retry_after: int
    key: str = ""


def _redis() -> Redis | None:
    url = getattr(settings, "API_RATE_REDIS_URL", "")
    if not url:
        return None
    if url not in _redis_clients:  # one connection pool per process (thread-safe)
        _redis_clients[url] = Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
        )
    return _redis_clients[url]


def hit(name: str, seconds: int) -> Window:
    """Count one request against `name`: this window's count plus the previous one's, weighted
    by how much of the previous window the last `seconds` still cover (a sliding window)."""
    now = time.time()
    number = int(now // seconds)
    key = f"{KEY_PREFIX}:{name}:{seconds}:{number}"
    previous_key = f"{KEY_PREFIX}:{name}:{seconds}:{number - 1}"
    current, previous = _count(key, previous_key, 2 * seconds + 1)
    overlap = 1 - (now - number * seconds) / seconds
    left = max(1, math.ceil((number + 1) * seconds - now))
    return Window(math.ceil(current + previous * overlap), left, key)


def _count(key: str, previous_key: str, ttl: int) -> tuple[int, int]:
    redis = _redis()
    if redis is None:
        return _count_in_cache(key, ttl), int(cache.get(previous_key) or 0)
    try:
        current, previous = cast(list[int], redis.eval(SLIDING_HIT, 2, key, previous_key, ttl))
    except RedisError as exc:
        logger.warning("API rate limiter unavailable (%s): request refused", type(exc).__name__)
        raise RateLimiterUnavailable() from exc
    return int(current), int(previous)


def _count_in_cache(key: str, ttl: int) -> int:
    cache.add(key, 0, timeout=ttl)
    try:
        return int(cache.incr(key))
    except ValueError:  # evicted between the two calls: this request starts the window
        cache.add(key, 1, timeout=ttl)
        return 1


def take_back(window: Window) -> None:
    """Uncount the request `window` counted (it turned out not to be what is limited)."""
    redis = _redis()
    try:
        if redis is not None:
            redis.eval(TAKE_BACK, 1, window.key)
        else:
            cache.decr(window.key)
    except (RedisError, ValueError):  # gone, or unreachable: it only counts for longer
        pass


def client_address(request: Any) -> str:
    """The address the request came from: the peer, or the client behind trusted proxies.

    With `API_TRUSTED_PROXIES` = n, each of n proxies appended the address it
    got the request from to `X-Forwarded-For`, so the n-th entry from the right
    was written by the first proxy about the client; anything to its left is
    the client's own text. Fewer entries than n: the left-most, the farthest a
    proxy wrote. An entry that is no IP address is ignored (the peer counts).
    An IPv6 address counts by its /64, an IPv4-mapped one as its IPv4 address.
    """
    peer = str(request.META.get("REMOTE_ADDR", ""))
    proxies = int(getattr(settings, "API_TRUSTED_PROXIES", 0))
    forwarded = str(request.META.get("HTTP_X_FORWARDED_FOR", ""))
    if proxies > 0 and forwarded:
        entries = [entry.strip() for entry in forwarded.split(",")]
        named = _network(entries[max(len(entries) - proxies, 0)])
        if named is not None:
            return named
    return _network(peer) or peer


def _network(text: str) -> str | None:
    """`text` as the address it is counted by, or None if it is no IP address."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/{IPV6_PREFIX}", strict=False))
    return str(address)


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
