"""The chaos run: real processes, faults at the provider, workers killed, Redis flushed.

It proves the product's claim on every `make demo`: no double charge, no
double refund, nothing lost, whatever dies. Once orders are paid (workers are
still being killed), a share of them is refunded through the HTTP API, half
partially and half fully (some of those as two partial refunds that add up to
the charge); the provider's faults apply to refund creates as to charges. The
scenario is replayable from its seed (the provider's faults, the cards, the
refunds, which worker dies and when); process timing is not.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import requests
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Count, Q, Sum
from redis import Redis
from redis.exceptions import RedisError
from rq.worker import Worker

from devtools.chaos.adyen import CARD as ADYEN_CARD
from devtools.chaos.adyen import DECLINED as ADYEN_DECLINED
from devtools.chaos.adyen import AdyenShop
from devtools.chaos.export import Export
from devtools.chaos.incident import (
    RECOVERY_PATIENCE,
    IncidentFigures,
    ProviderIncident,
    settle_figures,
)
from devtools.chaos.reckless import RecklessOperator
from devtools.chaos.webhooks import Webhooks, latencies
from devtools.databases.scratch import claim_scratch, flush_scratch
from devtools.topology.stack import Proc, Stack, free_port
from payments.conf import payments_settings
from payments.engine.queues import payments_queue
from payments.engine.systems import DEFAULT_SYSTEM
from payments.models import ClaimState, Operation, OperationEvent, OperationState, StepClaim
from payments.observability.audit import AuditResult, audit, audit_refunds
from payments.provider.client import PaymentIntent, ProviderClient
from payments.provider.ledger import intent_entry, refund_entry
from payments.refunds.names import REFUND, REFUND_STEP
from payments.shop.models import CreditNote, Invoice, LedgerEntry, Order, OrderStatus

SETTLED = frozenset({OperationState.SUCCEEDED, OperationState.FAILED, OperationState.NEEDS_REVIEW})
#: Orders that were charged: paid, and possibly given (part of) the money back since.
CHARGED = frozenset({OrderStatus.PAID, OrderStatus.PARTIALLY_REFUNDED, OrderStatus.REFUNDED})
#: The claims judged against the provider's lists: its own (older claims name none).
PROVIDERS = Q(system__in=("", DEFAULT_SYSTEM))

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
    #: Orders paid by manual capture (authorise, then capture 50-100 % of it) instead of a
    #: checkout: the third operation under the same faults and kills.
    capture_rate: float = 0.2
    refund_rate: float = 0.3  # paid orders refunded through the API (half partially)
    kill_min: float = 0.5
    kill_max: float = 2.0
    flush: bool = True
    seed: int = 1
    timeout: float = 300.0
    worker_class: str | None = None
    #: The provider's signed events to a web process of their own (devtools.chaos.webhooks).
    webhooks: bool = True
    #: Seconds that web process is down (SIGKILLed, then started again) mid-run; 0: never.
    endpoint_down: float = 5.0
    recoveries: int = 1  # run_recovery processes (--topology ha: 3, one per host)
    checkout_interval: float = 0.0  # seconds between checkouts (spreads them over the faults)
    #: An operator who presses every desk action offered, in the worst order (devtools.chaos.reckless).
    reckless: bool = True
    #: Seconds the provider's search lags behind its writes (it must decide nothing).
    search_lag: float = 120.0
    #: RECONCILE_GRACE of the run: short, so that operations reach "needs review" in it.
    grace: int = 20
    #: Seconds of a provider incident once a third of the orders are in (every new request
    #: held in flight, `incident_drop` of the answers dropped; devtools.chaos.incident); 0: none.
    incident: float = 0.0
    incident_drop: float = 0.3
    #: Every paid order exported to a fake accounting API of the run (devtools.chaos.export),
    #: under the charges' drop, fail and slow rates and the same worker kills.
    export: bool = True
    #: The share of orders made and paid through a shop of the run's own that pays through a
    #: fake Adyen (devtools.chaos.adyen), under the same rates and kills; 0: none.
    adyen_rate: float = 0.3


@dataclass
class ChaosResult:
    config: ChaosConfig
    run_id: str
    keys: list[str] = field(default_factory=list)
    #: (order id, amount charged if paid) of every order, in the order of `keys`.
    orders: list[tuple[int, int]] = field(default_factory=list)
    #: The keys of the orders paid by manual capture (a subset of `keys`).
    capture_keys: list[str] = field(default_factory=list)
    #: The indexes (in `orders`) of the orders made and paid through the Adyen shop.
    adyen_orders: set[int] = field(default_factory=set)
    #: Idempotency keys of the refunds the API accepted.
    refund_keys: list[str] = field(default_factory=list)
    #: Refunds the API refused (409): each one is a violation, the plan never exceeds a charge.
    refunds_refused: list[str] = field(default_factory=list)
    killed: int = 0
    #: What the reckless operator pressed ("mark failed: done", ...), and the attempts it began.
    reckless_presses: dict[str, int] = field(default_factory=dict)
    attempt_keys: list[str] = field(default_factory=list)
    flushed: bool = False
    drained_seconds: float = 0.0
    settled_in_time: bool = False
    #: Not settled in time: the run's operations still pending then, by state (its workers
    #: keep working while the figures are read, so a later look may find fewer).
    pending: dict[str, int] = field(default_factory=dict)
    report: dict[str, object] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


class Topology(Protocol):
    """What a deployment past one host adds to the run (devtools/chaos/ha.py: `--topology ha`)."""

    def env(self) -> dict[str, str]:
        """Settings every process of the run gets on top of the single host's."""
        ...

    def faults(
        self, stack: Stack, result: ChaosResult, stop: threading.Event, say: Callable[[str], None]
    ) -> None:
        """Break the topology's parts while charges are in flight (run in a thread)."""
        ...


def run_chaos(
    config: ChaosConfig,
    *,
    log_dir: Path,
    say: Callable[[str], None],
    topology: Topology | None = None,
) -> ChaosResult:
    """Run the scenario end to end and return what happened (violations included).

    With a `topology`, every process gets its settings and its faults run in a
    thread of their own beside the worker kills, until every operation settled.
    """
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
        "API_RATE_PER_CLIENT": "100000/min",  # the API's throttle is not under test
        **CHAOS_TIMEOUTS,
        "RECONCILE_GRACE": str(config.grace),
        **(topology.env() if topology is not None else {}),
    }
    if config.flush:
        claim_scratch(payments_queue().connection, "the chaos run")
    fail_half = config.fail_rate / 2
    stack = Stack(env=env, log_dir=log_dir / run_id)
    webhooks = Webhooks(stack) if config.webhooks else None
    if webhooks is not None:
        env.update(webhooks.env())
    export = (
        Export(config.drop_rate, config.fail_rate / 2, config.slow_rate, seed=config.seed)
        if config.export
        else None
    )
    if export is not None:
        env.update(export.env())
    adyen = (
        AdyenShop(config.drop_rate, fail_half, config.slow_rate, seed=config.seed)
        if config.adyen_rate > 0
        else None
    )
    if adyen is not None:
        env.update(adyen.env())
    faults = [
        "--seed", str(config.seed),
        "--drop-after-accept-rate", str(config.drop_rate),
        "--slow-rate", str(config.slow_rate),
        "--slow-delay", "4",
        "--fail-before-rate", str(fail_half),
        "--fail-after-rate", str(fail_half),
        "--search-lag", str(config.search_lag),
        *(webhooks.provider_args() if webhooks is not None else ()),
    ]  # fmt: skip
    stop = threading.Event()
    try:
        stack.start_provider(provider_port, *faults)
        if export is not None:
            export.start(stack)
        if adyen is not None:
            adyen.start(stack, api_port, run_id)
        stack.start_api(api_port)
        if webhooks is not None:
            webhooks.start_endpoint()
        for _ in range(config.workers):
            stack.start_worker(config.worker_class)
        for index in range(config.recoveries):
            stack.start_recovery(interval=1, name=f"recovery-{index}" if index else "recovery")
        say(
            f"run {run_id}: provider :{provider_port}, API :{api_port}, {config.workers} workers, "
            f"{config.recoveries} recovery loop(s); logs in {stack.log_dir}"
        )
        started = time.monotonic()
        chaos = threading.Thread(
            target=_chaos_loop, args=(stack, config, chaos_rng, stop, result), daemon=True
        )
        chaos.start()
        threads = [chaos]
        if topology is not None:
            breaker = threading.Thread(
                target=topology.faults, args=(stack, result, stop, say), daemon=True
            )
            breaker.start()
            threads.append(breaker)
        outage = None
        if webhooks is not None and config.endpoint_down > 0:
            outage = webhooks.drop_endpoint(
                when=lambda: len(result.orders) >= max(1, config.orders // 4),
                down=config.endpoint_down,
                stop=stop,
                say=say,
            )
        deadline = started + config.timeout
        incident = _start_incident(config, result, provider_port, stop, say)
        reckless = _start_reckless(config, run_id, env, stop) if config.reckless else None
        api = _api_session()
        shops = Shops(api, adyen.session() if adyen is not None else None)
        result.keys = _checkout(config, rng, shops, api_port, run_id, stack, result, say)
        plan = plan_refunds(config, [amount for _, amount in result.orders])
        _refund(plan, shops, api_port, run_id, result, deadline, say)
        attempts = reckless.keys if reckless is not None else list
        result.settled_in_time = _wait_settled(
            run_id, deadline - time.monotonic(), say, attempts=attempts
        )
        if reckless is not None:  # then what its last presses started settles too
            reckless.stop.set()
            reckless.join(timeout=30)
            result.reckless_presses = dict(reckless.presses)
            result.attempt_keys = reckless.keys()
            result.settled_in_time = _wait_settled(
                run_id, deadline - time.monotonic(), say, attempts=attempts
            )
        if incident is not None:  # its end, then what it caught settled (or not) after it
            incident.ended.wait(timeout=max(1.0, deadline - time.monotonic()))
            settle_figures(incident.figures, f"chaos-{run_id}-", patience=RECOVERY_PATIENCE)
            result.report["incident"] = incident.figures
            result.settled_in_time = _wait_settled(
                run_id, deadline - time.monotonic(), say, attempts=attempts
            )
        if not result.settled_in_time:
            result.pending = read_db(lambda: pending_work(result))
        if outage is not None:  # the endpoint back and caught up before the figures
            outage.join(timeout=max(1.0, deadline - time.monotonic()))
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        result.drained_seconds = time.monotonic() - started
        provider_url = f"http://127.0.0.1:{provider_port}"
        caught = result.report.get("incident")
        adyen_refunded = read_db(adyen.refunded_by_order) if adyen is not None else {}
        result.report = _measure(result, provider_url, adyen_refunded)
        if adyen is not None:
            result.report["adyen"] = {
                "orders": len(result.adyen_orders),
                **read_db(adyen.figures),
            }
        if export is not None:
            result.report["export"] = read_db(
                lambda: export.figures([order for order, _ in result.orders], CHARGED)
            )
        if isinstance(caught, IncidentFigures):
            result.report["incident"] = caught.as_report()
        result.report["webhooks"] = webhooks is not None
        run_ops = Q(key__startswith=f"chaos-{run_id}-") | Q(key__in=result.attempt_keys)
        result.report.update(latencies(provider_url, run_ops))
        if webhooks is not None:
            result.report.update(webhooks.figures(provider_url))
    finally:
        stop.set()
        stack.stop()
    result.violations = _violations(result)
    return result


def _start_incident(
    config: ChaosConfig,
    result: ChaosResult,
    provider_port: int,
    stop: threading.Event,
    say: Callable[[str], None],
) -> ProviderIncident | None:
    """Start the provider incident's thread (it waits for a third of the orders), or None."""
    if config.incident <= 0:
        return None
    url = f"http://127.0.0.1:{provider_port}"
    incident = ProviderIncident(
        url,
        IncidentFigures(seconds=config.incident, drop_rate=config.incident_drop),
        due=lambda: len(result.orders) >= max(1, config.orders // 3),
        prefix=f"chaos-{result.run_id}-",
        stop=stop,
        say=say,
        client=ProviderClient(
            url, payments_settings().provider_api_key, connect_timeout=2, read_timeout=30
        ),
    )
    incident.start()
    return incident


def _start_reckless(
    config: ChaosConfig, run_id: str, env: dict[str, str], stop: threading.Event
) -> RecklessOperator:
    """Start the reckless operator, its desk talking to the run's provider with its timeouts."""
    settings.PAYMENTS = {  # this process is the operator's desk: the run's settings
        **settings.PAYMENTS,
        "PROVIDER_URL": env["PAYMENT_PROVIDER_URL"],
        "PROVIDER_CONNECT_TIMEOUT": float(CHAOS_TIMEOUTS["PROVIDER_CONNECT_TIMEOUT"]),
        "PROVIDER_READ_TIMEOUT": float(CHAOS_TIMEOUTS["PROVIDER_READ_TIMEOUT"]),
        "JOB_TIMEOUT": int(CHAOS_TIMEOUTS["JOB_TIMEOUT"]),
        "CLAIM_LEASE": int(CHAOS_TIMEOUTS["CLAIM_LEASE"]),
        "RECONCILE_GRACE": config.grace,
    }
    reckless = RecklessOperator(f"chaos-{run_id}-", threading.Event())

    def stop_with_the_run() -> None:
        stop.wait()
        reckless.stop.set()

    threading.Thread(target=stop_with_the_run, daemon=True).start()
    reckless.start()
    return reckless


def _chaos_loop(
    stack: Stack,
    config: ChaosConfig,
    rng: random.Random,
    stop: threading.Event,
    result: ChaosResult,
) -> None:
    """Every kill_min..kill_max seconds SIGKILL a random worker that has started working,
    and start a new one."""
    connection = payments_queue().connection
    while not stop.wait(rng.uniform(config.kill_min, config.kill_max)):
        started = started_workers(stack.workers(), connection)
        if started:
            stack.kill(rng.choice(started))
            result.killed += 1
        while len(stack.workers()) < config.workers:
            stack.start_worker(config.worker_class)


def started_workers(workers: list[Proc], connection: Redis) -> list[Proc]:
    """Return the workers the chaos may kill: those RQ holds a heartbeat of.

    A worker writes its first heartbeat when it registers, ready to take jobs (after a
    flush, its next heartbeat writes it again). One still starting (importing Django,
    connecting) holds no work: killing it tests nothing, and on a slow machine, where
    starting takes longer than the time between kills, it leaves no worker to drain.
    """
    beats = connection.pipeline(transaction=False)
    for worker in workers:
        beats.hexists(Worker.redis_worker_namespace_prefix + worker.name, "last_heartbeat")
    try:
        beating = beats.execute()
    except RedisError:  # the queue's Redis away a moment (a failover): no kill this time
        return []
    return [worker for worker, beat in zip(workers, beating, strict=True) if beat]


def _api_session() -> requests.Session:
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {settings.API_TOKEN}"
    return api


@dataclass
class Shops:
    """The API sessions the run's orders are made through: the provider's shop (API_TOKEN's
    client) and, when the run has one, the shop that pays through Adyen."""

    provider: requests.Session
    adyen: requests.Session | None

    def of(self, result: ChaosResult, index: int) -> requests.Session:
        """The session of the shop that made order `index`."""
        if index in result.adyen_orders and self.adyen is not None:
            return self.adyen
        return self.provider


def _checkout(
    config: ChaosConfig,
    rng: random.Random,
    shops: Shops,
    api_port: int,
    run_id: str,
    stack: Stack,
    result: ChaosResult,
    say: Callable[[str], None],
) -> list[str]:
    base = f"http://127.0.0.1:{api_port}/api"
    keys = []
    for i in range(config.orders):
        amount = 500 + rng.randrange(50_000)
        through_adyen = shops.adyen is not None and rng.random() < config.adyen_rate
        if through_adyen:
            result.adyen_orders.add(i)
        api = shops.of(result, i)
        order = _post(
            api,
            f"{base}/orders",
            {"amount": amount, "currency": "eur", "email": f"chaos{i}@example.com"},
        )
        key = f"chaos-{run_id}-{i}"
        declined = rng.random() < config.decline_rate
        card = "pm_card_chargeDeclined" if declined else "pm_card_visa"
        if through_adyen:
            card = ADYEN_DECLINED if declined else ADYEN_CARD
        if rng.random() < config.capture_rate:  # a hold, then a capture of part or all of it
            captured = max(1, int(amount * (0.5 + 0.5 * rng.random())))
            body = {"payment_method": card, "amount_to_capture": captured}
            _post(api, f"{base}/orders/{order['id']}/captures", body, {"Idempotency-Key": key})
            result.orders.append((int(order["id"]), captured))
            result.capture_keys.append(key)
        else:
            _post(
                api,
                f"{base}/orders/{order['id']}/checkout",
                {"payment_method": card},
                headers={"Idempotency-Key": key},
            )
            result.orders.append((int(order["id"]), amount))
        keys.append(key)
        if config.checkout_interval:
            time.sleep(config.checkout_interval)
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


class ApiRefused(RuntimeError):
    """The API answered a 4xx or 5xx."""

    def __init__(self, url: str, status: int, text: str) -> None:
        super().__init__(f"{url} answered {status}: {text[:200]}")
        self.status = status


def _post(session: requests.Session, url: str, body: dict, headers: dict | None = None) -> dict:
    """POST through the API; retry a refused connection (the API itself is not under test).

    A retry carries the same Idempotency-Key, so a request that did arrive is
    answered again (a replay), never executed twice. A 5xx is retried too: with
    `--topology ha` the API's database goes away for a moment (a PgBouncer or a
    PostgreSQL restart) and the request's transaction was rolled back.
    """
    for attempt in range(12):  # about 15 s in all
        pause = min(0.2 * (attempt + 1), 2.0)
        try:
            response = session.post(url, json=body, headers=headers, timeout=10)
        except requests.ConnectionError:
            time.sleep(pause)
            continue
        if response.status_code >= 500:
            time.sleep(pause)
            continue
        if response.status_code == 429:  # throttled: the API's limits are not under test
            time.sleep(min(float(response.headers.get("Retry-After") or 1), 5.0))
            continue
        if response.status_code >= 400:
            raise ApiRefused(url, response.status_code, response.text)
        return response.json()
    raise RuntimeError(f"{url} did not answer")


# --- refunds ------------------------------------------------------------------------


def plan_refunds(config: ChaosConfig, amounts: list[int]) -> dict[int, tuple[int, ...]]:
    """Choose, from the seed alone, which orders (by index) are refunded and by which amounts.

    A share `refund_rate` of the orders is chosen: half of them refunded
    partially (10-90 % of the charge), a quarter fully at once, a quarter
    fully as two partial refunds that add up to the charge. Three draws per
    order whatever the rate, so a seed replays the same refunds; an order is
    refunded only if it ends up paid.
    """
    rng = random.Random(f"{config.seed}:refunds")  # independent of the cards and the kills
    plan: dict[int, tuple[int, ...]] = {}
    for i, total in enumerate(amounts):
        chosen, style, share = rng.random(), rng.random(), rng.random()
        if chosen >= config.refund_rate:
            continue
        if style < 0.5:
            plan[i] = (max(1, int(total * (0.1 + 0.8 * share))),)
        elif style < 0.75:
            plan[i] = (total,)
        else:
            first = max(1, int(total * (0.2 + 0.6 * share)))
            plan[i] = (first, total - first)
    return plan


def _refund(
    plan: dict[int, tuple[int, ...]],
    shops: Shops,
    api_port: int,
    run_id: str,
    result: ChaosResult,
    deadline: float,
    say: Callable[[str], None],
) -> None:
    """Ask for the planned refunds through the API as soon as each order is paid.

    Workers are still being killed meanwhile. An order whose checkout settled
    without paying it (declined, failed, needs review) gets no refund.
    """
    base = f"http://127.0.0.1:{api_port}/api"
    waiting = dict(plan)
    not_paid = 0
    say(f"  refunds planned for {len(plan)} orders (if paid)")
    while waiting and time.monotonic() < deadline:
        # The checkouts' states first: one settled before the order was read is final.
        checkout_states = read_db(
            lambda: dict(
                Operation.objects.filter(key__in=[result.keys[i] for i in waiting]).values_list(
                    "key", "state"
                )
            )
        )
        statuses = read_db(
            lambda: dict(
                Order.objects.filter(pk__in=[result.orders[i][0] for i in waiting]).values_list(
                    "pk", "status"
                )
            )
        )
        for i in sorted(waiting):
            order_id = result.orders[i][0]
            if statuses.get(order_id) == OrderStatus.PAID:
                for n, amount in enumerate(waiting.pop(i), start=1):
                    key = f"chaos-{run_id}-refund-{i}-{n}"
                    try:
                        _post(
                            shops.of(result, i),
                            f"{base}/orders/{order_id}/refunds",
                            {"amount": amount},
                            headers={"Idempotency-Key": key},
                        )
                    except ApiRefused as exc:
                        if exc.status != 409:
                            raise
                        result.refunds_refused.append(key)
                    else:
                        result.refund_keys.append(key)
            elif checkout_states.get(result.keys[i]) in SETTLED:
                del waiting[i]
                not_paid += 1
        if waiting:
            time.sleep(0.5)
    say(
        f"  asked for {len(result.refund_keys)} refunds of "
        f"{len(plan) - not_paid - len(waiting)} paid orders ({not_paid} planned orders not "
        f"paid); workers killed so far: {result.killed}"
    )
    if waiting:
        say(f"  {len(waiting)} planned orders not settled in time: not refunded")


T = TypeVar("T")


def read_db(query: Callable[[], T], *, patience: float = 60.0) -> T:
    """Run a read of the run's own progress on a fresh connection; retry while the database
    is away (`--topology ha` restarts it under the run), up to `patience` seconds."""
    deadline = time.monotonic() + patience
    while True:
        close_old_connections()
        try:
            return query()
        except DatabaseError:
            connection.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _states_of_run(prefix: str, attempt_keys: list[str]) -> dict[str, int]:
    """Operations of the run by state: its checkouts, their follow-ups, refunds, new attempts."""
    mine = (
        Q(key__startswith=prefix)
        | Q(parent__key__startswith=prefix)
        | Q(key__in=attempt_keys)
        | Q(parent__key__in=attempt_keys)
    )
    return dict(
        Operation.objects.filter(mine)
        .values_list("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )


def _wait_settled(
    run_id: str,
    timeout: float,
    say: Callable[[str], None],
    *,
    attempts: Callable[[], list[str]] = list,
) -> bool:
    """Wait until every operation of the run (checkouts, their follow-ups, refunds, and the
    new attempts an operator started) is settled."""
    deadline = time.monotonic() + timeout
    prefix = f"chaos-{run_id}-"
    last = ""
    next_line = 0.0
    while True:
        counts = read_db(lambda: _states_of_run(prefix, attempts()))
        line = ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
        settled = sum(counts.get(s, 0) for s in SETTLED) == sum(counts.values())
        if line != last and (settled or time.monotonic() >= next_line):
            say(f"  operations (checkouts, follow-ups, refunds): {line}")
            last, next_line = line, time.monotonic() + 2
        if settled:
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    say(f"  not settled in time: {last}")
    return False


def _measure(
    result: ChaosResult, provider_url: str, adyen_refunded: dict[int, int]
) -> dict[str, object]:
    """The run's figures at the provider (its lists) and in the database; the Adyen shop's
    orders are judged against Adyen's own record (devtools.chaos.adyen), their refunds
    given back counted per order here too (`adyen_refunded`)."""
    keys = [*result.keys, *result.attempt_keys]
    ops = Operation.objects.filter(key__in=result.keys)
    order_ids = [int(i) for i in ops.values_list("entity_id", flat=True)]
    client = ProviderClient(
        provider_url, payments_settings().provider_api_key, connect_timeout=2, read_timeout=30
    )
    wanted = set(keys)
    intents = [
        pi for pi in client.list_payment_intents() if pi.metadata.get("operation_key") in wanted
    ]
    charged_orders = {int(pi.metadata["order_id"]) for pi in intents if pi.status == "succeeded"}
    found = audit([intent_entry(pi) for pi in intents], Q(operation__key__in=keys) & PROVIDERS)
    # Paid, whether refunded since or not: a refund does not undo the charge's invoice.
    paid = Order.objects.filter(pk__in=order_ids, status__in=CHARGED)
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
    operated = set(
        OperationEvent.objects.filter(
            operation__key__in=keys, actor__startswith="operator:"
        ).values_list("operation_id", flat=True)
    )
    # Over every attempt of the run (an operator's new attempts too), as `went_uncertain` is.
    attempts = Operation.objects.filter(key__in=keys, pk__in=went_uncertain)
    settled = set(
        attempts.exclude(claims__step="charge", claims__state=ClaimState.UNCERTAIN).values_list(
            "pk", flat=True
        )
    )
    left = attempts.exclude(pk__in=settled)
    return {
        "orders": len(order_ids),
        "operations_by_state": dict(
            ops.values_list("state").annotate(n=Count("id")).values_list("state", "n")
        ),
        "orders_paid": len(paid_ids),
        "orders_declined_or_failed": Order.objects.filter(
            pk__in=order_ids, status=OrderStatus.PAYMENT_FAILED
        ).count(),
        # shown "payment failed" while the provider holds the order's money
        "charged_but_failed_orders": Order.objects.filter(
            pk__in=charged_orders, status=OrderStatus.PAYMENT_FAILED
        ).count(),
        "reckless_presses": result.reckless_presses,
        "new_attempts_started": len(result.attempt_keys),
        # an order's intents not cancelled: one, whatever the attempts (cancelled ones
        # can never be charged, and an attempt after one creates the next)
        "live_payment_intents_per_order_max": max(
            Counter(
                pi.metadata.get("order_id") for pi in intents if pi.status != "canceled"
            ).values(),
            default=0,
        ),
        "provider_successes": found.provider_successes,
        "charge_claims_done": found.done_claims,
        # per order (a step charged twice is an order charged twice too)
        "double_charges": max(len(found.double_charges), len(found.double_charged_entities)),
        "provider_successes_without_claim": len(found.unfenced),
        "provider_successes_never_claimed": never_claimed(
            found.unfenced, {pi.id: pi.metadata for pi in intents}
        ),
        "paid_orders_with_one_invoice": sum(1 for o in paid_ids if invoices.get(o) == 1),
        "paid_orders_with_one_ledger_line": sum(1 for o in paid_ids if ledger.get(o) == 1),
        "orders_with_more_than_one_invoice": sum(1 for n in invoices.values() if n > 1),
        "uncertain_outcomes": len(set(went_uncertain)),
        "uncertain_settled_automatically": len(settled - operated),
        "uncertain_settled_by_an_operator": len(settled & operated),
        # still unknown, parked for a person (needs review) when the run ended
        "uncertain_left_for_review": left.filter(state=OperationState.NEEDS_REVIEW).count(),
        **_measure_refunds(result, order_ids, intents, client, adyen_refunded),
        "workers_killed": result.killed,
        "redis_flushed": result.flushed,
        "drain_seconds": round(result.drained_seconds, 1),
        "settled_in_time": result.settled_in_time,
        **_measure_captures(result, intents, found),
        "audit": found.as_dict(),
    }


def _measure_captures(
    result: ChaosResult, intents: list[PaymentIntent], found: AuditResult
) -> dict[str, object]:
    """The captures' own figures: captured once each, and no hold left after a give-up."""
    captures = Operation.objects.filter(key__in=result.capture_keys)
    orders = {str(i) for i in captures.values_list("entity_id", flat=True)}
    failed = set(captures.filter(state=OperationState.FAILED).values_list("key", flat=True))
    return {
        "captures": len(result.capture_keys),
        "captures_succeeded": captures.filter(state=OperationState.SUCCEEDED).count(),
        "double_captures": sum(
            1
            for (kind, ident) in found.double_charged_entities
            if kind == "order" and ident in orders
        ),
        # a capture that gave up (or was marked failed) whose hold the provider still keeps
        "holds_left_after_failure": sum(
            1
            for pi in intents
            if pi.status == "requires_capture" and pi.metadata.get("operation_key") in failed
        ),
    }


def _measure_refunds(
    result: ChaosResult,
    order_ids: list[int],
    intents: list[PaymentIntent],
    client: ProviderClient,
    adyen_refunded: dict[int, int],
) -> dict[str, object]:
    """The refund figures, against the provider's own list of refunds of the run's charges
    (and Adyen's refunds per order, for the orders' own figures)."""
    amount_of = dict(result.orders)
    # What each charge took: a capture may take part of what it held.
    charged = {pi.id: pi.amount_received or pi.amount for pi in intents if pi.status == "succeeded"}
    # Every refund of every charge of the run, whoever made it.
    refunds_by_intent = {
        pi: [refund_entry(r) for r in client.list_refunds(payment_intent=pi)] for pi in charged
    }
    refund_claims = (
        Q(operation__kind=REFUND, operation__entity_id__in=[str(i) for i in order_ids]) & PROVIDERS
    )
    # The fence_audit's own judgement: double refunds per step, refunds without a claim.
    found = audit_refunds(refunds_by_intent, charged, refund_claims)
    # Over-refunds per order, across all its charges.
    order_of_intent = {pi.id: int(pi.metadata["order_id"]) for pi in intents}
    refunded_at_provider: dict[int, int] = dict(adyen_refunded)
    for intent, refunds in refunds_by_intent.items():
        order_id = order_of_intent[intent]
        for refund in refunds:
            if refund.succeeded:
                refunded_at_provider[order_id] = (
                    refunded_at_provider.get(order_id, 0) + refund.amount
                )

    refund_ops = Operation.objects.filter(
        kind=REFUND, entity_type="order", entity_id__in=[str(i) for i in order_ids]
    )
    by_state = dict(
        refund_ops.values_list("state").annotate(n=Count("id")).values_list("state", "n")
    )
    credit_notes = dict(
        CreditNote.objects.filter(order_id__in=order_ids)
        .values_list("order_id")
        .annotate(total=Sum("amount"))
        .values_list("order_id", "total")
    )
    orders = Order.objects.filter(pk__in=order_ids).values_list(
        "pk", "amount", "status", "refunded_amount"
    )
    touched = matching = 0
    for order_id, amount, status, refunded in orders:
        given_back = (
            refunded,
            credit_notes.get(order_id, 0),
            refunded_at_provider.get(order_id, 0),
        )
        if status not in (OrderStatus.REFUNDED, OrderStatus.PARTIALLY_REFUNDED) and not any(
            given_back
        ):
            continue
        touched += 1
        taken = amount_of.get(order_id, amount)  # a partial capture took less than the order
        expected = OrderStatus.REFUNDED if refunded >= taken else OrderStatus.PARTIALLY_REFUNDED
        matching += int(status == expected and len(set(given_back)) == 1 and 0 < refunded <= taken)

    went_uncertain = set(
        OperationEvent.objects.filter(
            operation__in=refund_ops, step=REFUND_STEP, to_state=ClaimState.UNCERTAIN
        ).values_list("operation_id", flat=True)
    )
    operated = set(
        OperationEvent.objects.filter(
            operation__in=refund_ops, actor__startswith="operator:"
        ).values_list("operation_id", flat=True)
    )
    settled_auto = (
        StepClaim.objects.filter(
            operation_id__in=went_uncertain - operated, step=REFUND_STEP, state=ClaimState.DONE
        )
        .values("operation_id")
        .distinct()
        .count()
    )
    return {
        "refund_operations_by_state": by_state,
        "refunds_asked": len(result.refund_keys),
        "refunds_refused_by_api": len(result.refunds_refused),
        "refunds_succeeded": by_state.get(OperationState.SUCCEEDED, 0),
        "provider_refunds": found.provider_refunds,
        "refund_claims_done": StepClaim.objects.filter(
            operation__in=refund_ops, step=REFUND_STEP, state=ClaimState.DONE
        ).count(),
        # per refund operation (its refund step): more than one refund at the provider
        "double_refunds": len(found.double_refunds),
        # per order: the provider gave back more than was charged
        "over_refunds": sum(
            1 for order_id, total in refunded_at_provider.items() if total > amount_of[order_id]
        ),
        "refunds_without_claim": len(found.unfenced),
        "refunds_never_claimed": never_claimed(
            found.unfenced,
            {
                refund.id: refund.metadata
                for refunds in refunds_by_intent.values()
                for refund in refunds
            },
        ),
        "credit_notes": CreditNote.objects.filter(order_id__in=order_ids).count(),
        "orders_refunded": sum(1 for o in orders if o[2] == OrderStatus.REFUNDED),
        "orders_partially_refunded": sum(
            1 for o in orders if o[2] == OrderStatus.PARTIALLY_REFUNDED
        ),
        "orders_with_refunds": touched,
        "orders_with_refunds_matching": matching,
        "refund_uncertain_outcomes": len(went_uncertain),
        "refunds_settled_automatically": settled_auto,
        "refund_audit": found.as_dict(),
    }


def pending_work(result: ChaosResult) -> dict[str, int]:
    """The run's operations not settled yet, by state (empty once it drained)."""
    counts = _states_of_run(f"chaos-{result.run_id}-", result.attempt_keys)
    return {state: n for state, n in counts.items() if state not in SETTLED}


def never_claimed(references: list[str], metadata_of: dict[str, Mapping[str, str]]) -> int:
    """Count the provider objects in `references` whose operation key and step (their
    metadata) have no claim at all: made outside the fence. One with a claim not done yet
    is work in flight (its worker killed between the provider's answer and the record)."""
    count = 0
    for reference in references:
        metadata = metadata_of.get(reference, {})
        key, step = metadata.get("operation_key"), metadata.get("step")
        claims = StepClaim.objects.filter(operation__key=key, step=step)
        count += int(not key or not step or not claims.exists())
    return count


def _violations(result: ChaosResult) -> list[str]:
    """What the run's figures break. Not drained in time, only what no pending work can
    explain is judged (money taken or given twice, or outside the fence); the figures that
    need the work done are judged once it drained."""
    r = result.report
    if not r:
        return ["the run did not finish"]
    if not r["settled_in_time"]:
        return _money_violations(r)
    return _money_violations(r) + _settled_violations(r)


def _money_violations(r: dict[str, object]) -> list[str]:
    """Money taken or given back twice, or outside the fence: wrong whenever it is seen."""
    problems = []
    if r["double_charges"]:
        problems.append(f"{r['double_charges']} double charges")
    if r["provider_successes_never_claimed"]:
        problems.append(f"{r['provider_successes_never_claimed']} provider successes never claimed")
    if r["double_refunds"]:
        problems.append(f"{r['double_refunds']} double refunds")
    if r["over_refunds"]:
        problems.append(f"{r['over_refunds']} orders refunded more than their charge")
    if r["refunds_never_claimed"]:
        problems.append(f"{r['refunds_never_claimed']} provider refunds never claimed")
    if r["orders_with_more_than_one_invoice"]:
        problems.append("an order with more than one invoice")
    if r["double_captures"]:
        problems.append(f"{r['double_captures']} orders captured twice")
    adyen = r.get("adyen")
    if isinstance(adyen, dict):
        for figure, words in (
            ("adyen_double_charges", "orders charged twice at Adyen"),
            ("adyen_double_refunds", "refund steps refunded twice at Adyen"),
            ("adyen_over_refunds", "Adyen payments refunded more than charged"),
            ("adyen_double_captures", "Adyen payments captured twice"),
            ("adyen_payments_outside_the_fence", "Adyen payments outside the fence"),
        ):
            if adyen[figure]:
                problems.append(f"{adyen[figure]} {words}")
    export = r.get("export")
    if isinstance(export, dict) and export["double_invoices_any_operation"]:
        problems.append(f"{export['double_invoices_any_operation']} invoices exported twice")
    if isinstance(export, dict) and export["invoices_outside_the_fence"]:
        problems.append(f"{export['invoices_outside_the_fence']} invoices outside the fence")
    return problems


def _settled_violations(r: dict[str, object]) -> list[str]:
    """Once every operation settled: each success and refund fenced by a done claim, no order
    shown failed while charged, one invoice, ledger line and credit note each. Before then,
    each of these can be work in flight: a claim not recorded yet, an order's new attempt
    charged but not marked paid, a follow-up not run."""
    problems = []
    if r["provider_successes_without_claim"]:
        problems.append(
            f"{r['provider_successes_without_claim']} provider successes without a claim"
        )
    if r["refunds_without_claim"]:
        problems.append(f"{r['refunds_without_claim']} provider refunds without a claim")
    if r["charged_but_failed_orders"]:
        problems.append(f"{r['charged_but_failed_orders']} orders shown failed but charged")
    if r["holds_left_after_failure"]:  # before then, the reconciler may still release them
        problems.append(f"{r['holds_left_after_failure']} holds left on failed captures")
    if r["paid_orders_with_one_invoice"] != r["orders_paid"]:
        problems.append("a paid order without exactly one invoice")
    export = r.get("export")
    if isinstance(export, dict) and export["paid_orders_exported_once"] != r["orders_paid"]:
        problems.append("a paid order not exported exactly once to the accounting system")
    if r["paid_orders_with_one_ledger_line"] != r["orders_paid"]:
        problems.append("a paid order without exactly one ledger line")
    if r["refunds_refused_by_api"]:
        problems.append(f"{r['refunds_refused_by_api']} refunds within the charge refused")
    if r["credit_notes"] != r["refunds_succeeded"]:
        problems.append("credit notes and succeeded refunds differ")
    if r["orders_with_refunds_matching"] != r["orders_with_refunds"]:
        problems.append(
            "a refunded order whose status, refunded amount, credit notes and the provider's "
            "refunds disagree"
        )
    return problems
