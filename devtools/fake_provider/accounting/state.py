"""In-memory state of the fake accounting API: invoices, idempotency keys, faults.

No HTTP here: `devtools.fake_provider.accounting.server` serves this state. Every public
method takes the one lock, so handler threads, the control API and test assertions see one
consistent picture; the clock is injectable so that tests age keys without sleeping. The
contract is in the package docstring.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from devtools.fake_provider.state import Reply

FAULT_MODES = ("drop_after_commit", "fail_after_commit", "hold", "slow")
RATE_FIELDS = tuple(f"{mode}_rate" for mode in FAULT_MODES)
MAX_KEY_LENGTH = 255
REPLAYED_HEADER = "Idempotent-Replayed"


@dataclass
class AccountingConfig:
    """Runtime settings of the fake; every field can change over `POST /_fake/config`."""

    api_key: str | None = None  # None: any non-empty bearer key
    key_retention: float = 24 * 3600.0
    slow_delay: float = 12.0  # longer than a 10 s client read timeout
    latency: float = 0.0  # seconds every create takes before it is looked at
    seed: int | None = None
    drop_after_commit_rate: float = 0.0
    fail_after_commit_rate: float = 0.0
    hold_rate: float = 0.0
    slow_rate: float = 0.0

    def validate(self) -> None:
        for name in ("key_retention", "slow_delay", "latency"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must not be negative")
        rates = [float(getattr(self, name)) for name in RATE_FIELDS]
        if any(not 0.0 <= rate <= 1.0 for rate in rates) or sum(rates) > 1.0:
            raise ValueError("fault rates are shares between 0 and 1, adding up to at most 1")


@dataclass
class _Key:
    fingerprint: str
    created_at: float
    reply: Reply | None  # None: its first request is still being executed


def error(status: int, code: str, message: str, param: str | None = None) -> Reply:
    """An error answer of the contract."""
    body: dict[str, Any] = {"code": code, "message": message}
    if param is not None:
        body["param"] = param
    return Reply(status, {"error": body})


def _invalid(message: str, param: str) -> Reply:
    return error(400, "invalid_request", message, param)


def parse_invoice(raw: bytes) -> dict[str, Any] | Reply:
    """The create's body, checked; a 400 Reply when it is malformed."""
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        return _invalid("the body is not JSON", "body")
    if not isinstance(body, dict):
        return _invalid("the body is not a JSON object", "body")
    for name in ("external_id", "customer"):
        if not isinstance(body.get(name), str) or not body[name] or len(body[name]) > 255:
            return _invalid(f"{name} must be a non-empty string", name)
    currency = body.get("currency")
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha():
        return _invalid("currency must be a three-letter code", "currency")
    lines = body.get("lines")
    if not isinstance(lines, list) or not lines:
        return _invalid("lines must be a non-empty list", "lines")
    for n, line in enumerate(lines):
        if not (
            isinstance(line, dict)
            and isinstance(line.get("description"), str)
            and _amount(line.get("amount"))
        ):
            return _invalid("each line has a description and an integer amount", f"lines[{n}]")
    if not _amount(body.get("total")) or body["total"] != sum(li["amount"] for li in lines):
        return _invalid("total must be the sum of the lines' amounts", "total")
    return body


def _amount(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _canonical(body: dict[str, Any] | Reply) -> str:
    """The body as compared under a key: the same JSON whatever its spacing or key order."""
    if isinstance(body, Reply):
        return "<malformed>"
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


class AccountingState:
    """Invoices, keys and faults of one fake accounting API."""

    def __init__(
        self, config: AccountingConfig | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or AccountingConfig()
        self.config.validate()
        self.clock = clock
        self._cond = threading.Condition()
        self._rng = random.Random(self.config.seed)
        self._release = threading.Event()
        self.reset()

    # --- the API ------------------------------------------------------------------------

    def check_api_key(self, authorization: str | None) -> bool:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme != "Bearer" or not key:
            return False
        expected = self.config.api_key
        return expected is None or secrets.compare_digest(key.encode(), expected.encode())

    def create(self, raw: bytes, key: str | None, stopping: threading.Event) -> Reply:
        """Answer `POST /v1/invoices` (executing it at most once per key)."""
        if not key or len(key) > MAX_KEY_LENGTH or not (key.isascii() and key.isprintable()):
            return error(400, "idempotency_key_invalid", "an Idempotency-Key header is required")
        if self.config.latency:
            stopping.wait(self.config.latency)
        body = parse_invoice(raw)
        fingerprint = _canonical(body)
        with self._cond:
            self._stats["create_requests"] += 1
            earlier = self._earlier(key, fingerprint)
            if earlier is not None:
                return earlier
            if isinstance(body, Reply):
                return body  # nothing executed: nothing stored under the key
            fault = self._next_fault()
            if fault == "hold":
                self._keys[key] = _Key(fingerprint, self.clock(), None)
                self._held += 1
        if fault == "hold":
            # Executed only once released: the key is in flight until then.
            while not (self._release.is_set() or stopping.is_set()):
                self._release.wait(0.05)
            with self._cond:
                self._held -= 1
        with self._cond:
            reply = self._execute(body)
            if fault == "fail_after_commit":
                reply = error(500, "internal_error", "the invoice service failed")
            self._keys[key] = _Key(
                fingerprint,
                self._keys[key].created_at if key in self._keys else self.clock(),
                None if fault == "slow" else reply,
            )
            generation = self._generation
        if fault == "slow":
            stopping.wait(self.config.slow_delay)
            with self._cond:
                if generation == self._generation and key in self._keys:
                    self._keys[key].reply = reply
        if fault == "drop_after_commit":
            return Reply(reply.status, reply.body, reply.headers, drop=True)
        return reply

    def list_by_external_id(self, external_id: str) -> Reply:
        with self._cond:
            self._stats["list_requests"] += 1
            found = [dict(i) for i in self._invoices.values() if i["external_id"] == external_id]
        return Reply(200, {"data": found})

    def retrieve(self, invoice_id: str) -> Reply:
        with self._cond:
            invoice = self._invoices.get(invoice_id)
        if invoice is None:
            return error(404, "not_found", "no such invoice")
        return Reply(200, dict(invoice))

    # --- what tests and the control API use ---------------------------------------------

    def invoices(self, external_id: str | None = None) -> list[dict[str, Any]]:
        """Every invoice (with that external id), oldest first."""
        with self._cond:
            return [
                dict(i)
                for i in self._invoices.values()
                if external_id is None or i["external_id"] == external_id
            ]

    def enqueue_faults(self, mode: str, count: int = 1) -> int:
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r} (known: {', '.join(FAULT_MODES)})")
        with self._cond:
            self._faults.extend([mode] * max(count, 0))
            return len(self._faults)

    def release(self) -> int:
        """Let every held request go on; return how many were held."""
        with self._cond:
            held = self._held
        self._release.set()
        while True:
            with self._cond:
                if self._held == 0:
                    break
            time.sleep(0.01)
        self._release.clear()
        return held

    def configure(self, **changes: Any) -> None:
        known = {f.name for f in fields(AccountingConfig)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown config fields: {', '.join(unknown)}")
        with self._cond:
            merged = AccountingConfig(**{**asdict(self.config), **changes})
            merged.validate()
            self.config = merged
            if "seed" in changes:
                self._rng = random.Random(merged.seed)

    def reset(self) -> None:
        with self._cond:
            self._invoices: dict[str, dict[str, Any]] = {}
            self._keys: dict[str, _Key] = {}
            self._faults: deque[str] = deque()
            self._stats: Counter[str] = Counter()
            self._held = getattr(self, "_held", 0)
            self._generation = getattr(self, "_generation", 0) + 1

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                **{k: self._stats[k] for k in ("create_requests", "list_requests", "replays")},
                "invoices": len(self._invoices),
                "conflicts": self._stats["conflicts"],
                "in_flight_rejections": self._stats["in_flight_rejections"],
                "faults": {mode: self._stats[f"fault:{mode}"] for mode in FAULT_MODES},
                "held": self._held,
                "config": asdict(self.config),
            }

    # --- inside the lock -----------------------------------------------------------------

    def _earlier(self, key: str, fingerprint: str) -> Reply | None:
        """The answer an earlier use of `key` dictates, or None to execute."""
        record = self._keys.get(key)
        if record is not None and self.clock() - record.created_at >= self.config.key_retention:
            del self._keys[key]  # forgotten: the same request executes again
            record = None
        if record is None:
            return None
        if record.fingerprint != fingerprint:
            self._stats["conflicts"] += 1
            return error(
                422, "idempotency_key_reused", "this key was used with another request body"
            )
        if record.reply is None:
            self._stats["in_flight_rejections"] += 1
            return error(409, "request_in_progress", "a request with this key is in progress")
        self._stats["replays"] += 1
        stored = record.reply
        return Reply(stored.status, stored.body, (*stored.headers, (REPLAYED_HEADER, "true")))

    def _execute(self, body: dict[str, Any]) -> Reply:
        invoice = {
            "id": f"inv_{secrets.token_hex(8)}",
            "external_id": body["external_id"],
            "customer": body["customer"],
            "status": "open",
            "total": body["total"],
            "currency": body["currency"].lower(),
            "lines": [dict(line) for line in body["lines"]],
            "created": int(self.clock()),
        }
        self._invoices[invoice["id"]] = invoice
        return Reply(201, dict(invoice))

    def _next_fault(self) -> str | None:
        fault = self._faults.popleft() if self._faults else self._draw_fault()
        if fault is not None:
            self._stats[f"fault:{fault}"] += 1
        return fault

    def _draw_fault(self) -> str | None:
        draw = self._rng.random()
        for mode in FAULT_MODES:
            rate = float(getattr(self.config, f"{mode}_rate"))
            if draw < rate:
                return mode
            draw -= rate
        return None
