"""The chaos run's provider events: signed webhooks with faults, a dropped endpoint, and the
time from the provider's success to the operation settled.

With webhooks on, the fake provider POSTs every event, signed with a secret of
the run, to a web process of its own that serves `POST /webhooks/provider`
(the same project on another port: the API server keeps serving the chaos
client's checkouts and refunds, as a deployment that routes its webhooks to a
pool of their own does). Its faults are on: duplicate deliveries, events out
of order, delayed first attempts. Once a quarter of the orders are checked
out, that web process is SIGKILLed (requests in flight included) and started
again `endpoint_down` seconds later; meanwhile the fake's deliveries fail and
are retried with back-off, and once it is back the run does what
docs/operators.md asks after an outage: `sync_provider_events`.

`latencies` measures, for every charge and refund the provider made whose
outcome its worker did not record from its own answer (the answer was
dropped, late or a 500, or the worker was killed in its call), the seconds
from the provider's success (the fake's clock, `GET /_fake/timeline`) to the
operation's settled audit row, split by cause (the answer lost at once, late,
or its worker killed: each has its own floor) and by who settled the step's
claim: a provider event, the catch-up, the reconciler, or a worker replaying
the same idempotency key.
"""

from __future__ import annotations

import math
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, TypedDict

import requests
from django.db.models import Q

from devtools.topology.stack import ROOT, Proc, Stack, free_port
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim

#: Who settled a claim, by the prefix of the actor on its `done` audit row.
#: Checked in this order: "provider-events-sync" also starts with "provider-events".
SETTLERS = (
    ("provider-events-sync:", "catch_up"),
    ("provider-events:", "provider_event"),
    ("reconciler:", "reconciler"),
)
#: The rest: a worker took the claim over (or was its owner) and asked again, same key.
WORKER_REPLAY = "worker_replay"
SETTLER_ORDER = ("provider_event", "catch_up", "reconciler", WORKER_REPLAY)
#: The report's key of the latencies, by cause, then by settler (and "all").
LATENCY_KEY = "success_to_settled_seconds"
#: Why no worker recorded the outcome from its own answer. The goal's population: the
#: answer was lost at once (the connection dropped, or a 500 after the charge).
ANSWER_LOST = "answer_lost"
#: The answer came after the client's read timeout: its owner holds the claim until then.
ANSWER_LATE = "answer_late"
#: The owner was SIGKILLed in its call: nothing settles the claim before its lease runs out.
OWNER_KILLED = "worker_killed"
CAUSES = (ANSWER_LOST, ANSWER_LATE, OWNER_KILLED)
#: How requests' read timeout shows in the owner's `uncertain` audit row.
_LATE_MARK = "ReadTimeout"

_TERMINAL = (OperationState.SUCCEEDED, OperationState.FAILED, OperationState.NEEDS_REVIEW)


@dataclass
class Webhooks:
    """The run's webhook endpoint: its own web process, a secret, the fake's faults."""

    stack: Stack
    duplicate_rate: float = 0.10
    reorder_rate: float = 0.10
    delay_rate: float = 0.05
    delay: float = 2.0
    port: int = field(default_factory=free_port)
    secret: str = field(default_factory=lambda: "whsec_chaos_" + secrets.token_hex(16))
    proc: Proc | None = None
    #: Seconds from the kill until the endpoint answered again, per outage.
    outages: list[float] = field(default_factory=list)
    catch_up: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/webhooks/provider"

    def env(self) -> dict[str, str]:
        """The app's side of the secret (every process of the run gets it)."""
        return {"PAYMENT_PROVIDER_WEBHOOK_SECRET": self.secret}

    def provider_args(self) -> list[str]:
        """The fake provider's arguments: where to send, how to sign, which faults."""
        return [
            "--webhook-url", self.url,
            "--webhook-secret", self.secret,
            "--webhook-duplicate-rate", str(self.duplicate_rate),
            "--webhook-reorder-rate", str(self.reorder_rate),
            "--webhook-delay-rate", str(self.delay_rate),
            "--webhook-delay", str(self.delay),
        ]  # fmt: skip

    def start_endpoint(self) -> None:
        """Start the web process that receives the webhooks (after the stack's env is set)."""
        self.proc = self.stack.start_api(self.port, name="webhooks")

    def drop_endpoint(
        self,
        *,
        when: Callable[[], bool],
        down: float,
        stop: threading.Event,
        say: Callable[[str], None],
    ) -> threading.Thread:
        """In a thread: once `when()` holds, SIGKILL the endpoint, `down` s later start it
        again and catch up with `sync_provider_events`."""

        def outage() -> None:
            while not when():
                if stop.wait(0.2):
                    return
            assert self.proc is not None
            self.stack.kill(self.proc)
            killed = time.monotonic()
            say(f"  webhook endpoint killed (SIGKILL); back in {down:g} s")
            stop.wait(down)
            self.start_endpoint()
            self.outages.append(round(time.monotonic() - killed, 1))
            say(f"  webhook endpoint back after {self.outages[-1]:g} s; catching up")
            self.catch_up = _sync_provider_events(self.stack)
            say(f"  catch-up: {self.catch_up}")

        thread = threading.Thread(target=outage, name="chaos-endpoint-outage", daemon=True)
        thread.start()
        return thread

    def figures(self, provider_url: str) -> dict[str, object]:
        """The fake's delivery counters and the outages, for the report."""
        try:
            stats = requests.get(f"{provider_url}/_fake/webhooks", timeout=5).json()
        except (requests.RequestException, ValueError):
            stats = {}
        return {
            "webhook_events": stats.get("events"),
            "webhook_deliveries": stats.get("delivered"),
            "webhook_failed_attempts": stats.get("failed_attempts"),
            "webhook_duplicated": stats.get("duplicated"),
            "webhook_reordered": stats.get("reordered"),
            "webhook_delayed": stats.get("delayed"),
            "webhook_gave_up": stats.get("gave_up"),
            "webhook_endpoint_outages_seconds": list(self.outages),
            "webhook_catch_up": self.catch_up,
        }


def _sync_provider_events(stack: Stack) -> str:
    """Run `manage.py sync_provider_events` with the stack's environment; return its last line."""
    done = subprocess.run(
        [sys.executable, "manage.py", "sync_provider_events", "--since", "1h"],
        cwd=ROOT,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


# --- the measurement ---------------------------------------------------------------


def percentile(values: Sequence[float], share: float) -> float | None:
    """The nearest-rank percentile of `values` (`share` in 0..1); None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p95 and max (seconds, rounded to ms) and the count."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {
        "count": len(values),
        "p50": rounded(percentile(values, 0.50)),
        "p95": rounded(percentile(values, 0.95)),
        "max": rounded(max(values) if values else None),
    }


def settler_of(actor: str) -> str:
    """Name who settled a claim from the actor of its `done` audit row."""
    for prefix, name in SETTLERS:
        if actor.startswith(prefix):
            return name
    return WORKER_REPLAY


@dataclass
class _Trail:
    """What the audit rows say about one operation's provider step."""

    step: str
    claimant: str = ""  # who claimed the step (last, before it was lost)
    lost_by: str = ""  # who first recorded it uncertain
    lost_why: str = ""
    done_from: str = ""
    done_actor: str = ""
    done_at: datetime | None = None
    settled_at: datetime | None = None  # the operation's first terminal row after that

    def add(
        self, step: str, from_state: str, to_state: str, actor: str, reason: str, at: datetime
    ) -> None:
        if step == self.step:
            if to_state == ClaimState.CLAIMED and not self.lost_by:
                self.claimant = actor  # the last one before the outcome was lost
            elif to_state == ClaimState.UNCERTAIN and not self.lost_by:
                self.lost_by, self.lost_why = actor, reason
            elif to_state == ClaimState.DONE and self.done_at is None:
                self.done_from, self.done_actor, self.done_at = from_state, actor, at
        elif not step and to_state in _TERMINAL and self.done_at and not self.settled_at:
            self.settled_at = at

    @property
    def direct(self) -> bool:
        """Recorded by the claim's owner from the provider's own answer."""
        return self.done_from == ClaimState.CLAIMED

    @property
    def cause(self) -> str:
        """OWNER_KILLED: another process took the claim over once its lease ran out; else
        its owner recorded it uncertain itself: ANSWER_LATE after its read timeout,
        ANSWER_LOST at once (the connection dropped, a 500)."""
        if self.lost_by != self.claimant:
            return OWNER_KILLED
        return ANSWER_LATE if _LATE_MARK in self.lost_why else ANSWER_LOST


def latencies(provider_url: str, operations: Q) -> dict[str, object]:
    """Time from each provider success to its operation settled, for outcomes the worker
    did not record from its own answer, by cause and settler; see the module docstring.

    `operations` selects the run's operations (checkouts and refunds). A
    success whose claim went from `claimed` straight to `done` was recorded by
    its owner from the provider's answer: not counted. The rest are split by
    cause, as each has its own floor: the answer lost at once (none: the goal's
    population), the answer late (the owner is in its call until its read
    timeout, PROVIDER_READ_TIMEOUT: 3 s here) or the owner SIGKILLed in its
    call (nothing settles a leased claim before the lease runs out:
    CLAIM_LEASE, 8 s here). Each
    sample also carries the time to the claim's own `done` row (the fact
    recorded; the operation then still runs its follow-up steps).
    """
    timeline = requests.get(f"{provider_url}/_fake/timeline", timeout=10).json()["data"]
    # A later attempt confirms the order's intent, whose metadata name the first attempt:
    # a success belongs to the operation whose done claim carries it.
    done_by = dict(
        StepClaim.objects.filter(
            state=ClaimState.DONE, provider_reference__in=[row["id"] for row in timeline]
        )
        .exclude(provider_reference="")
        .values_list("provider_reference", "operation__key")
    )
    success_at: dict[tuple[str, str], float] = {}
    for row in timeline:
        owner = done_by.get(row["id"]) or row["metadata"].get("operation_key", "")
        key = (owner, row["metadata"].get("step", ""))
        success_at[key] = min(success_at.get(key, math.inf), float(row["succeeded_at"]))
    ops = dict(Operation.objects.filter(operations).values_list("key", "pk"))
    trails = {ops[key]: _Trail(step) for key, step in success_at if key in ops}
    rows = OperationEvent.objects.filter(operation_id__in=list(trails)).order_by("created_at", "id")
    for op_id, *row in rows.values_list(
        "operation_id", "step", "from_state", "to_state", "actor", "reason", "created_at"
    ):
        trails[op_id].add(*row)
    key_of = {pk: key for key, pk in ops.items()}
    samples: list[_Sample] = []
    for op_id, trail in trails.items():
        if trail.direct or trail.done_at is None or trail.settled_at is None:
            continue
        started = success_at[(key_of[op_id], trail.step)]
        samples.append(
            {
                "operation": key_of[op_id],
                "cause": trail.cause,
                "settled_by": settler_of(trail.done_actor),
                "provider_success_at": round(started, 3),
                "claim_done_after": round(trail.done_at.timestamp() - started, 3),
                "settled_after": round(trail.settled_at.timestamp() - started, 3),
            }
        )
    samples.sort(key=lambda sample: sample["settled_after"])
    return {
        LATENCY_KEY: {cause: _by_settler(samples, cause, "settled_after") for cause in CAUSES},
        "success_to_claim_done_seconds": {
            cause: _by_settler(samples, cause, "claim_done_after") for cause in CAUSES
        },
        "successes_recorded_by_their_worker": sum(1 for t in trails.values() if t.direct),
        "successes_not_settled": sum(1 for t in trails.values() if t.settled_at is None),
        "success_to_settled_samples": samples,
    }


class _Sample(TypedDict):
    """One outcome no worker had from its own answer: when it succeeded, and how long after
    that its claim was done and its operation settled, by whom."""

    operation: str
    cause: str
    settled_by: str
    provider_success_at: float
    claim_done_after: float
    settled_after: float


def _by_settler(
    samples: list[_Sample], cause: str, field: Literal["claim_done_after", "settled_after"]
) -> dict[str, dict]:
    """The summary of `field` per settler (and for all of them) among samples of `cause`."""
    mine = [s for s in samples if s["cause"] == cause]
    return {
        **{
            name: summary([s[field] for s in mine if s["settled_by"] == name])
            for name in SETTLER_ORDER
        },
        "all": summary([s[field] for s in mine]),
    }
