"""In-memory state of the fake payment provider: intents, refunds, idempotency keys, faults.

No HTTP here and no database: `devtools.fake_provider.server` serves this state over
a real socket. Every public method takes the one lock, so handler threads,
the control API and test assertions see a consistent picture. The clock is
injectable so tests can age keys and intents without sleeping.
"""

from __future__ import annotations

import copy
import operator
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

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
REFUND_REASONS = ("duplicate", "fraudulent", "requested_by_customer")
# Stripe's error codes for refusing a refund (https://docs.stripe.com/error-codes):
# more than is left on the charge, nothing left at all, no successful charge.
REFUND_TOO_LARGE = "amount_too_large"
ALREADY_REFUNDED = "charge_already_refunded"
NOT_REFUNDABLE = "payment_intent_unexpected_state"
EVENTS_ENDPOINT = "/v1/events"
#: The API version the fake's events claim (Stripe stamps every event with one).
EVENT_API_VERSION = "2024-06-20"
_ZERO_DECIMAL = frozenset({"bif", "clp", "djf", "gnf", "jpy", "kmf", "krw", "mga", "pyg", "rwf"})
_ZERO_DECIMAL |= {"ugx", "vnd", "vuv", "xaf", "xof", "xpf"}
_SYMBOLS = {"usd": "$", "eur": "€", "gbp": "£", "jpy": "¥"}


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

    def validate(self) -> None:
        """Raise ValueError for rates outside 0..1, a rate sum above 1 or negative times."""
        for name in RATE_FIELDS:
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if sum(float(getattr(self, name)) for name in RATE_FIELDS) > 1.0:
            raise ValueError("fault rates must add up to at most 1")
        for name in ("slow_delay", "latency", "search_lag", "key_retention"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must not be negative")


def error_reply(status: int, error_type: str, message: str, **extra: Any) -> Reply:
    """Build a Stripe-shaped error answer."""
    return Reply(status, {"error": {"type": error_type, "message": message, **extra}})


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> Reply:
    """Build a 400 invalid_request_error."""
    extra = {k: v for k, v in {"param": param, "code": code}.items() if v is not None}
    return error_reply(400, "invalid_request_error", message, **extra)


def _money(amount: int, currency: str) -> str:
    """Format minor units the way Stripe's refund messages do: `$1.00`, `€15.00`, `¥500`."""
    if currency in _ZERO_DECIMAL:
        number = f"{amount}"
    else:
        number = f"{amount // 100}.{amount % 100:02d}"
    symbol = _SYMBOLS.get(currency)
    return f"{symbol}{number}" if symbol else f"{number} {currency.upper()}"


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
    charge_id: str | None = None  # the successful charge, when the intent succeeded
    refunded: int = 0  # sum of its succeeded refunds (Stripe keeps it on the charge)


@dataclass
class _Refund:
    data: dict[str, Any]
    created_at: float
    seq: int


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

    def __init__(self, config: FakeConfig | None = None, *, clock: Callable[[], float] = time.time):
        self.config = config or FakeConfig()
        self.config.validate()
        self.clock = clock
        self._cond = threading.Condition()
        self._generation = 0
        self._sinks: list[EventSink] = []
        self._clear()

    def _clear(self) -> None:
        self._intents: dict[str, _Intent] = {}
        self._refunds: dict[str, _Refund] = {}
        self._events: dict[str, _Event] = {}
        self._keys: dict[str, _KeyRecord] = {}
        self._faults: deque[str] = deque()
        self._stats = _Stats()  # payment intent creates (the charges)
        self._refund_stats = _Stats()
        self._seq = 0
        self._in_flight = 0
        self._rng = random.Random(self.config.seed)

    # --- control -------------------------------------------------------------

    def reset(self) -> None:
        """Forget intents, refunds, keys, queued faults and counters; keep the config."""
        with self._cond:
            self._generation += 1
            self._clear()
            for sink in self._sinks:
                sink.clear()
            self._cond.notify_all()

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

    def enqueue_faults(self, mode: str, count: int = 1) -> int:
        """Queue `count` faults for the next creates (intents or refunds); return the queue length."""
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
            rows = sorted(self._refunds.values(), key=lambda r: r.seq)
            return [copy.deepcopy(r.data) for r in rows if _matches(r.data, clauses)]

    def events(self, *, type: str | None = None) -> list[dict[str, Any]]:  # noqa: A002
        """Return copies of all events, oldest first, optionally of one type."""
        with self._cond:
            rows = sorted(self._events.values(), key=lambda e: e.seq)
            return [copy.deepcopy(e.data) for e in rows if type in (None, e.data["type"])]

    def timeline(self) -> list[dict[str, Any]]:
        """Return when each charge and refund succeeded, to the microsecond, oldest first.

        An object's `created` is whole seconds, as at Stripe; this is the fake's
        own clock at the moment it executed the charge or the refund (before any
        fault delayed or dropped its answer), for the chaos run's latencies.
        """
        with self._cond:
            rows = [
                ("payment_intent", i.seq, i.created_at, i.data)
                for i in self._intents.values()
                if i.data["status"] == "succeeded"
            ] + [("refund", r.seq, r.created_at, r.data) for r in self._refunds.values()]
            rows.sort(key=lambda row: row[1])
            return [
                {
                    "object": kind,
                    "id": data["id"],
                    "metadata": dict(data["metadata"]),
                    "succeeded_at": at,
                }
                for kind, _, at, data in rows
            ]

    def succeeded_count(self, *, metadata: Mapping[str, str] | None = None) -> int:
        """Count succeeded intents (the number of real charges)."""
        return sum(1 for i in self.intents(metadata=metadata) if i["status"] == "succeeded")

    def stats(self) -> dict[str, Any]:
        """Return counters as plain JSON-able data.

        The top-level request counters are about payment intent creates (the
        charges); refund creates have their own under `refunds`. The fault
        queue, `in_flight` and `idempotency_keys` are shared by both.
        """
        with self._cond:
            by_status = Counter(i.data["status"] for i in self._intents.values())
            refund_stats = self._refund_stats
            return {
                "create_requests": self._stats.create_requests,
                "intents": len(self._intents),
                "intents_by_status": dict(by_status),
                "replays": self._stats.replays,
                "idempotency_conflicts": self._stats.idempotency_conflicts,
                "in_flight_rejections": self._stats.in_flight_rejections,
                "faults_injected": dict(self._stats.faults),
                "faults_queued": list(self._faults),
                "in_flight": self._in_flight,
                "idempotency_keys": len(self._keys),
                "events": len(self._events),
                "refunds": {
                    "create_requests": refund_stats.create_requests,
                    "count": len(self._refunds),
                    "amount": sum(r.data["amount"] for r in self._refunds.values()),
                    "replays": refund_stats.replays,
                    "idempotency_conflicts": refund_stats.idempotency_conflicts,
                    "in_flight_rejections": refund_stats.in_flight_rejections,
                    "faults_injected": dict(refund_stats.faults),
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

    def _create(
        self,
        endpoint: str,
        stats: _Stats,
        execute: Callable[[dict[str, Any]], Reply],
        params: list[tuple[str, str]],
        parsed: dict[str, Any] | Reply,
        idempotency_key: str | None,
        sleep: Callable[[float], object],
    ) -> Reply:
        fingerprint = tuple(sorted(params))
        if self.config.latency:
            sleep(self.config.latency)  # outside the lock: concurrent requests overlap
        with self._cond:
            stats.create_requests += 1
            if idempotency_key is not None:
                earlier = self._lookup_key(idempotency_key, fingerprint, endpoint, stats)
                if earlier is not None:
                    return earlier
            if isinstance(parsed, Reply):
                return parsed
            fault = self._next_fault()
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
                sleep(self.config.slow_delay)
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
        """Handle the list endpoint: newest first, cursor pagination, created filters."""
        checks = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}
        checks["eq"] = operator.eq
        with self._cond:
            rows = [
                i
                for i in self._newest_first()
                if all(checks[op](i.data["created"], v) for op, v in created.items())
            ]
            ids = [i.data["id"] for i in rows]
            cursor = starting_after or ending_before
            if cursor is not None and cursor not in self._intents:
                param = "starting_after" if starting_after else "ending_before"
                return invalid("No such payment_intent.", param=param, code="resource_missing")
            if starting_after is not None:
                start = ids.index(starting_after) + 1 if starting_after in ids else len(ids)
                page, has_more = rows[start : start + limit], start + limit < len(rows)
            elif ending_before is not None:
                end = ids.index(ending_before) if ending_before in ids else 0
                page, has_more = rows[max(0, end - limit) : end], end - limit > 0
            else:
                page, has_more = rows[:limit], limit < len(rows)
            data = [copy.deepcopy(i.data) for i in page]
        return Reply(
            200,
            {"object": "list", "data": data, "has_more": has_more, "url": "/v1/payment_intents"},
        )

    def retrieve_refund(self, refund_id: str) -> Reply:
        """Handle `GET /v1/refunds/{id}`."""
        with self._cond:
            refund = self._refunds.get(refund_id)
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
        payment_intent: str | None = None,
        starting_after: str | None = None,
        ending_before: str | None = None,
    ) -> Reply:
        """Handle `GET /v1/refunds`: newest first, cursor pagination, by intent."""
        with self._cond:
            rows = sorted(self._refunds.values(), key=lambda r: (r.created_at, r.seq), reverse=True)
            if payment_intent is not None:
                rows = [r for r in rows if r.data["payment_intent"] == payment_intent]
            cursor = starting_after or ending_before
            if cursor is not None and cursor not in self._refunds:
                param = "starting_after" if starting_after else "ending_before"
                return invalid(f"No such refund: '{cursor}'", param=param, code="resource_missing")
            ids = [r.data["id"] for r in rows]
            if starting_after is not None:
                start = ids.index(starting_after) + 1 if starting_after in ids else len(ids)
                page, has_more = rows[start : start + limit], start + limit < len(rows)
            elif ending_before is not None:
                end = ids.index(ending_before) if ending_before in ids else 0
                page, has_more = rows[max(0, end - limit) : end], end - limit > 0
            else:
                page, has_more = rows[:limit], limit < len(rows)
            data = [copy.deepcopy(r.data) for r in page]
        return Reply(
            200, {"object": "list", "data": data, "has_more": has_more, "url": REFUNDS_ENDPOINT}
        )

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
        checks = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}
        checks["eq"] = operator.eq
        wanted = set(types)
        with self._cond:
            newest_first = sorted(self._events.values(), key=lambda e: e.seq, reverse=True)
            rows = [
                e
                for e in newest_first
                if all(checks[op](e.data["created"], v) for op, v in created.items())
                and (not wanted or e.data["type"] in wanted)
            ]
            cursor = starting_after or ending_before
            if cursor is not None and cursor not in self._events:
                param = "starting_after" if starting_after else "ending_before"
                return invalid(f"No such event: '{cursor}'", param=param, code="resource_missing")
            ids = [e.data["id"] for e in rows]
            if starting_after is not None:
                start = ids.index(starting_after) + 1 if starting_after in ids else len(ids)
                page, has_more = rows[start : start + limit], start + limit < len(rows)
            elif ending_before is not None:
                end = ids.index(ending_before) if ending_before in ids else 0
                page, has_more = rows[max(0, end - limit) : end], end - limit > 0
            else:
                page, has_more = rows[:limit], limit < len(rows)
            data = [copy.deepcopy(e.data) for e in page]
        return Reply(
            200, {"object": "list", "data": data, "has_more": has_more, "url": EVENTS_ENDPOINT}
        )

    # --- internals (call with the lock held) -----------------------------------

    def _emit(self, event_type: str, obj: dict[str, Any]) -> None:
        """Record a Stripe-shaped event about `obj` and hand it to the sinks (lock held)."""
        event = {
            "id": "evt_" + secrets.token_hex(12),
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
        self._events[event["id"]] = _Event(event, self._seq)
        for sink in self._sinks:
            sink.submit(copy.deepcopy(event))

    def _charge_of(self, intent: _Intent) -> dict[str, Any]:
        """The charge object of a succeeded intent, with its refunds (for `charge.refunded`)."""
        data = intent.data
        refunds = [
            copy.deepcopy(r.data)
            for r in sorted(self._refunds.values(), key=lambda r: r.seq, reverse=True)
            if r.data["payment_intent"] == data["id"]
        ]
        return {
            "id": intent.charge_id,
            "object": "charge",
            "amount": data["amount"],
            "amount_captured": data["amount"],
            "amount_refunded": intent.refunded,
            "currency": data["currency"],
            "created": data["created"],
            "metadata": copy.deepcopy(data["metadata"]),
            "paid": True,
            "payment_intent": data["id"],
            "refunded": intent.refunded >= data["amount"],
            "status": "succeeded",
            "refunds": {
                "object": "list",
                "data": refunds,
                "has_more": False,
                "url": f"/v1/charges/{intent.charge_id}/refunds",
            },
        }

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

    def _newest_first(self) -> list[_Intent]:
        return sorted(self._intents.values(), key=lambda i: (i.created_at, i.seq), reverse=True)

    def _execute(self, parsed: dict[str, Any]) -> Reply:
        """Create the intent (the charge, when confirmed) and return its answer."""
        now = self.clock()
        pi_id = "pi_" + secrets.token_hex(12)
        method = parsed["payment_method"]
        decline_code = DECLINING_CARDS.get(method) if parsed["confirm"] else None
        if not parsed["confirm"]:
            status = "requires_confirmation" if method else "requires_payment_method"
        else:
            status = "requires_payment_method" if decline_code else "succeeded"
        last_error = None
        if decline_code:
            last_error = {
                "type": "card_error",
                "code": "card_declined",
                "decline_code": decline_code,
                "message": "Your card was declined.",
            }
        data = {
            "id": pi_id,
            "object": "payment_intent",
            "amount": parsed["amount"],
            "amount_received": parsed["amount"] if status == "succeeded" else 0,
            "currency": parsed["currency"],
            "status": status,
            "metadata": parsed["metadata"],
            "created": int(now),
            "payment_method": method,
            "livemode": False,
            "client_secret": f"{pi_id}_secret_{secrets.token_hex(12)}",
            "confirmation_method": "automatic",
            "capture_method": "automatic",
            "last_payment_error": last_error,
        }
        self._seq += 1
        charge_id = "ch_" + pi_id.removeprefix("pi_") if status == "succeeded" else None
        self._intents[pi_id] = _Intent(data, now, self._seq, charge_id)
        if status == "succeeded":
            self._emit("payment_intent.succeeded", data)
        elif decline_code:
            self._emit("payment_intent.payment_failed", data)
        if last_error is None:
            return Reply(200, copy.deepcopy(data))
        return Reply(402, {"error": {**last_error, "payment_intent": copy.deepcopy(data)}})

    def _execute_refund(self, parsed: dict[str, Any]) -> Reply:
        """Refund (part of) an intent's charge, or refuse as Stripe does."""
        pi_id = parsed["payment_intent"]
        intent = self._intents.get(pi_id)
        if intent is None:
            return invalid(
                f"No such payment_intent: '{pi_id}'",
                param="payment_intent",
                code="resource_missing",
            )
        if intent.charge_id is None:
            return invalid(
                f"This PaymentIntent ({pi_id}) does not have a successful charge to refund.",
                param="payment_intent",
                code=NOT_REFUNDABLE,
            )
        currency = intent.data["currency"]
        charged = int(intent.data["amount"])
        left = charged - intent.refunded
        if left <= 0:
            return invalid(
                f"Charge {intent.charge_id} has already been refunded.", code=ALREADY_REFUNDED
            )
        amount = parsed["amount"] if parsed["amount"] is not None else left
        if amount > left:
            # Stripe names the charge amount until a first refund, then what is left.
            limit = (
                f"charge amount ({_money(charged, currency)})"
                if intent.refunded == 0
                else f"unrefunded amount on charge ({_money(left, currency)})"
            )
            return invalid(
                f"Refund amount ({_money(amount, currency)}) is greater than {limit}",
                param="amount",
                code=REFUND_TOO_LARGE,
            )
        now = self.clock()
        re_id = "re_" + secrets.token_hex(12)
        data = {
            "id": re_id,
            "object": "refund",
            "amount": amount,
            "charge": intent.charge_id,
            "created": int(now),
            "currency": currency,
            "metadata": parsed["metadata"],
            "payment_intent": pi_id,
            "reason": parsed["reason"],
            "status": "succeeded",
        }
        intent.refunded += amount
        self._seq += 1
        self._refunds[re_id] = _Refund(data, now, self._seq)
        self._emit("refund.created", data)
        self._emit("charge.refunded", self._charge_of(intent))
        return Reply(200, copy.deepcopy(data))
