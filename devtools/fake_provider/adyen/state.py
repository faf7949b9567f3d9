"""In-memory state of the fake Adyen: payments, modifications, idempotency keys, faults.

No HTTP here: `devtools.fake_provider.adyen.server` parses the requests and serves this
state. Every public method takes the one lock, so handler threads, the control API and
test assertions see one consistent picture; the clock is injectable so tests age keys
without sleeping. Each executed request (a payment, a capture, a refund, a cancel) is
announced to the notification sinks as a standard webhook item, unsigned: signing
belongs to the endpoint's HMAC key (`devtools.fake_provider.adyen.notifications`).
"""

from __future__ import annotations

import copy
import json
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

from devtools.fake_provider.adyen import contract, ledger
from devtools.fake_provider.adyen.ledger import Payment
from devtools.fake_provider.state import Reply

FAULT_MODES = ("drop_after_accept", "slow", "fail_before", "fail_after", "key_store_unavailable")
RATE_FIELDS = tuple(f"{mode}_rate" for mode in FAULT_MODES)
CAPTURE_MODES = ("immediate", "manual")
KEY_REUSE_ANSWERS = ("replay", "reject")


@dataclass
class AdyenConfig:
    """Runtime settings of the fake; every field can change over `POST /_fake/config`."""

    api_key: str | None = None  # None: any non-empty key
    #: The merchant accounts the key may use (empty: any).
    merchant_accounts: tuple[str, ...] = ()
    capture: str = "immediate"  # the merchant account's default: "immediate" or "manual"
    key_retention: float = contract.KEY_RETENTION_MINIMUM
    in_flight_status: int = 409  # Adyen documents 409 or 422 for a key still in flight
    key_reuse: str = "replay"  # a same key with another body: "replay" or "reject"
    seed: int | None = None
    drop_after_accept_rate: float = 0.0
    slow_rate: float = 0.0
    fail_before_rate: float = 0.0
    fail_after_rate: float = 0.0
    key_store_unavailable_rate: float = 0.0
    slow_delay: float = 12.0  # longer than a 10 s client read timeout
    latency: float = 0.0  # seconds every request takes before it is looked at

    def validate(self) -> None:
        """Raise ValueError for a value the fake cannot act on."""
        for name in RATE_FIELDS:
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if sum(float(getattr(self, name)) for name in RATE_FIELDS) > 1.0:
            raise ValueError("fault rates must add up to at most 1")
        for name in ("key_retention", "slow_delay", "latency"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {CAPTURE_MODES}")
        if self.in_flight_status not in contract.IN_FLIGHT_STATUSES:
            raise ValueError(f"in_flight_status must be one of {contract.IN_FLIGHT_STATUSES}")
        if self.key_reuse not in KEY_REUSE_ANSWERS:
            raise ValueError(f"key_reuse must be one of {KEY_REUSE_ANSWERS}")


class NotificationSink(Protocol):
    """Where new notification items go (the sender): `submit` must not block."""

    def submit(self, item: dict[str, Any]) -> None: ...

    def clear(self) -> None: ...


@dataclass
class _KeyRecord:
    fingerprint: str  # the endpoint and the canonical body
    created_at: float
    reply: Reply | None = None  # None while the first request is in flight


@dataclass
class _Stats:
    requests: Counter[str] = field(default_factory=Counter)
    replays: int = 0
    in_flight_rejections: int = 0
    key_reuse_other_body: int = 0
    faults: Counter[str] = field(default_factory=Counter)


#: What a request asks the state to do once its key and faults let it run.
Execute = Callable[[dict[str, Any]], Reply]


class AdyenState:
    """The fake Adyen's world; thread-safe, in memory, with its own clock."""

    def __init__(
        self, config: AdyenConfig | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or AdyenConfig()
        self.config.validate()
        self.clock = clock
        self._cond = threading.Condition()
        self._generation = 0
        self._sinks: list[NotificationSink] = []
        self._clear()

    def _clear(self) -> None:
        self._payments: dict[str, Payment] = {}
        self._timeline: list[dict[str, Any]] = []
        self._keys: dict[str, _KeyRecord] = {}
        self._faults: deque[str] = deque()
        self._stats = _Stats()
        self._in_flight = 0
        self._rng = random.Random(self.config.seed)

    # --- control -------------------------------------------------------------

    def reset(self) -> None:
        """Forget payments, modifications, keys, queued faults and counters; keep the config."""
        with self._cond:
            self._generation += 1
            self._clear()
            for sink in self._sinks:
                sink.clear()
            self._cond.notify_all()

    def configure(self, **changes: Any) -> AdyenConfig:
        """Change config fields (validated as a whole); a new seed restarts the RNG."""
        unknown = set(changes) - {f.name for f in fields(AdyenConfig)}
        if unknown:
            raise ValueError(f"unknown config fields: {sorted(unknown)}")
        if "merchant_accounts" in changes:
            changes["merchant_accounts"] = tuple(changes["merchant_accounts"] or ())
        with self._cond:
            candidate = replace(self.config, **changes)
            candidate.validate()
            self.config = candidate
            if "seed" in changes:
                self._rng = random.Random(candidate.seed)
            return replace(candidate)

    def enqueue_faults(self, mode: str, count: int = 1) -> int:
        """Queue `count` faults for the next payments and modifications; return the queue length."""
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}; use one of {FAULT_MODES}")
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._cond:
            self._faults.extend([mode] * count)
            return len(self._faults)

    def add_sink(self, sink: NotificationSink) -> None:
        """Send every new notification item to `sink` too (the sender)."""
        with self._cond:
            self._sinks.append(sink)

    def age(self, seconds: float) -> None:
        """Let `seconds` pass for the keys and payments held (a test's way to outlive a key)."""
        with self._cond:
            for record in self._keys.values():
                record.created_at -= seconds
            for payment in self._payments.values():
                payment.created_at -= seconds

    def check_api_key(self, key: str | None) -> bool:
        """Accept the configured key, or any non-empty key when none is configured."""
        if not key:
            return False
        expected = self.config.api_key
        return expected is None or _same(key, expected)

    def allows(self, merchant_account: str) -> bool:
        """Whether the key may act for this merchant account."""
        allowed = self.config.merchant_accounts
        return bool(merchant_account) and (not allowed or merchant_account in allowed)

    # --- reads for tests and the control API ------------------------------------

    def payment(self, psp: str) -> Payment | None:
        """Return a copy of a payment, or None (tests only: Adyen offers no such lookup)."""
        with self._cond:
            found = self._payments.get(psp)
            return copy.deepcopy(found) if found is not None else None

    def payments(self, *, reference: str | None = None) -> list[Payment]:
        """Return copies of the executed payments, oldest first, optionally by merchantReference."""
        with self._cond:
            rows = [p for p in self._payments.values() if reference in (None, p.reference)]
            return copy.deepcopy(rows)

    def authorised_count(self, *, reference: str | None = None) -> int:
        """Count the authorised payments (the real charges), optionally of one reference."""
        return sum(
            p.outcome.result_code == contract.AUTHORISED for p in self.payments(reference=reference)
        )

    def timeline(self) -> list[dict[str, Any]]:
        """Return what was executed, in order: payments and modifications with their outcome."""
        with self._cond:
            return copy.deepcopy(self._timeline)

    def stats(self) -> dict[str, Any]:
        """Return counters as plain JSON-able data."""
        with self._cond:
            kinds = Counter(row["eventCode"] for row in self._timeline)
            results = Counter(p.outcome.result_code for p in self._payments.values())
            failed = Counter(row["eventCode"] for row in self._timeline if not row["success"])
            return {
                "requests": dict(self._stats.requests),
                "payments": len(self._payments),
                "payments_by_result": dict(results),
                "modifications": {k: kinds[k] for k in contract.MODIFICATIONS.values()},
                "modifications_failed": {k: failed[k] for k in contract.MODIFICATIONS.values()},
                "replays": self._stats.replays,
                "in_flight_rejections": self._stats.in_flight_rejections,
                "key_reuse_other_body": self._stats.key_reuse_other_body,
                "faults_injected": dict(self._stats.faults),
                "faults_queued": list(self._faults),
                "in_flight": self._in_flight,
                "idempotency_keys": len(self._keys),
                "config": asdict(self.config) | {"api_key": None},
            }

    def wait_for_in_flight(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until `count` requests are held in flight (a rendezvous for tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight >= count, timeout)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no request is in flight (its answer is stored)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    # --- the API -------------------------------------------------------------------

    def authorise(
        self, body: dict[str, Any] | Reply, key: str | None, sleep: Callable[[float], object]
    ) -> Reply:
        """Handle `POST /v72/payments` (a parsed body, or the refusal of an unparsable one)."""
        return self._request("payments", "/payments", None, body, key, sleep, self._authorise)

    def modify(
        self,
        kind: str,
        payment_psp: str,
        body: dict[str, Any] | Reply,
        key: str | None,
        sleep: Callable[[float], object],
    ) -> Reply:
        """Handle `POST /v72/payments/{pspReference}/{captures|refunds|cancels}`."""

        def execute(parsed: dict[str, Any]) -> Reply:
            return self._modify(kind, payment_psp, parsed)

        endpoint = f"/payments/{payment_psp}/{kind}"
        return self._request(kind, endpoint, payment_psp, body, key, sleep, execute)

    # --- internals -------------------------------------------------------------------

    def _request(
        self,
        kind: str,
        endpoint: str,
        payment_psp: str | None,
        body: dict[str, Any] | Reply,
        key: str | None,
        sleep: Callable[[float], object],
        execute: Execute,
    ) -> Reply:
        fingerprint = endpoint + " " + _canonical(body)
        if self.config.latency:
            sleep(self.config.latency)  # outside the lock: concurrent requests overlap
        with self._cond:
            self._stats.requests[kind] += 1
            earlier = self._lookup(key, fingerprint) if key is not None else None
            if earlier is not None:
                return earlier
            refusal = body if isinstance(body, Reply) else self._refusal(payment_psp, body)
            if refusal is not None:
                return _keyed(refusal, key)  # nothing executed: not stored under the key
            fault = self._next_fault(keyed=key is not None)
            if fault == "key_store_unavailable":
                return _keyed(contract.key_store_unavailable(), key)
            if fault == "fail_before":
                return _keyed(contract.internal_error(), key)
            assert isinstance(body, dict)
            reply = _keyed(execute(body), key)
            answer = _keyed(contract.internal_error(), key) if fault == "fail_after" else reply
            generation = self._generation
            if fault == "slow":
                self._in_flight += 1  # held "processing": a same key meets a 704 meanwhile
                self._store(key, fingerprint, None)
                self._cond.notify_all()
            else:
                self._store(key, fingerprint, reply)
        if fault == "slow":
            try:
                sleep(self.config.slow_delay)
            finally:
                with self._cond:
                    if generation == self._generation:  # else a reset forgot it all
                        self._in_flight -= 1
                        self._store(key, fingerprint, reply)
                    self._cond.notify_all()
        return replace(answer, drop=True) if fault == "drop_after_accept" else answer

    def _lookup(self, key: str, fingerprint: str) -> Reply | None:
        """Return the answer an earlier use of `key` dictates, or None to execute (lock held)."""
        record = self._keys.get(key)
        if record is not None and self.clock() - record.created_at >= self.config.key_retention:
            del self._keys[key]  # past retention the key is new again: it would execute twice
            record = None
        if record is None:
            return None
        if record.reply is None:
            self._stats.in_flight_rejections += 1
            return _keyed(contract.in_progress(self.config.in_flight_status), key)
        if record.fingerprint != fingerprint:
            self._stats.key_reuse_other_body += 1
            if self.config.key_reuse == "reject":
                return _keyed(contract.in_progress(self.config.in_flight_status), key)
        self._stats.replays += 1
        return record.reply

    def _store(self, key: str | None, fingerprint: str, reply: Reply | None) -> None:
        if key is None:
            return
        earlier = self._keys.get(key)
        created_at = earlier.created_at if earlier is not None else self.clock()
        self._keys[key] = _KeyRecord(fingerprint, created_at, reply)

    def _next_fault(self, *, keyed: bool) -> str | None:
        fault = self._faults.popleft() if self._faults else self._draw_fault()
        if fault == "key_store_unavailable" and not keyed:
            return None  # only idempotent processing depends on the key store
        if fault is not None:
            self._stats.faults[fault] += 1
        return fault

    def _draw_fault(self) -> str | None:
        rates = [(mode, float(getattr(self.config, f"{mode}_rate"))) for mode in FAULT_MODES]
        if not any(rate for _, rate in rates):
            return None
        draw = self._rng.random()
        for mode, rate in rates:
            if draw < rate:
                return mode
            draw -= rate
        return None

    def _refusal(self, payment_psp: str | None, body: dict[str, Any]) -> Reply | None:
        """The synchronous refusal of a parsed request, or None (lock held)."""
        if not self.allows(str(body.get("merchantAccount") or "")):
            return contract.invalid_merchant_account()
        if payment_psp is None:
            return None
        payment = self._payments.get(payment_psp)
        if payment is None or payment.merchant_account != body["merchantAccount"]:
            return contract.unknown_payment()
        return None

    def _authorise(self, body: dict[str, Any]) -> Reply:
        payment, answer, executed = ledger.authorise(body, self.config.capture, self.clock())
        self._payments[payment.psp] = payment
        self._announce(executed)
        return Reply(200, answer)

    def _modify(self, kind: str, payment_psp: str, body: dict[str, Any]) -> Reply:
        answer, executed = ledger.modify(kind, self._payments[payment_psp], body, self.clock())
        self._announce(executed)
        return Reply(201, answer)

    def _announce(self, executed: ledger.Executed) -> None:
        """Record what was executed and send its notification item to the sinks (lock held)."""
        self._timeline.append(executed.timeline_row())
        item = executed.notification_item()
        for sink in self._sinks:
            sink.submit(copy.deepcopy(item))


def _canonical(body: dict[str, Any] | Reply) -> str:
    """The body as compared under a key: the same JSON whatever its spacing or key order."""
    if isinstance(body, Reply):
        return "<unparsable>"
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _keyed(reply: Reply, key: str | None) -> Reply:
    """Echo the key on the answer, as Adyen does to show it was processed idempotently."""
    if key is None or any(name == contract.IDEMPOTENCY_HEADER for name, _ in reply.headers):
        return reply
    return replace(reply, headers=(*reply.headers, (contract.IDEMPOTENCY_HEADER, key)))


def _same(given: str, expected: str) -> bool:
    # compare_digest: the time taken says nothing about the key.
    return secrets.compare_digest(given.encode(), expected.encode())
