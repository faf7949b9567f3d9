"""The fake provider's webhooks: every event POSTed, signed as Stripe signs them, retried.

`WebhookSender` is an event sink of `FakeState`: each new event (a payment
intent succeeded, declined or canceled, a refund made, completed or failed,
also when a refund fails on its own timer) is delivered to one endpoint as
`POST <url>` with the event's JSON as the body and the header

    Stripe-Signature: t=<unix time>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>

re-signed with a fresh timestamp on every attempt (as Stripe does). An answer
other than 2xx, or none, is retried after `backoff` seconds, doubling up to
`max_backoff`, at most `max_attempts` times in all; then the delivery is given
up (counted in `stats()["gave_up"]`; the event stays listed in `GET /v1/events`).
Deliveries run on a few threads of their own, never on the provider's request
threads, so a slow endpoint never slows a charge down.

Faults, by rate (seeded by `seed`) or queued for the next events
(`enqueue_faults`, or `POST /_fake/webhooks {"fault": "...", "count": N}`):

- `duplicate`: the event is delivered twice (two deliveries, same event id);
- `reorder`: the event is held back until the next event has been sent (at
  most `reorder_hold` seconds): the two arrive in the wrong order;
- `delay`: the first attempt waits `delay` seconds.

An event sent while the charge's own answer was dropped needs no fault of its
own: `drop_after_accept` charges (and so emits the event), then closes the socket.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import json
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import requests

logger = logging.getLogger(__name__)

WEBHOOK_FAULTS = ("duplicate", "reorder", "delay")
SIGNATURE_HEADER = "Stripe-Signature"


def sign(payload: bytes, secret: str, timestamp: int) -> str:
    """Return the `Stripe-Signature` header value for `payload` signed at `timestamp`."""
    signed = str(int(timestamp)).encode() + b"." + payload
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"t={int(timestamp)},v1={digest}"


@dataclass
class WebhookConfig:
    """How the sender delivers; every field can change over `POST /_fake/webhooks`."""

    duplicate_rate: float = 0.0
    reorder_rate: float = 0.0
    delay_rate: float = 0.0
    delay: float = 2.0  # seconds a delayed event waits before its first attempt
    reorder_hold: float = 2.0  # longest a reordered event waits for the next one
    max_attempts: int = 8
    backoff: float = 0.5  # seconds before the first retry; doubles each time
    max_backoff: float = 30.0
    timeout: float = 5.0  # per attempt
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError for rates outside 0..1 or non-positive counts and times."""
        for name in ("duplicate_rate", "reorder_rate", "delay_rate"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if int(self.max_attempts) < 1:
            raise ValueError("max_attempts must be at least 1")
        for name in ("delay", "reorder_hold", "backoff", "max_backoff"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must not be negative")
        if float(self.timeout) <= 0:
            raise ValueError("timeout must be positive")


@dataclass(order=True)
class _Delivery:
    due: float
    seq: int
    event_id: str = field(compare=False)
    event_type: str = field(compare=False)
    payload: bytes = field(compare=False, repr=False)
    attempt: int = field(default=0, compare=False)
    generation: int = field(default=0, compare=False)


class WebhookSender:
    """Deliver events to one endpoint, signed, retried, with faults; threads of its own."""

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        threads: int = 4,
        clock: Callable[[], float] = time.time,
        **config: Any,
    ) -> None:
        if not url or not secret:
            raise ValueError("a webhook sender needs a URL and a secret")
        self.url = url
        self.secret = secret
        self.clock = clock
        self.config = WebhookConfig(**config)
        self.config.validate()
        self._cond = threading.Condition()
        self._heap: list[_Delivery] = []
        self._seq = itertools.count()
        self._held: _Delivery | None = None  # a reordered event waiting for the next one
        self._faults: deque[str] = deque()
        self._rng = random.Random(self.config.seed)
        self._generation = 0
        self._in_flight = 0
        self._stats: Counter[str] = Counter()
        #: The last attempts (event id, type, attempt, HTTP status or 0), for tests and stats.
        self.log: deque[dict[str, Any]] = deque(maxlen=1000)
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"fake-webhooks-{n}", daemon=True)
            for n in range(threads)
        ]
        self._started = False

    # --- control ---------------------------------------------------------------

    def start(self) -> WebhookSender:
        with self._cond:
            if not self._started:
                self._started = True
                for thread in self._threads:
                    thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=self.config.timeout + 1)

    def configure(self, **changes: Any) -> WebhookConfig:
        """Change config fields (validated as a whole); a new seed restarts the RNG."""
        known = {f.name for f in fields(WebhookConfig)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown webhook config fields: {sorted(unknown)}")
        with self._cond:
            candidate = replace(self.config, **changes)
            candidate.validate()
            self.config = candidate
            if "seed" in changes:
                self._rng = random.Random(candidate.seed)
            return replace(candidate)

    def enqueue_faults(self, mode: str, count: int = 1) -> int:
        """Queue `count` faults for the next events; return the queue length."""
        if mode not in WEBHOOK_FAULTS:
            raise ValueError(f"unknown webhook fault {mode!r}; use one of {WEBHOOK_FAULTS}")
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._cond:
            self._faults.extend([mode] * count)
            return len(self._faults)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "url": self.url,
                "pending": len(self._heap) + (self._held is not None),
                "in_flight": self._in_flight,
                "faults_queued": list(self._faults),
                "config": asdict(self.config),
                **{
                    name: self._stats[name]
                    for name in (
                        "events",
                        "attempts",
                        "delivered",
                        "failed_attempts",
                        "gave_up",
                        "duplicated",
                        "reordered",
                        "delayed",
                    )
                },
            }

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until nothing is pending or in flight (every delivery ended)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._heap and self._held is None and self._in_flight == 0, timeout
            )

    # --- the sink ----------------------------------------------------------------

    def submit(self, event: dict[str, Any]) -> None:
        """Schedule the delivery of a new event (called by FakeState with its lock held)."""
        payload = json.dumps(event, separators=(",", ":")).encode()
        with self._cond:
            now = self.clock()
            self._stats["events"] += 1
            fault = self._next_fault()
            delivery = self._delivery(now, event, payload)
            if fault == "delay":
                self._stats["delayed"] += 1
                delivery.due = now + self.config.delay
            held, self._held = self._held, None
            if fault == "reorder":
                self._stats["reordered"] += 1
                delivery.due = now + self.config.reorder_hold  # unless a next event comes first
                self._held = delivery
            else:
                heapq.heappush(self._heap, delivery)
            if held is not None:
                # Sent after this event: out of order.
                held.due = max(delivery.due, now) + 0.05
                heapq.heappush(self._heap, held)
            if fault == "duplicate":
                self._stats["duplicated"] += 1
                heapq.heappush(self._heap, self._delivery(delivery.due + 0.05, event, payload))
            self._cond.notify_all()

    def clear(self) -> None:
        """Forget pending deliveries and counters (the provider was reset)."""
        with self._cond:
            self._generation += 1
            self._heap.clear()
            self._held = None
            self._faults.clear()
            self._stats.clear()
            self.log.clear()
            self._cond.notify_all()

    # --- internals -------------------------------------------------------------------

    def _delivery(self, due: float, event: dict[str, Any], payload: bytes) -> _Delivery:
        return _Delivery(
            due=due,
            seq=next(self._seq),
            event_id=str(event.get("id")),
            event_type=str(event.get("type")),
            payload=payload,
            generation=self._generation,
        )

    def _next_fault(self) -> str | None:
        if self._faults:
            return self._faults.popleft()
        for mode in WEBHOOK_FAULTS:
            rate = float(getattr(self.config, f"{mode}_rate"))
            if rate and self._rng.random() < rate:
                return mode
        return None

    def _next_due(self) -> _Delivery | None:
        """Pop the next due delivery, or wait for one (lock held). None: stopping."""
        while not self._stopping.is_set():
            now = self.clock()
            if self._held is not None and self._held.due <= now:
                heapq.heappush(self._heap, self._held)  # no next event came: send it anyway
                self._held = None
            if self._heap and self._heap[0].due <= now:
                return heapq.heappop(self._heap)
            dues = [d.due for d in (self._heap[:1] + ([self._held] if self._held else []))]
            self._cond.wait(timeout=min([0.5, *(due - now for due in dues)]))
        return None

    def _run(self) -> None:
        session = requests.Session()
        try:
            while True:
                with self._cond:
                    delivery = self._next_due()
                    if delivery is None:
                        return
                    self._in_flight += 1
                    delivery.attempt += 1
                    self._stats["attempts"] += 1
                status = self._post(session, delivery)
                with self._cond:
                    self._in_flight -= 1
                    self._after(delivery, status)
                    self._cond.notify_all()
        finally:
            session.close()

    def _post(self, session: requests.Session, delivery: _Delivery) -> int:
        headers = {
            "Content-Type": "application/json; charset=utf-8",
            "User-Agent": "FakeProvider/1.0 (+webhooks)",
            SIGNATURE_HEADER: sign(delivery.payload, self.secret, int(self.clock())),
        }
        try:
            response = session.post(
                self.url,
                data=delivery.payload,
                headers=headers,
                timeout=self.config.timeout,
                allow_redirects=False,
            )
        except requests.RequestException as exc:
            logger.debug(
                "webhook %s attempt %s failed: %s", delivery.event_id, delivery.attempt, exc
            )
            return 0
        response.close()
        return response.status_code

    def _after(self, delivery: _Delivery, status: int) -> None:
        """Count an attempt; schedule the retry or give up (lock held)."""
        self.log.append(
            {
                "event": delivery.event_id,
                "type": delivery.event_type,
                "attempt": delivery.attempt,
                "status": status,
                "at": self.clock(),
            }
        )
        if 200 <= status < 300:
            self._stats["delivered"] += 1
            return
        self._stats["failed_attempts"] += 1
        if delivery.generation != self._generation:
            return  # the provider was reset meanwhile
        if delivery.attempt >= self.config.max_attempts:
            self._stats["gave_up"] += 1
            logger.warning(
                "webhook %s given up after %s attempts (last status %s)",
                delivery.event_id,
                delivery.attempt,
                status or "no answer",
            )
            return
        wait = min(self.config.backoff * 2 ** (delivery.attempt - 1), self.config.max_backoff)
        delivery.due = self.clock() + wait
        heapq.heappush(self._heap, delivery)
