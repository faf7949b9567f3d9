"""The chaos run: real processes, faults at the provider, workers killed, Redis flushed.

It proves the product's claim on every `make demo`: no double charge, nothing
lost, whatever dies. The scenario is replayable from its seed (the provider's
faults, the cards, which worker dies and when); process timing is not.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests
from django.conf import settings
from django.db import close_old_connections
from django.db.models import Count, Q

from devtools.scratch import claim_scratch, flush_scratch
from devtools.stack import Stack, free_port
from payments.conf import payments_settings
from payments.engine.queues import payments_queue
from payments.models import (
    ClaimState,
    Invoice,
    LedgerEntry,
    Operation,
    OperationEvent,
    OperationState,
    Order,
    OrderStatus,
)
from payments.observability.audit import audit
from payments.provider.client import ProviderClient

SETTLED = frozenset({OperationState.SUCCEEDED, OperationState.FAILED, OperationState.NEEDS_REVIEW})

#: The demo's timeout chain: 1 + 3 < 6 <= 8 (a killed worker's work is picked up in 8 s).
CHAOS_TIMEOUTS = {
    "PROVIDER_CONNECT_TIMEOUT": "1",
    "PROVIDER_READ_TIMEOUT": "3",
    "JOB_TIMEOUT": "6",
    "CLAIM_LEASE": "8",
    "RETRY_BACKOFF": "1,2",
}


@dataclass(frozen=True)
class ChaosConfig:
    orders: int = 200
    workers: int = 4
    drop_rate: float = 0.10  # accepted, then the connection drops
    slow_rate: float = 0.05  # accepted, answered after the client's timeout
    fail_rate: float = 0.05  # 500s: half before executing (retryable), half after
    decline_rate: float = 0.05  # cards that are declined
    kill_min: float = 0.5
    kill_max: float = 2.0
    flush: bool = True
    seed: int = 1
    timeout: float = 300.0
    worker_class: str | None = None


@dataclass
class ChaosResult:
    config: ChaosConfig
    run_id: str
    keys: list[str] = field(default_factory=list)
    killed: int = 0
    flushed: bool = False
    drained_seconds: float = 0.0
    settled_in_time: bool = False
    report: dict[str, object] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


def run_chaos(config: ChaosConfig, *, log_dir: Path, say: Callable[[str], None]) -> ChaosResult:
    """Run the scenario end to end and return what happened (violations included)."""
    # Two generators: the orders' cards and amounts must not depend on how
    # many kills the chaos thread has drawn by then.
    rng = random.Random(config.seed)
    chaos_rng = random.Random(config.seed + 1)
    run_id = uuid.uuid4().hex[:8]
    result = ChaosResult(config=config, run_id=run_id)
    provider_port, api_port = free_port(), free_port()
    env = {
        **os.environ,
        "DEBUG": "1",
        "PAYMENT_PROVIDER_URL": f"http://127.0.0.1:{provider_port}",
        "API_TOKEN": settings.API_TOKEN,
        "SECRET_KEY": settings.SECRET_KEY,
        "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
        "LOG_LEVEL": "WARNING",
        **CHAOS_TIMEOUTS,
    }
    if config.flush:
        claim_scratch(payments_queue().connection, "the chaos run")
    stack = Stack(env=env, log_dir=log_dir / run_id)
    fail_half = config.fail_rate / 2
    faults = [
        "--seed", str(config.seed),
        "--drop-after-accept-rate", str(config.drop_rate),
        "--slow-rate", str(config.slow_rate),
        "--slow-delay", "4",
        "--fail-before-rate", str(fail_half),
        "--fail-after-rate", str(fail_half),
        "--search-lag", "1",
    ]  # fmt: skip
    stop = threading.Event()
    try:
        stack.start_provider(provider_port, *faults)
        stack.start_api(api_port)
        for _ in range(config.workers):
            stack.start_worker(config.worker_class)
        stack.start_recovery(interval=1)
        say(
            f"run {run_id}: provider :{provider_port}, API :{api_port}, {config.workers} workers, "
            f"recovery loop; logs in {stack.log_dir}"
        )
        started = time.monotonic()
        chaos = threading.Thread(
            target=_chaos_loop, args=(stack, config, chaos_rng, stop, result), daemon=True
        )
        chaos.start()
        result.keys = _checkout(config, rng, api_port, run_id, stack, result, say)
        result.settled_in_time = _wait_settled(run_id, config.timeout, say)
        stop.set()
        chaos.join(timeout=10)
        result.drained_seconds = time.monotonic() - started
        provider_url = f"http://127.0.0.1:{provider_port}"
        result.report = _measure(result, provider_url)
    finally:
        stop.set()
        stack.stop()
    result.violations = _violations(result)
    return result


def _chaos_loop(
    stack: Stack,
    config: ChaosConfig,
    rng: random.Random,
    stop: threading.Event,
    result: ChaosResult,
) -> None:
    """Every kill_min..kill_max seconds SIGKILL a random worker and start a new one."""
    while not stop.wait(rng.uniform(config.kill_min, config.kill_max)):
        workers = stack.workers()
        if workers:
            stack.kill(rng.choice(workers))
            result.killed += 1
        while len(stack.workers()) < config.workers:
            stack.start_worker(config.worker_class)


def _checkout(
    config: ChaosConfig,
    rng: random.Random,
    api_port: int,
    run_id: str,
    stack: Stack,
    result: ChaosResult,
    say: Callable[[str], None],
) -> list[str]:
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {settings.API_TOKEN}"
    base = f"http://127.0.0.1:{api_port}/api"
    keys = []
    for i in range(config.orders):
        order = _post(
            api,
            f"{base}/orders",
            {
                "amount": 500 + rng.randrange(50_000),
                "currency": "eur",
                "email": f"chaos{i}@example.com",
            },
        )
        key = f"chaos-{run_id}-{i}"
        card = "pm_card_chargeDeclined" if rng.random() < config.decline_rate else "pm_card_visa"
        _post(
            api,
            f"{base}/orders/{order['id']}/checkout",
            {"payment_method": card},
            headers={"Idempotency-Key": key},
        )
        keys.append(key)
        if config.flush and i == config.orders // 2:
            # Redis loses everything: queued jobs, scheduled retries, registries.
            flush_scratch(payments_queue().connection, "the chaos run")
            result.flushed = True
            say(f"  flushed the queue's Redis database after {i + 1} checkouts")
        if (i + 1) % 50 == 0:
            say(
                f"  checked out {i + 1}/{config.orders} orders; workers killed so far: "
                f"{result.killed}"
            )
    return keys


def _post(session: requests.Session, url: str, body: dict, headers: dict | None = None) -> dict:
    """POST through the API; retry a refused connection (the API itself is not under test)."""
    for attempt in range(5):
        try:
            response = session.post(url, json=body, headers=headers, timeout=10)
        except requests.ConnectionError:
            time.sleep(0.2 * (attempt + 1))
            continue
        if response.status_code >= 400:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:200]}")
        return response.json()
    raise RuntimeError(f"{url} did not answer")


def _wait_settled(run_id: str, timeout: float, say: Callable[[str], None]) -> bool:
    """Wait until every operation of the run (checkouts and their follow-ups) is settled."""
    deadline = time.monotonic() + timeout
    last = ""
    next_line = 0.0
    while time.monotonic() < deadline:
        close_old_connections()
        counts = dict(
            Operation.objects.filter(key__startswith=f"chaos-{run_id}-")
            .values_list("state")
            .annotate(n=Count("id"))
            .values_list("state", "n")
        )
        line = ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
        if line != last and time.monotonic() >= next_line:
            say(f"  operations (checkouts and follow-ups): {line}")
            last, next_line = line, time.monotonic() + 2
        if sum(counts.get(s, 0) for s in SETTLED) == sum(counts.values()):
            say(f"  operations (checkouts and follow-ups): {line}")
            return True
        time.sleep(0.5)
    say(f"  not settled within {timeout:.0f}s: {last}")
    return False


def _measure(result: ChaosResult, provider_url: str) -> dict[str, object]:
    keys = result.keys
    ops = Operation.objects.filter(key__in=keys)
    order_ids = [int(i) for i in ops.values_list("entity_id", flat=True)]
    client = ProviderClient(
        provider_url, payments_settings().provider_api_key, connect_timeout=2, read_timeout=30
    )
    wanted = set(keys)
    intents = [
        pi for pi in client.list_payment_intents() if pi.metadata.get("operation_key") in wanted
    ]
    found = audit(intents, Q(operation__key__in=keys))
    paid = Order.objects.filter(pk__in=order_ids, status=OrderStatus.PAID)
    invoices = dict(
        Invoice.objects.filter(order_id__in=order_ids)
        .values_list("order_id")
        .annotate(n=Count("id"))
        .values_list("order_id", "n")
    )
    ledger = dict(
        LedgerEntry.objects.filter(order_id__in=order_ids)
        .values_list("order_id")
        .annotate(n=Count("id"))
        .values_list("order_id", "n")
    )
    paid_ids = list(paid.values_list("pk", flat=True))
    went_uncertain = (
        OperationEvent.objects.filter(
            operation__key__in=keys, step="charge", to_state=ClaimState.UNCERTAIN
        )
        .values_list("operation_id", flat=True)
        .distinct()
    )
    settled_auto = (
        ops.filter(pk__in=went_uncertain)
        .exclude(claims__step="charge", claims__state=ClaimState.UNCERTAIN)
        .count()
    )
    return {
        "orders": len(order_ids),
        "operations_by_state": dict(
            ops.values_list("state").annotate(n=Count("id")).values_list("state", "n")
        ),
        "orders_paid": len(paid_ids),
        "orders_declined_or_failed": Order.objects.filter(
            pk__in=order_ids, status=OrderStatus.PAYMENT_FAILED
        ).count(),
        "provider_successes": found.provider_successes,
        "charge_claims_done": found.done_claims,
        # per order (a step charged twice is an order charged twice too)
        "double_charges": max(len(found.double_charges), len(found.double_charged_entities)),
        "provider_successes_without_claim": len(found.unfenced),
        "paid_orders_with_one_invoice": sum(1 for o in paid_ids if invoices.get(o) == 1),
        "paid_orders_with_one_ledger_line": sum(1 for o in paid_ids if ledger.get(o) == 1),
        "orders_with_more_than_one_invoice": sum(1 for n in invoices.values() if n > 1),
        "uncertain_outcomes": len(set(went_uncertain)),
        "uncertain_settled_automatically": settled_auto,
        "workers_killed": result.killed,
        "redis_flushed": result.flushed,
        "drain_seconds": round(result.drained_seconds, 1),
        "settled_in_time": result.settled_in_time,
        "audit": found.as_dict(),
    }


def _violations(result: ChaosResult) -> list[str]:
    r = result.report
    if not r:
        return ["the run did not finish"]
    problems = []
    if r["double_charges"]:
        problems.append(f"{r['double_charges']} double charges")
    if r["provider_successes_without_claim"]:
        problems.append(
            f"{r['provider_successes_without_claim']} provider successes without a claim"
        )
    if r["paid_orders_with_one_invoice"] != r["orders_paid"]:
        problems.append("a paid order without exactly one invoice")
    if r["paid_orders_with_one_ledger_line"] != r["orders_paid"]:
        problems.append("a paid order without exactly one ledger line")
    if r["orders_with_more_than_one_invoice"]:
        problems.append("an order with more than one invoice")
    if not r["settled_in_time"]:
        problems.append("operations not settled within the time limit")
    return problems
