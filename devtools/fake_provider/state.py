"""In-memory state of the fake payment provider: intents, refunds, idempotency keys, faults.

No HTTP here and no database: `devtools.fake_provider.server` serves this state over
a real socket. Every public method takes the one lock, so handler threads,
the control API and test assertions see a consistent picture. The clock is
injectable so tests can age keys and intents without sleeping.

An intent is created (confirmed at once or not), confirmed later
(`confirm_payment_intent`) or canceled (`cancel_payment_intent`), with the
statuses and refusals Stripe has. With `capture_method=manual` a good card
only authorises: the intent waits in `requires_capture` holding
`amount_capturable` until `capture_payment_intent` takes all or part of it
(`amount_received`; the rest is released) or a cancel releases it all.
Refunds and their later states live in `devtools.fake_provider.refunds`.
"""

from __future__ import annotations

import copy
import operator
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol, TypeVar

from devtools.fake_provider.refunds import NEW_REFUND_STATUSES, RefundDesk, Refusal
from devtools.fake_provider.refunds import REFUND_REASONS as REFUND_REASONS  # re-exported

FAULT_MODES = ("drop_after_accept", "slow", "fail_before", "fail_after", "rate_limit")
RATE_FIELDS = tuple(f"{mode}_rate" for mode in FAULT_MODES)
SUCCEEDING_CARDS = frozenset({"pm_card_visa", "pm_card_mastercard", "pm_card_amex"})
DECLINING_CARDS = {
    "pm_card_chargeDeclined": "generic_decline",
    "pm_card_chargeDeclinedInsufficientFunds": "insufficient_funds",
}
_API_ERROR = {"type": "api_error", "message": "An unknown error occurred on the fake provider."}
PAYMENT_INTENTS_ENDPOINT = "/v1/payment_intents"
REFUNDS_ENDPOINT = "/v1/refunds"
EVENTS_ENDPOINT = "/v1/events"
#: The API version the fake's events claim (Stripe stamps every event with one).
EVENT_API_VERSION = "2024-06-20"
#: Stripe's error code for an action the intent's status does not allow.
UNEXPECTED_STATE = "payment_intent_unexpected_state"
CONFIRMABLE = ("requires_payment_method", "requires_confirmation", "requires_action")
CANCELABLE = (
    "requires_payment_method",
    "requires_capture",
    "requires_confirmation",
    "requires_action",
    "processing",
)
CANCELLATION_REASONS = ("duplicate", "fraudulent", "requested_by_customer", "abandoned")
#: Stripe's `capture_method` values the fake knows; `automatic` is the default.
CAPTURE_METHODS = ("automatic", "manual")
CAPTURABLE = ("requires_capture",)
#: The code of a capture of more than the intent holds. Stripe's answer is an
#: invalid_request_error "the requested capture amount is greater than the
#: authorized amount"; its code is taken to be the general `amount_too_large`.
CAPTURE_TOO_LARGE = "amount_too_large"


@dataclass(frozen=True)
class Reply:
    """An HTTP answer to send, or `drop` to close the socket without one."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()
    drop: bool = False


@dataclass
class FakeConfig:
    """Runtime settings of the fake; every field can change over `/_fake/config`."""

    api_key: str | None = None  # None: accept any key that starts with "sk_"
    seed: int | None = None
    drop_after_accept_rate: float = 0.0
    slow_rate: float = 0.0
    fail_before_rate: float = 0.0
    fail_after_rate: float = 0.0
    rate_limit_rate: float = 0.0
    slow_delay: float = 12.0  # longer than the client's default 10 s read timeout
    latency: float = 0.0  # seconds every create takes, as a real provider's does
    search_lag: float = 0.0
    key_retention: float = 86400.0
    refund_status: str = "succeeded"  # what a new refund starts as: "succeeded" or "pending"
    refund_fail_after: float = 0.0  # > 0: every refund fails this many seconds after it succeeded
    #: Seconds added to the fake's clock (negative: it acts in the past), so a test can
    #: make what a request "long ago" made, with `created` times to match.
    clock_offset: float = 0.0

    def validate(self) -> None:
        """Raise ValueError for rates outside 0..1, a rate sum above 1 or negative times."""
        for name in RATE_FIELDS:
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if sum(float(getattr(self, name)) for name in RATE_FIELDS) > 1.0:
            raise ValueError("fault rates must add up to at most 1")
        for name in ("slow_delay", "latency", "search_lag", "key_retention", "refund_fail_after"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.refund_status not in NEW_REFUND_STATUSES:
            raise ValueError(f"refund_status must be one of {NEW_REFUND_STATUSES}")


def error_reply(status: int, error_type: str, message: str, **extra: Any) -> Reply:
    """Build a Stripe-shaped error answer."""
    return Reply(status, {"error": {"type": error_type, "message": message, **extra}})


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> Reply:
    """Build a 400 invalid_request_error."""
    extra = {k: v for k, v in {"param": param, "code": code}.items() if v is not None}
    return error_reply(400, "invalid_request_error", message, **extra)


@dataclass
class _KeyRecord:
    fingerprint: tuple[tuple[str, str], ...]
    created_at: float
    reply: Reply | None = None  # None while the first request is in flight
    endpoint: str = PAYMENT_INTENTS_ENDPOINT  # a key belongs to the endpoint it was first used on


@dataclass
class _Intent:
    data: dict[str, Any]
    created_at: float
    seq: int
    charge_id: str | None = None  # the charge, once the card was charged or authorised
    refunded: int = 0  # what its pending and succeeded refunds hold (Stripe keeps it on the charge)
    succeeded: tuple[float, int] | None = None  # (fake clock time, order of successes)


@dataclass
class _Event:
    data: dict[str, Any]
    seq: int


class EventSink(Protocol):
    """Where new events go (the webhook sender): `submit` must not block."""

    def submit(self, event: dict[str, Any]) -> None: ...

    def clear(self) -> None: ...


@dataclass
class _Stats:
    create_requests: int = 0
    replays: int = 0
    idempotency_conflicts: int = 0
    in_flight_rejections: int = 0
    faults: Counter[str] = field(default_factory=Counter)


def _matches(data: Mapping[str, Any], clauses: Iterable[tuple[str, str]]) -> bool:
    for path, value in clauses:
        if path.startswith("metadata."):
            if data["metadata"].get(path.removeprefix("metadata.")) != value:
                return False
        elif str(data.get(path)) != value:
            return False
    return True


class FakeState:
    """The fake provider's world; thread-safe, in memory, with its own clock."""

    def clock(self) -> float:
        """The fake's time: the injected clock, shifted by `clock_offset`."""
        return self._base_clock() + self.config.clock_offset

    def __init__(self, config: FakeConfig | None = None, *, clock: Callable[[], float] = time.time):
        self.config = config or FakeConfig()
        self.config.validate()
        self._base_clock = clock
        self._cond = threading.Condition()
        self._generation = 0
        self._sinks: list[EventSink] = []
        self._closed = False
        self._failer: threading.Thread | None = None  # fails refunds on time (refund_fail_after)
        self._clear()

    def _clear(self) -> None:
        self._intents: dict[str, _Intent] = {}
        self._events: dict[str, _Event] = {}
        self._keys: dict[str, _KeyRecord] = {}
        self._faults: deque[str] = deque()
        self._stats = _Stats()  # payment intent creates (the charges)
        self._refund_stats = _Stats()
        self._confirm_stats = _Stats()
        self._cancel_stats = _Stats()
        self._capture_stats = _Stats()
        self._seq = 0
        self._in_flight = 0
        self._rng = random.Random(self.config.seed)
        #: A provider incident (start_incident): until when, and the share of answers dropped.
        self._incident_until = 0.0
        self._incident_drop_rate = 0.0
        # A new desk: scheduled refund failures of the old world are forgotten with it.
        self._desk = RefundDesk(self._intents, self._emit, self._next_seq)

    # --- control -------------------------------------------------------------

    def reset(self) -> None:
        """Forget intents, refunds, keys, queued faults and counters; keep the config."""
        with self._cond:
            self._generation += 1
            self._clear()
            for sink in self._sinks:
                sink.clear()
            self._cond.notify_all()

    def age(self, seconds: float) -> None:
        """Let `seconds` pass for everything the fake holds: objects, events and keys.

        Every `created` (and the times keys are kept from) moves back, as if it
        had all happened that much earlier: a test that moves the database's
        timestamps back (time passing) moves the provider's with them, so the
        two still agree on when a request was made.
        """
        with self._cond:
            whole = int(seconds)
            for intent in self._intents.values():
                intent.created_at -= seconds
                intent.data["created"] -= whole
            for refund in self._desk.records.values():
                refund.created_at -= seconds
                refund.data["created"] -= whole
            for event in self._events.values():
                event.data["created"] -= whole
            for record in self._keys.values():
                record.created_at -= seconds

    def close(self) -> None:
        """Stop the thread that fails refunds on time; the state stays readable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            failer, self._failer = self._failer, None
        if failer is not None:
            failer.join(timeout=2)

    def add_event_sink(self, sink: EventSink) -> None:
        """Send every new event to `sink` too (the webhook sender)."""
        with self._cond:
            self._sinks.append(sink)

    def configure(self, **changes: Any) -> FakeConfig:
        """Change config fields (validated as a whole); a new seed restarts the RNG."""
        known = {f.name for f in fields(FakeConfig)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown config fields: {sorted(unknown)}")
        with self._cond:
            candidate = replace(self.config, **changes)
            candidate.validate()
            self.config = candidate
            if "seed" in changes:
                self._rng = random.Random(candidate.seed)
            return replace(candidate)

    def start_incident(self, seconds: float, drop_rate: float = 0.3) -> dict[str, Any]:
        """A provider incident for `seconds`: every new request is executed and then either
        held in flight until the incident ends (a same-key request meanwhile is answered
        `409 idempotency_key_in_use`) or, at `drop_rate`, answered by a dropped connection.
        Reads (retrieve, lists) are answered as usual. Ends by itself; returns its figures.
        """
        if seconds < 0 or not 0.0 <= drop_rate <= 1.0:
            raise ValueError("seconds must not be negative, drop_rate between 0 and 1")
        with self._cond:
            self._incident_until = self.clock() + seconds
            self._incident_drop_rate = drop_rate
            return self.incident()

    def incident(self) -> dict[str, Any]:
        """The incident now: whether it runs, the seconds left, its drop rate."""
        left = max(self._incident_until - self.clock(), 0.0)
        return {
            "active": left > 0,
            "seconds_left": round(left, 3),
            "drop_rate": self._incident_drop_rate,
        }

    def enqueue_faults(self, mode: str, count: int = 1) -> int:
        """Queue `count` faults for the next creates, confirms, captures and refunds.

        Return the queue length.
        """
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}; use one of {FAULT_MODES}")
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._cond:
            self._faults.extend([mode] * count)
            return len(self._faults)

    def check_api_key(self, key: str | None) -> bool:
        """Accept the configured key, or any `sk_` key when none is configured."""
        if not key:
            return False
        expected = self.config.api_key
        return secrets.compare_digest(key, expected) if expected else key.startswith("sk_")

    def complete_refund(self, refund_id: str) -> dict[str, Any]:
        """Let a pending refund succeed (`refund.updated`, `charge.refunded`); return it.

        Raise KeyError for an unknown refund, ValueError when it is not pending.
        """
        with self._cond:
            self._fail_due_refunds()
            refund = self._desk.complete(
                refund_id, now=self.clock(), fail_after=self.config.refund_fail_after
            )
            self._wake_failer()
            return refund

    def fail_refund(self, refund_id: str, reason: str = "lost_or_stolen_card") -> dict[str, Any]:
        """Fail a pending or succeeded refund; its amount goes back to the charge; return it.

        Emits `refund.updated` and `refund.failed`. Raise KeyError for an unknown
        refund, ValueError for another status or an unknown failure reason.
        """
        with self._cond:
            self._fail_due_refunds()
            return self._desk.fail(refund_id, reason=reason)

    # --- assertions for tests ------------------------------------------------

    def intents(self, *, metadata: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Return copies of all intents, oldest first, optionally filtered by metadata."""
        clauses = [("metadata." + k, v) for k, v in (metadata or {}).items()]
        with self._cond:
            rows = sorted(self._intents.values(), key=lambda i: i.seq)
            return [copy.deepcopy(i.data) for i in rows if _matches(i.data, clauses)]

    def refunds(
        self,
        *,
        payment_intent: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Return copies of all refunds, oldest first, optionally filtered by intent and metadata."""
        clauses = [("metadata." + k, v) for k, v in (metadata or {}).items()]
        if payment_intent is not None:
            clauses.append(("payment_intent", payment_intent))
        with self._cond:
            self._fail_due_refunds()
            rows = sorted(self._desk.records.values(), key=lambda r: r.seq)
            return [copy.deepcopy(r.data) for r in rows if _matches(r.data, clauses)]

    def events(self, *, type: str | None = None) -> list[dict[str, Any]]:  # noqa: A002
        """Return copies of all events, oldest first, optionally of one type."""
        with self._cond:
            self._fail_due_refunds()
            rows = sorted(self._events.values(), key=lambda e: e.seq)
            return [copy.deepcopy(e.data) for e in rows if type in (None, e.data["type"])]

    def timeline(self) -> list[dict[str, Any]]:
        """Return when each charge and refund succeeded, to the microsecond, in that order.

        An object's `created` is whole seconds, as at Stripe; this is the fake's
        own clock at the moment the charge or the refund succeeded (at its
        create, its confirm, its capture or when a pending refund completed;
        before any fault delayed or dropped its answer), for the chaos run's
        latencies. A refund that failed after it succeeded stays listed: it was
        reported succeeded. A manual intent is listed when it was captured.
        """
        with self._cond:
            self._fail_due_refunds()
            rows = [
                (i.succeeded, "payment_intent", i.data)
                for i in self._intents.values()
                if i.succeeded is not None
            ] + [
                (r.succeeded, "refund", r.data)
                for r in self._desk.records.values()
                if r.succeeded is not None
            ]
            rows.sort(key=lambda row: row[0][1])
            return [
                {
                    "object": kind,
                    "id": data["id"],
                    "metadata": dict(data["metadata"]),
                    "succeeded_at": at,
                }
                for (at, _), kind, data in rows
            ]

    def succeeded_count(self, *, metadata: Mapping[str, str] | None = None) -> int:
        """Count succeeded intents (the number of real charges)."""
        return sum(1 for i in self.intents(metadata=metadata) if i["status"] == "succeeded")

    def stats(self) -> dict[str, Any]:
        """Return counters as plain JSON-able data.

        The top-level request counters are about payment intent creates (the
        charges); confirms, cancels, captures and refund creates have their own
        under `confirm`, `cancel`, `capture` and `refunds` (`confirm_requests`,
        `cancel_requests`, `capture_requests` and `cancels`, the intents
        canceled, are repeated at the top). The fault queue, `in_flight` and
        `idempotency_keys` are shared by all.
        """
        with self._cond:
            self._fail_due_refunds()
            by_status = Counter(i.data["status"] for i in self._intents.values())
            refunds = self._desk.records.values()
            return {
                "create_requests": self._stats.create_requests,
                "confirm_requests": self._confirm_stats.create_requests,
                "cancel_requests": self._cancel_stats.create_requests,
                "capture_requests": self._capture_stats.create_requests,
                "cancels": by_status["canceled"],
                "intents": len(self._intents),
                "intents_by_status": dict(by_status),
                "replays": self._stats.replays,
                "idempotency_conflicts": self._stats.idempotency_conflicts,
                "in_flight_rejections": self._stats.in_flight_rejections,
                "faults_injected": dict(self._stats.faults),
                "faults_queued": list(self._faults),
                "in_flight": self._in_flight,
                "incident": self.incident(),
                "idempotency_keys": len(self._keys),
                "events": len(self._events),
                "confirm": _stats_of(self._confirm_stats),
                "cancel": _stats_of(self._cancel_stats),
                "capture": _stats_of(self._capture_stats),
                "refunds": {
                    **_stats_of(self._refund_stats),
                    "count": len(refunds),
                    # What the charges give back or hold for pending refunds.
                    "amount": sum(
                        r.data["amount"]
                        for r in refunds
                        if r.data["status"] in ("pending", "succeeded")
                    ),
                    "by_status": dict(Counter(r.data["status"] for r in refunds)),
                },
                "config": asdict(self.config) | {"api_key": None},
            }

    def wait_for_in_flight(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until `count` create requests are in flight (a rendezvous for tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight >= count, timeout)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no create request is in flight (its answer is stored)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout)

    # --- API -------------------------------------------------------------------

    def create_payment_intent(
        self,
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> Reply:
        """Handle `POST /v1/payment_intents` with idempotency and fault injection.

        `params` are the raw form pairs (the key's fingerprint); `parsed` is their
        validated form or the 400 to answer, which only counts once the key
        lookup lets the request execute, as at Stripe.
        """
        return self._create(
            PAYMENT_INTENTS_ENDPOINT,
            self._stats,
            self._execute,
            params,
            parsed,
            idempotency_key,
            sleep,
        )

    def create_refund(
        self,
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> Reply:
        """Handle `POST /v1/refunds`: the same idempotency and faults as intent creates.

        Refusals that depend on the intent (missing, not succeeded, fully
        refunded, more than is left) happen while executing, so the key stores
        them like any answer; a `parsed` 400 (bad parameters) is never stored.
        """
        return self._create(
            REFUNDS_ENDPOINT,
            self._refund_stats,
            self._execute_refund,
            params,
            parsed,
            idempotency_key,
            sleep,
        )

    def confirm_payment_intent(
        self,
        pi_id: str,
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> Reply:
        """Handle `POST /v1/payment_intents/{id}/confirm`: charge with the payment method.

        The same idempotency and faults as creates; the path is the key's
        endpoint, so a key belongs to the confirm of one intent. A decline is a
        402 that leaves the intent in `requires_payment_method`; a succeeded or
        canceled intent refuses with a 400 `payment_intent_unexpected_state`
        carrying the intent.
        """
        return self._create(
            f"{PAYMENT_INTENTS_ENDPOINT}/{pi_id}/confirm",
            self._confirm_stats,
            lambda checked: self._execute_confirm(pi_id, checked),
            params,
            parsed,
            idempotency_key,
            sleep,
        )

    def cancel_payment_intent(
        self,
        pi_id: str,
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> Reply:
        """Handle `POST /v1/payment_intents/{id}/cancel` under an optional key; no faults.

        Faults stay for the requests that charge or refund, so a queued fault
        still hits the create it was queued for.
        """
        return self._create(
            f"{PAYMENT_INTENTS_ENDPOINT}/{pi_id}/cancel",
            self._cancel_stats,
            lambda checked: self._execute_cancel(pi_id, checked),
            params,
            parsed,
            idempotency_key,
            sleep,
            faults=False,
        )

    def capture_payment_intent(
        self,
        pi_id: str,
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object] = time.sleep,
    ) -> Reply:
        """Handle `POST /v1/payment_intents/{id}/capture`: take what a manual intent holds.

        The same idempotency and faults as confirms; a key belongs to one
        intent's capture path. `amount_to_capture` (default: all of
        `amount_capturable`) becomes `amount_received`, the rest is released.
        An intent not in `requires_capture` refuses with a 400
        `payment_intent_unexpected_state` carrying the intent; more than it
        holds is a 400 `amount_to_capture` refusal. Both refusals are stored
        under the key (the request executed), as a refund's are.
        """
        return self._create(
            f"{PAYMENT_INTENTS_ENDPOINT}/{pi_id}/capture",
            self._capture_stats,
            lambda checked: self._execute_capture(pi_id, checked),
            params,
            parsed,
            idempotency_key,
            sleep,
        )

    def _create(
        self,
        endpoint: str,
        stats: _Stats,
        execute: Callable[[dict[str, Any]], Reply],
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object],
        *,
        faults: bool = True,
    ) -> Reply:
        fingerprint = tuple(sorted(params))
        if self.config.latency and faults:
            sleep(self.config.latency)  # outside the lock: concurrent requests overlap
        with self._cond:
            stats.create_requests += 1
            if idempotency_key is not None:
                earlier = self._lookup_key(idempotency_key, fingerprint, endpoint, stats)
                if earlier is not None:
                    return earlier
            if isinstance(parsed, Reply):
                return parsed
            fault = self._next_fault() if faults else None
            delay = self.config.slow_delay
            held = self._incident_until - self.clock() if faults else 0.0
            if held > 0:  # an incident: held until it ends, or the answer dropped
                dropped = self._rng.random() < self._incident_drop_rate
                fault, delay = ("drop_after_accept", 0.0) if dropped else ("slow", held)
            if fault is not None:
                stats.faults[fault] += 1
            if fault == "rate_limit":
                return error_reply(
                    429, "invalid_request_error", "Too many requests.", code="rate_limit"
                )
            if fault == "fail_before":
                return Reply(500, {"error": dict(_API_ERROR)}, (("Stripe-Should-Retry", "true"),))
            reply = execute(parsed)
            if fault == "fail_after":
                reply = Reply(500, {"error": dict(_API_ERROR)})
            generation = self._generation
            if fault == "slow":
                # Hold the key in flight while "processing", so a concurrent
                # request with the same key meets a 409 as at Stripe.
                self._begin(idempotency_key, fingerprint, endpoint)
            else:
                self._store(idempotency_key, fingerprint, reply, endpoint)
        if fault == "slow":
            try:
                sleep(delay)
            finally:
                with self._cond:
                    if generation == self._generation:  # else a reset forgot it all
                        self._in_flight -= 1
                        self._store(idempotency_key, fingerprint, reply, endpoint)
                    self._cond.notify_all()
        if fault == "drop_after_accept":
            reply = replace(reply, drop=True)
        return reply

    def retrieve_payment_intent(self, pi_id: str) -> Reply:
        """Handle `GET /v1/payment_intents/{id}`."""
        with self._cond:
            intent = self._intents.get(pi_id)
            if intent is None:
                return error_reply(
                    404,
                    "invalid_request_error",
                    "No such payment_intent.",
                    code="resource_missing",
                    param="intent",
                )
            return Reply(200, copy.deepcopy(intent.data))

    def search_payment_intents(
        self, clauses: list[tuple[str, str]], limit: int, offset: int = 0
    ) -> Reply:
        """Handle search for parsed clauses; only intents older than `search_lag` are found."""
        with self._cond:
            horizon = self.clock() - self.config.search_lag
            hits = [
                i
                for i in self._newest_first()
                if i.created_at <= horizon and _matches(i.data, clauses)
            ]
            data = [copy.deepcopy(i.data) for i in hits[offset : offset + limit]]
        has_more = offset + limit < len(hits)
        return Reply(
            200,
            {
                "object": "search_result",
                "data": data,
                "has_more": has_more,
                "next_page": f"page_{offset + limit}" if has_more else None,
                "url": "/v1/payment_intents/search",
            },
        )

    def list_payment_intents(
        self,
        *,
        limit: int,
        created: Mapping[str, int],
        starting_after: str | None = None,
        ending_before: str | None = None,
    ) -> Reply:
        """Handle the list endpoint: newest first, cursor pagination, created filters.

        `created` maps `gt`, `gte`, `lt`, `lte` and `eq` (a plain `created=`) to
        Unix times; all of them apply together, within the cursor's pages.
        """
        with self._cond:
            rows = [i for i in self._newest_first() if _created_in(i.data, created)]
            cursor = starting_after or ending_before
            if cursor is not None and cursor not in self._intents:
                param = "starting_after" if starting_after else "ending_before"
                return invalid("No such payment_intent.", param=param, code="resource_missing")
            page, has_more = _page(rows, limit, starting_after, ending_before)
            data = [copy.deepcopy(i.data) for i in page]
        return _list_reply(data, has_more, PAYMENT_INTENTS_ENDPOINT)

    def retrieve_refund(self, refund_id: str) -> Reply:
        """Handle `GET /v1/refunds/{id}`."""
        with self._cond:
            self._fail_due_refunds()
            refund = self._desk.records.get(refund_id)
            if refund is None:
                return error_reply(
                    404,
                    "invalid_request_error",
                    f"No such refund: '{refund_id}'",
                    code="resource_missing",
                    param="id",
                )
            return Reply(200, copy.deepcopy(refund.data))

    def list_refunds(
        self,
        *,
        limit: int,
        created: Mapping[str, int] | None = None,
        payment_intent: str | None = None,
        starting_after: str | None = None,
        ending_before: str | None = None,
    ) -> Reply:
        """Handle `GET /v1/refunds`: newest first, cursor pagination, by intent and created."""
        with self._cond:
            self._fail_due_refunds()
            rows = [
                r
                for r in self._desk.newest_first(payment_intent)
                if _created_in(r.data, created or {})
            ]
            cursor = starting_after or ending_before
            if cursor is not None and cursor not in self._desk.records:
                param = "starting_after" if starting_after else "ending_before"
                return invalid(f"No such refund: '{cursor}'", param=param, code="resource_missing")
            page, has_more = _page(rows, limit, starting_after, ending_before)
            data = [copy.deepcopy(r.data) for r in page]
        return _list_reply(data, has_more, REFUNDS_ENDPOINT)

    def list_events(
        self,
        *,
        limit: int,
        created: Mapping[str, int],
        types: Iterable[str] = (),
        starting_after: str | None = None,
        ending_before: str | None = None,
    ) -> Reply:
        """Handle `GET /v1/events`: newest first, cursor pagination, created and type filters."""
        wanted = set(types)
        with self._cond:
            self._fail_due_refunds()
            newest_first = sorted(self._events.values(), key=lambda e: e.seq, reverse=True)
            rows = [
                e
                for e in newest_first
                if _created_in(e.data, created) and (not wanted or e.data["type"] in wanted)
            ]
            cursor = starting_after or ending_before
            if cursor is not None and cursor not in self._events:
                param = "starting_after" if starting_after else "ending_before"
                return invalid(f"No such event: '{cursor}'", param=param, code="resource_missing")
            page, has_more = _page(rows, limit, starting_after, ending_before)
            data = [copy.deepcopy(e.data) for e in page]
        return _list_reply(data, has_more, EVENTS_ENDPOINT)

    # --- internals (call with the lock held) -----------------------------------

    def _emit(self, event_type: str, obj: dict[str, Any]) -> None:
        """Record a Stripe-shaped event about `obj` and hand it to the sinks (lock held)."""
        event_id = "evt_" + secrets.token_hex(12)
        event: dict[str, Any] = {
            "id": event_id,
            "object": "event",
            "api_version": EVENT_API_VERSION,
            "created": int(self.clock()),
            "data": {"object": copy.deepcopy(obj)},
            "livemode": False,
            "pending_webhooks": len(self._sinks),
            "request": {"id": None, "idempotency_key": None},
            "type": event_type,
        }
        self._seq += 1
        self._events[event_id] = _Event(event, self._seq)
        for sink in self._sinks:
            sink.submit(copy.deepcopy(event))

    def _lookup_key(
        self,
        key: str,
        fingerprint: tuple[tuple[str, str], ...],
        endpoint: str,
        stats: _Stats,
    ) -> Reply | None:
        """Return the answer an earlier use of `key` dictates, or None to execute."""
        record = self._keys.get(key)
        if record is not None and self.clock() - record.created_at >= self.config.key_retention:
            del self._keys[key]
            record = None
        if record is None:
            return None
        if record.endpoint != endpoint:
            stats.idempotency_conflicts += 1
            return error_reply(
                400,
                "idempotency_error",
                "Keys for idempotent requests can only be used for the same endpoint they "
                f"were first used for ('{endpoint}' vs '{record.endpoint}'). Try using a key "
                f"other than '{key}' if you meant to execute a different request.",
            )
        if record.reply is None:
            stats.in_flight_rejections += 1
            busy = "Another request with this idempotency key is in progress."
            reply = error_reply(409, "invalid_request_error", busy, code="idempotency_key_in_use")
            return replace(reply, headers=(("Stripe-Should-Retry", "true"),))
        if record.fingerprint != fingerprint:
            stats.idempotency_conflicts += 1
            return error_reply(
                400,
                "idempotency_error",
                "Keys for idempotent requests can only be used with the same parameters "
                "they were first used with.",
            )
        stats.replays += 1
        reply = record.reply
        return replace(reply, headers=(*reply.headers, ("Idempotent-Replayed", "true")))

    def _begin(
        self, key: str | None, fingerprint: tuple[tuple[str, str], ...], endpoint: str
    ) -> None:
        self._in_flight += 1
        if key is not None:
            self._keys[key] = _KeyRecord(fingerprint, self.clock(), endpoint=endpoint)
        self._cond.notify_all()

    def _store(
        self,
        key: str | None,
        fingerprint: tuple[tuple[str, str], ...],
        reply: Reply,
        endpoint: str,
    ) -> None:
        if key is not None:
            record = self._keys.get(key)
            created_at = record.created_at if record is not None else self.clock()
            self._keys[key] = _KeyRecord(fingerprint, created_at, reply, endpoint)

    def _next_fault(self) -> str | None:
        if self._faults:
            return self._faults.popleft()
        rates = [(mode, getattr(self.config, f"{mode}_rate")) for mode in FAULT_MODES]
        if not any(rate for _, rate in rates):
            return None
        draw = self._rng.random()
        for mode, rate in rates:
            if draw < rate:
                return mode
            draw -= rate
        return None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _newest_first(self) -> list[_Intent]:
        return sorted(self._intents.values(), key=lambda i: (i.created_at, i.seq), reverse=True)

    def _execute(self, parsed: dict[str, Any]) -> Reply:
        """Create the intent, and charge it when `confirm` is set; return its answer."""
        now = self.clock()
        pi_id = "pi_" + secrets.token_hex(12)
        method = parsed["payment_method"]
        data = {
            "id": pi_id,
            "object": "payment_intent",
            "amount": parsed["amount"],
            "amount_capturable": 0,
            "amount_received": 0,
            "currency": parsed["currency"],
            "status": "requires_confirmation" if method else "requires_payment_method",
            "metadata": parsed["metadata"],
            "created": int(now),
            "payment_method": method,
            "livemode": False,
            "client_secret": f"{pi_id}_secret_{secrets.token_hex(12)}",
            "confirmation_method": "automatic",
            "capture_method": parsed["capture_method"],
            "last_payment_error": None,
            "latest_charge": None,
            "canceled_at": None,
            "cancellation_reason": None,
        }
        intent = _Intent(data, now, self._next_seq())
        self._intents[pi_id] = intent
        if parsed["confirm"]:
            return self._charge(intent, method)
        return Reply(200, copy.deepcopy(data))

    def _charge(self, intent: _Intent, method: str) -> Reply:
        """Charge `method` for the intent: succeeded, or declined back to requires_payment_method.

        A manual intent is authorised instead: `requires_capture`, holding its
        amount, with `payment_intent.amount_capturable_updated` as at Stripe.
        """
        data = intent.data
        decline_code = DECLINING_CARDS.get(method)
        if decline_code is not None:
            error = {
                "type": "card_error",
                "code": "card_declined",
                "decline_code": decline_code,
                "message": "Your card was declined.",
                "payment_method": {"id": method, "object": "payment_method"},
            }
            # Stripe detaches the declined method: a new attempt needs one again.
            data.update(status="requires_payment_method", payment_method=None)
            data["last_payment_error"] = error
            self._emit("payment_intent.payment_failed", data)
            return Reply(
                402, {"error": {**copy.deepcopy(error), "payment_intent": copy.deepcopy(data)}}
            )
        # Stripe makes the charge at authorisation too; it is captured later.
        intent.charge_id = "ch_" + data["id"].removeprefix("pi_")
        data.update(payment_method=method, last_payment_error=None, latest_charge=intent.charge_id)
        if data["capture_method"] == "manual":
            data.update(status="requires_capture", amount_capturable=data["amount"])
            self._emit("payment_intent.amount_capturable_updated", data)
            return Reply(200, copy.deepcopy(data))
        return self._succeed(intent, data["amount"])

    def _succeed(self, intent: _Intent, received: int) -> Reply:
        """Mark the intent's money received (a charge or a capture): `payment_intent.succeeded`."""
        intent.succeeded = (self.clock(), self._next_seq())
        intent.data.update(status="succeeded", amount_received=received, amount_capturable=0)
        self._emit("payment_intent.succeeded", intent.data)
        return Reply(200, copy.deepcopy(intent.data))

    def _execute_confirm(self, pi_id: str, parsed: dict[str, Any]) -> Reply:
        """Confirm an intent as Stripe does, or refuse for its status."""
        intent = self._intents.get(pi_id)
        if intent is None:
            return _no_such_intent(pi_id)
        data = intent.data
        status = data["status"]
        given = parsed["payment_method"]
        if status not in CONFIRMABLE:
            if given is not None:
                # Stripe first tries to attach the given method, and says so.
                message = (
                    "This PaymentIntent's payment_method could not be updated because it has a "
                    f"status of {status}. You may only update the payment_method of a "
                    "PaymentIntent with one of the following statuses: "
                    + ", ".join(CONFIRMABLE)
                    + "."
                )
            elif status == "succeeded":
                message = (
                    "You cannot confirm this PaymentIntent because it has already succeeded "
                    "after being previously confirmed."
                )
            else:
                message = (
                    f"You cannot confirm this PaymentIntent because it has a status of {status}. "
                    "Only a PaymentIntent with one of the following statuses may be confirmed: "
                    + ", ".join(CONFIRMABLE)
                    + "."
                )
            return _unexpected_state(message, data)
        method = given or data["payment_method"]
        if method is None:
            return _unexpected_state(
                "You cannot confirm this PaymentIntent because it's missing a payment method. "
                "You can either update the PaymentIntent with a payment method and then confirm "
                "it again, or confirm it again directly with a payment method.",
                data,
            )
        return self._charge(intent, method)

    def _execute_cancel(self, pi_id: str, parsed: dict[str, Any]) -> Reply:
        """Cancel an intent that has not succeeded, or refuse for its status."""
        intent = self._intents.get(pi_id)
        if intent is None:
            return _no_such_intent(pi_id)
        data = intent.data
        status = data["status"]
        if status not in CANCELABLE:
            return _unexpected_state(
                f"You cannot cancel this PaymentIntent because it has a status of {status}. "
                "Only a PaymentIntent with one of the following statuses may be canceled: "
                + ", ".join(CANCELABLE)
                + ".",
                data,
            )
        # A held authorisation is released: nothing is left to capture.
        data.update(
            status="canceled",
            amount_capturable=0,
            canceled_at=int(self.clock()),
            cancellation_reason=parsed["cancellation_reason"],
        )
        self._emit("payment_intent.canceled", data)
        return Reply(200, copy.deepcopy(data))

    def _execute_capture(self, pi_id: str, parsed: dict[str, Any]) -> Reply:
        """Capture (part of) what an intent in `requires_capture` holds, or refuse."""
        intent = self._intents.get(pi_id)
        if intent is None:
            return _no_such_intent(pi_id)
        data = intent.data
        status = data["status"]
        if status not in CAPTURABLE:
            return _unexpected_state(
                f"This PaymentIntent could not be captured because it has a status of {status}. "
                "Only a PaymentIntent with one of the following statuses may be captured: "
                + ", ".join(CAPTURABLE)
                + ".",
                data,
            )
        held = int(data["amount_capturable"])
        amount = parsed["amount_to_capture"] if parsed["amount_to_capture"] is not None else held
        if amount > held:
            return error_reply(
                400,
                "invalid_request_error",
                "The payment could not be captured because the requested capture amount is "
                "greater than the authorized amount.",
                param="amount_to_capture",
                code=CAPTURE_TOO_LARGE,
                payment_intent=copy.deepcopy(data),
            )
        data["metadata"] = _merged(data["metadata"], parsed["metadata"])
        return self._succeed(intent, amount)

    def _execute_refund(self, parsed: dict[str, Any]) -> Reply:
        """Refund (part of) an intent's charge, or refuse as Stripe does."""
        self._fail_due_refunds()
        try:
            refund = self._desk.create(
                parsed,
                now=self.clock(),
                status=self.config.refund_status,
                fail_after=self.config.refund_fail_after,
            )
        except Refusal as refusal:
            return invalid(refusal.message, param=refusal.param, code=refusal.code)
        self._wake_failer()
        return Reply(200, refund)

    # --- refunds that fail on time (refund_fail_after) ------------------------------

    def _fail_due_refunds(self) -> None:
        """Fail the refunds that are due: every read checks, so a driven clock needs no thread."""
        self._desk.fail_due(self.clock())

    def _wake_failer(self) -> None:
        """Start the failing thread when a failure is scheduled, or wake it for a new one."""
        if self._desk.next_failure() is None or self._closed:
            return
        if self._failer is None:
            self._failer = threading.Thread(
                target=self._run_failer, name="fake-provider-refund-failures", daemon=True
            )
            self._failer.start()
        self._cond.notify_all()

    def _run_failer(self) -> None:
        with self._cond:
            while not self._closed:
                self._fail_due_refunds()
                due = self._desk.next_failure()
                # Short waits: an injected clock can jump without notifying anyone.
                self._cond.wait(None if due is None else min(max(due - self.clock(), 0.0), 0.1))


def _stats_of(stats: _Stats) -> dict[str, Any]:
    return {
        "create_requests": stats.create_requests,
        "replays": stats.replays,
        "idempotency_conflicts": stats.idempotency_conflicts,
        "in_flight_rejections": stats.in_flight_rejections,
        "faults_injected": dict(stats.faults),
    }


_CHECKS = {
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
    "eq": operator.eq,
}


class _Listed(Protocol):
    data: dict[str, Any]


_Row = TypeVar("_Row", bound=_Listed)


def _created_in(data: Mapping[str, Any], created: Mapping[str, int]) -> bool:
    """Whether `data["created"]` passes every `created[...]` filter."""
    return all(_CHECKS[op](data["created"], value) for op, value in created.items())


def _page(
    rows: Sequence[_Row], limit: int, starting_after: str | None, ending_before: str | None
) -> tuple[Sequence[_Row], bool]:
    """Cut one page out of newest-first rows by cursor; return it and `has_more`.

    A cursor that exists but is filtered out of `rows` gives an empty page.
    """
    ids = [row.data["id"] for row in rows]
    if starting_after is not None:
        start = ids.index(starting_after) + 1 if starting_after in ids else len(ids)
        return rows[start : start + limit], start + limit < len(rows)
    if ending_before is not None:
        end = ids.index(ending_before) if ending_before in ids else 0
        return rows[max(0, end - limit) : end], end - limit > 0
    return rows[:limit], limit < len(rows)


def _list_reply(data: list[dict[str, Any]], has_more: bool, url: str) -> Reply:
    return Reply(200, {"object": "list", "data": data, "has_more": has_more, "url": url})


def _merged(metadata: Mapping[str, str], update: Mapping[str, str]) -> dict[str, str]:
    """Stripe's metadata update: keys are set, and a key given an empty value is removed."""
    merged = {**metadata, **update}
    return {k: v for k, v in merged.items() if v != ""}


def _no_such_intent(pi_id: str) -> Reply:
    return error_reply(
        404,
        "invalid_request_error",
        f"No such payment_intent: '{pi_id}'",
        code="resource_missing",
        param="intent",
    )


def _unexpected_state(message: str, intent: dict[str, Any]) -> Reply:
    """A 400 payment_intent_unexpected_state carrying the intent, as Stripe's does."""
    return error_reply(
        400,
        "invalid_request_error",
        message,
        code=UNEXPECTED_STATE,
        payment_intent=copy.deepcopy(intent),
    )
