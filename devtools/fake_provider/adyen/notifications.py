"""The fake Adyen's standard webhooks: HMAC-signed items, one queue, retried until accepted.

`NotificationSender` is a notification sink of `AdyenState`: each item (an
AUTHORISATION, CAPTURE, REFUND or CANCELLATION) is signed once with the endpoint's HMAC
key (`additionalData.hmacSignature`) and POSTed as

    {"live": "false", "notificationItems": [{"NotificationRequestItem": {...}}]}

An attempt is accepted when the endpoint answers a 2xx whose body contains `[accepted]`
(`accept="[accepted]"`, the default) or any 2xx (`accept="2xx"`, Adyen's rule since
2024), within `timeout` seconds. Otherwise the same item is tried again after the next
of `retry_delays` (Adyen's schedule by default: three retries 9 s apart, then 2, 5, 10,
15, 30 minutes, 1, 2, 4, 8 hours, the last repeated) until it is accepted, `max_attempts`
is reached or `give_up_after` seconds have passed since it was first tried. There is one
queue, as at Adyen ("retry queues are separate for each webhook endpoint"): an item waits
until the one before it was accepted or given up.

Faults, queued (`enqueue_faults`) or by rate: `duplicate` (the item is sent twice, as
Adyen warns it may be). Deliveries run on a thread of their own, never on the API's.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import hmac
import json
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import requests

logger = logging.getLogger(__name__)

#: The fields of a NotificationRequestItem signed, in order (Adyen's "verify HMAC signatures").
SIGNED_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "value",
    "currency",
    "eventCode",
    "success",
)
#: Adyen's documented retry intervals, in seconds.
ADYEN_RETRY_DELAYS: tuple[float, ...] = (9.0, 9.0, 9.0)  # three retries, 9 s apart
ADYEN_RETRY_DELAYS += (120.0, 300.0, 600.0, 900.0, 1800.0)  # 2, 5, 10, 15, 30 minutes
ADYEN_RETRY_DELAYS += (3600.0, 7200.0, 14400.0, 28800.0)  # 1, 2, 4, 8 hours, the last repeated
ACCEPT_RULES = ("[accepted]", "2xx")
FAULTS = ("duplicate",)


def signing_string(item: dict[str, Any]) -> str:
    """Return the string Adyen signs for a standard webhook item."""
    values = {**item, "value": item["amount"]["value"], "currency": item["amount"]["currency"]}
    return ":".join(str(values.get(name, "")) for name in SIGNED_FIELDS)


def sign(item: dict[str, Any], hmac_key: str) -> str:
    """Return the item's `hmacSignature`: base64 HMAC-SHA256 with the hex-decoded key."""
    digest = hmac.new(binascii.unhexlify(hmac_key), signing_string(item).encode(), hashlib.sha256)
    return base64.b64encode(digest.digest()).decode()


@dataclass
class NotificationConfig:
    """How the sender delivers; every field can change over `POST /_fake/notifications`."""

    accept: str = "[accepted]"
    retry_delays: tuple[float, ...] = ADYEN_RETRY_DELAYS
    max_attempts: int | None = None  # None: until give_up_after
    give_up_after: float = 30 * 86400.0  # "we automatically retry ... for up to 30 days"
    timeout: float = 10.0  # "must accept a webhook within 10 seconds"
    delay: float = 0.0  # seconds before the first attempt
    duplicate_rate: float = 0.0
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError for a value the sender cannot act on."""
        if self.accept not in ACCEPT_RULES:
            raise ValueError(f"accept must be one of {ACCEPT_RULES}")
        if not self.retry_delays or any(float(d) < 0 for d in self.retry_delays):
            raise ValueError("retry_delays must be a non-empty list of seconds")
        if self.max_attempts is not None and int(self.max_attempts) < 1:
            raise ValueError("max_attempts must be at least 1")
        if float(self.timeout) <= 0 or float(self.give_up_after) < 0 or float(self.delay) < 0:
            raise ValueError("timeout must be positive, give_up_after and delay not negative")
        if not 0.0 <= float(self.duplicate_rate) <= 1.0:
            raise ValueError("duplicate_rate must be between 0 and 1")


@dataclass
class _Delivery:
    item: dict[str, Any]
    payload: bytes
    due: float
    generation: int
    attempts: int = 0
    first_attempt_at: float | None = None


class NotificationSender:
    """Deliver signed notification items to one endpoint, in order, retried until accepted."""

    def __init__(
        self,
        url: str,
        hmac_key: str,
        *,
        clock: Callable[[], float] = time.time,
        **config: Any,
    ) -> None:
        if not url or not hmac_key:
            raise ValueError("notifications need a URL and an HMAC key")
        try:
            binascii.unhexlify(hmac_key)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("the HMAC key must be hexadecimal, as Adyen's are") from exc
        self.url = url
        self._hmac_key = hmac_key
        self.clock = clock
        if "retry_delays" in config:
            config["retry_delays"] = tuple(config["retry_delays"])
        self.config = NotificationConfig(**config)
        self.config.validate()
        self._cond = threading.Condition()
        self._queue: deque[_Delivery] = deque()
        self._faults: deque[str] = deque()
        self._rng = random.Random(self.config.seed)
        self._generation = 0
        self._in_flight = False
        self._stats: Counter[str] = Counter()
        #: The last attempts: pspReference, eventCode, attempt, HTTP status (0: none), accepted.
        self.log: deque[dict[str, Any]] = deque(maxlen=1000)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-adyen-webhooks", daemon=True)

    # --- control ---------------------------------------------------------------

    def start(self) -> NotificationSender:
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.timeout + 1)

    def configure(self, **changes: Any) -> NotificationConfig:
        """Change config fields (validated as a whole); a new seed restarts the RNG."""
        unknown = set(changes) - {f.name for f in fields(NotificationConfig)}
        if unknown:
            raise ValueError(f"unknown notification config fields: {sorted(unknown)}")
        if "retry_delays" in changes:
            changes["retry_delays"] = tuple(changes["retry_delays"] or ())
        with self._cond:
            candidate = replace(self.config, **changes)
            candidate.validate()
            self.config = candidate
            if "seed" in changes:
                self._rng = random.Random(candidate.seed)
            self._cond.notify_all()
            return replace(candidate)

    def enqueue_faults(self, mode: str, count: int = 1) -> int:
        """Queue `count` faults for the next items; return the queue length."""
        if mode not in FAULTS:
            raise ValueError(f"unknown notification fault {mode!r}; use one of {FAULTS}")
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._cond:
            self._faults.extend([mode] * count)
            return len(self._faults)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            names = ("items", "attempts", "accepted", "failed_attempts", "gave_up", "duplicated")
            return {
                "url": self.url,
                "pending": len(self._queue),
                "in_flight": self._in_flight,
                "faults_queued": list(self._faults),
                "config": asdict(self.config),
                **{name: self._stats[name] for name in names},
            }

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every item was accepted or given up."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout)

    # --- the sink ----------------------------------------------------------------

    def submit(self, item: dict[str, Any]) -> None:
        """Sign an item and queue its delivery (called by AdyenState with its lock held)."""
        signed = copy.deepcopy(item)
        extra = dict(signed.get("additionalData") or {})
        extra["hmacSignature"] = sign(signed, self._hmac_key)
        signed["additionalData"] = extra
        body = {"live": "false", "notificationItems": [{"NotificationRequestItem": signed}]}
        payload = json.dumps(body, separators=(",", ":")).encode()
        with self._cond:
            self._stats["items"] += 1
            copies = 2 if self._next_fault() == "duplicate" else 1
            self._stats["duplicated"] += copies - 1
            due = self.clock() + float(self.config.delay)
            for _ in range(copies):
                self._queue.append(_Delivery(signed, payload, due, self._generation))
            self._cond.notify_all()

    def clear(self) -> None:
        """Forget queued items and counters (the fake was reset)."""
        with self._cond:
            self._generation += 1
            self._queue.clear()
            self._faults.clear()
            self._stats.clear()
            self.log.clear()
            self._cond.notify_all()

    # --- internals -------------------------------------------------------------------

    def _next_fault(self) -> str | None:
        if self._faults:
            return self._faults.popleft()
        rate = float(self.config.duplicate_rate)
        return "duplicate" if rate and self._rng.random() < rate else None

    def _next_due(self) -> _Delivery | None:
        """Wait for the head of the queue to be due (lock held). None: stopping."""
        while not self._stopping.is_set():
            if self._queue:
                wait = self._queue[0].due - self.clock()
                if wait <= 0:
                    return self._queue[0]
                self._cond.wait(timeout=min(wait, 0.5))
            else:
                self._cond.wait(timeout=0.5)
        return None

    def _run(self) -> None:
        session = requests.Session()
        try:
            while True:
                with self._cond:
                    delivery = self._next_due()
                    if delivery is None:
                        return
                    self._in_flight = True
                    delivery.attempts += 1
                    if delivery.first_attempt_at is None:
                        delivery.first_attempt_at = self.clock()
                    self._stats["attempts"] += 1
                    timeout, accept = float(self.config.timeout), self.config.accept
                status, accepted = _post(session, self.url, delivery.payload, timeout, accept)
                with self._cond:
                    self._in_flight = False
                    self._after(delivery, status, accepted)
                    self._cond.notify_all()
        finally:
            session.close()

    def _after(self, delivery: _Delivery, status: int, accepted: bool) -> None:
        """Count an attempt; pop the item, or schedule its retry (lock held)."""
        item = delivery.item
        self.log.append(
            {
                "pspReference": item["pspReference"],
                "eventCode": item["eventCode"],
                "attempt": delivery.attempts,
                "status": status,
                "accepted": accepted,
                "at": self.clock(),
            }
        )
        if (
            delivery.generation != self._generation
            or not self._queue
            or self._queue[0] is not delivery
        ):
            return  # the fake was reset meanwhile: the queue is a new one
        if accepted:
            self._stats["accepted"] += 1
            self._queue.popleft()
            return
        self._stats["failed_attempts"] += 1
        delays = self.config.retry_delays
        wait = float(delays[min(delivery.attempts - 1, len(delays) - 1)])
        started = delivery.first_attempt_at or self.clock()
        attempts_left = (
            self.config.max_attempts is None or delivery.attempts < self.config.max_attempts
        )
        if attempts_left and self.clock() + wait - started <= float(self.config.give_up_after):
            delivery.due = self.clock() + wait
            return
        self._stats["gave_up"] += 1
        self._queue.popleft()
        logger.warning(
            "notification %s %s given up after %s attempts (last status %s)",
            item["eventCode"],
            item["pspReference"],
            delivery.attempts,
            status or "no answer",
        )


def _post(
    session: requests.Session, url: str, payload: bytes, timeout: float, accept: str
) -> tuple[int, bool]:
    """POST one notification; return (HTTP status or 0, whether it was accepted)."""
    headers = {"Content-Type": "application/json", "User-Agent": "FakeAdyen/1.0 (+webhooks)"}
    try:
        response = session.post(
            url, data=payload, headers=headers, timeout=timeout, allow_redirects=False
        )
    except requests.RequestException as exc:
        logger.debug("notification attempt failed: %s", exc)
        return 0, False
    try:
        ok = 200 <= response.status_code < 300
        return response.status_code, ok and (accept == "2xx" or "[accepted]" in response.text)
    finally:
        response.close()
