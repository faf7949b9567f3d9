"""Prometheus metrics of the fence, computed at scrape time so that no process must live.

RQ runs each job in a forked work horse that exits after the job, so an
in-process counter dies with it. Hence two sources, both outside the process:

- gauges are computed from the database and RQ's registries on every scrape
  (`FenceCollector`), each over rows that are not finished, through the
  partial indexes of migration 0014, never over the history: unsettled claims
  by kind, step and state, unfinished operations by kind and state, the
  oldest uncertain claim, the last fence audit, jobs by RQ status;
- true counters are kept in Redis with HINCRBY under the
  `observability:counter:` prefix of the queue's Redis: operations' state
  changes by kind and new state, counted when their transaction commits
  (finished operations, retries), provider calls by kind, step and outcome
  class, inbox duplicates skipped per consumer.

The `kind` and `step` labels are bounded: their values are the registered
handlers' kinds and step names (`registered_handlers()`); anything else (a
removed handler's leftovers, a typo) is folded into `other`.
  That Redis runs `noeviction` (checked by payments.W001); if it is flushed
  the counters restart at 0, which Prometheus' rate() treats as a reset.

The endpoint (`metrics_view`) wants `Authorization: Bearer <METRICS_TOKEN>`
or a staff session; see docs/observability.md.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any, cast

from django.conf import settings
from django.db.models import Count, Min
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

from inbox.signals import duplicate_skipped
from payments.engine.handlers import registered_handlers
from payments.engine.outcomes import Outcome
from payments.engine.queues import PROBE_TIMEOUT, redis_client
from payments.engine.signals import operation_state_changed, provider_call_finished
from payments.engine.steps import claim_system_named
from payments.engine.systems import replay_deadline
from payments.models import (
    UNFINISHED_OPERATION_STATES,
    UNSETTLED_CLAIM_STATES,
    ClaimState,
    FenceAuditRun,
    OperationState,
    StepClaim,
)
from payments.models import Operation as OperationRow

logger = logging.getLogger("payments.observability.metrics")

COUNTER_PREFIX = "observability:counter:"
PROVIDER_CALLS = "payments_provider_calls_total"
INBOX_DUPLICATES = "inbox_duplicates_skipped_total"
TRANSITIONS = "payments_operation_transitions_total"
#: The states whose entries are counted: every outcome of a run or a decision. Not
#: pending (a new operation) nor running (a lease taken): neither says how work ended.
COUNTED_STATES = (
    OperationState.RETRYING,
    OperationState.SUCCEEDED,
    OperationState.FAILED,
    OperationState.UNCERTAIN,
    OperationState.NEEDS_REVIEW,
)
#: The label value every kind, step or outcome outside the known sets is folded into.
OTHER = "other"
#: Joins the labels of one counter field in its Redis hash (`kind|step|outcome`).
FIELD_SEPARATOR = "|"

# --- bounded label sets -------------------------------------------------------------


def known_steps() -> dict[str, frozenset[str]]:
    """Return kind -> step names, from the registered handlers (the only label values)."""
    return {kind: spec.known_steps for kind, spec in registered_handlers().items()}


def external_steps() -> dict[str, frozenset[str]]:
    """Return kind -> its external steps (the ones that call the provider)."""
    return {kind: frozenset(spec.effects) for kind, spec in registered_handlers().items()}


def bounded_labels(
    kind: object, step: object, steps: dict[str, frozenset[str]] | None = None
) -> tuple[str, str]:
    """Return (kind, step) with anything no registered handler declares folded into `other`."""
    steps = known_steps() if steps is None else steps
    if kind not in steps:
        return OTHER, OTHER
    return str(kind), (str(step) if step in steps[str(kind)] else OTHER)


def _bounded_outcome(outcome: object) -> str:
    return str(outcome) if outcome in {o.value for o in Outcome} else OTHER


# --- counters kept in Redis ---------------------------------------------------------


def _counter_redis() -> Redis:
    """Return the queue Redis client that keeps the counters, with probe timeouts."""
    return redis_client(timeout=PROBE_TIMEOUT)


def increment(metric: str, label: str, amount: int = 1) -> None:
    """Add `amount` to the counter `metric{label}`; never fail the caller over a metric."""
    try:
        _counter_redis().hincrby(COUNTER_PREFIX + metric, label, amount)
    except Exception:  # a lost increment is a smaller harm than a failed step
        logger.warning("metric %s not counted: redis unavailable", metric)


def count_provider_call(outcome: str, *, kind: str = OTHER, step: str = OTHER) -> None:
    """Count one provider call by operation kind, step and outcome class (success, ...)."""
    kind, step = bounded_labels(kind, step)
    increment(PROVIDER_CALLS, FIELD_SEPARATOR.join((kind, step, _bounded_outcome(outcome))))


@receiver(provider_call_finished)
def count_provider_call_of_engine(
    sender: object, *, outcome: str, kind: str = OTHER, step: str = OTHER, **kwargs: object
) -> None:
    """Count a provider call the engine made (the engine's signal)."""
    count_provider_call(outcome, kind=kind, step=step)


@receiver(operation_state_changed)
def count_state_change(sender: object, *, kind: str, to_state: str, **kwargs: object) -> None:
    """Count one operation entering `to_state` (the engine's signal, sent on commit)."""
    if to_state in COUNTED_STATES:
        kind = kind if kind in registered_handlers() else OTHER
        increment(TRANSITIONS, FIELD_SEPARATOR.join((kind, str(to_state))))


@receiver(duplicate_skipped)
def count_inbox_duplicate(sender: object, *, consumer: str, **kwargs: object) -> None:
    """Count one redelivered message that the inbox skipped (the inbox's signal)."""
    increment(INBOX_DUPLICATES, consumer)


def _read_counters(client: Redis, metric: str) -> dict[str, float]:
    # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
    raw = cast("dict[bytes, bytes]", client.hgetall(COUNTER_PREFIX + metric))
    return {k.decode(): float(v) for k, v in raw.items()}


def _provider_calls(client: Redis) -> dict[tuple[str, str, str], float]:
    """Read the provider-call counters as (kind, step, outcome) -> count, folding the unknown.

    A field written before the counter had kind and step (just the outcome)
    counts under kind and step `other`.
    """
    steps = known_steps()
    calls: dict[tuple[str, str, str], float] = {}
    for name, count in _read_counters(client, PROVIDER_CALLS).items():
        *where, outcome = name.split(FIELD_SEPARATOR)
        kind, step = (
            bounded_labels(where[0], where[1], steps) if len(where) == 2 else (OTHER, OTHER)
        )
        labels = (kind, step, _bounded_outcome(outcome))
        calls[labels] = calls.get(labels, 0.0) + count
    return calls


def _transitions(client: Redis) -> dict[tuple[str, str], float]:
    """Read the state-change counters as (kind, state) -> count, every known pair present."""
    kinds = registered_handlers()
    counted = {(kind, str(state)): 0.0 for kind in kinds for state in COUNTED_STATES}
    for name, count in _read_counters(client, TRANSITIONS).items():
        kind, _, state = name.partition(FIELD_SEPARATOR)
        if state not in COUNTED_STATES:
            continue
        labels = (kind if kind in kinds else OTHER, state)
        counted[labels] = counted.get(labels, 0.0) + count
    return counted


# --- the collector ------------------------------------------------------------------

RQ_REGISTRIES = {
    "started": StartedJobRegistry,
    "scheduled": ScheduledJobRegistry,
    "deferred": DeferredJobRegistry,
    "failed": FailedJobRegistry,
}


class FenceCollector(Collector):
    """Compute every metric from the database and Redis when Prometheus scrapes."""

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "payments_metrics_source_up",
            "Whether a metrics source could be read during this scrape (1) or not (0).",
            labels=["source"],
        )
        try:
            families = list(self._database())
        except Exception:  # a scrape reports a broken source; it does not fail
            logger.warning("metrics: database unreadable", exc_info=True)
            families, db_up = [], 0.0
        else:
            db_up = 1.0
        yield from families
        up.add_metric(["database"], db_up)
        try:
            families = list(self._redis())
        except RedisError:
            logger.warning("metrics: redis unreadable", exc_info=True)
            families, redis_up = [], 0.0
        else:
            redis_up = 1.0
        yield from families
        up.add_metric(["redis"], redis_up)
        yield up

    def _database(self) -> Iterator[Metric]:
        steps = known_steps()
        # Unsettled claims only, through their partial index: a settled claim is history
        # (payments_provider_calls_total counts how calls ended).
        claims = GaugeMetricFamily(
            "payments_step_claims",
            "Unsettled step claims (claimed, uncertain) by operation kind, step and state.",
            labels=["kind", "step", "state"],
        )
        claim_counts: dict[tuple[str, str, str], int] = {
            (kind, step, state.value): 0
            for kind, names in steps.items()
            for step in names
            for state in UNSETTLED_CLAIM_STATES
        }
        rows = (
            StepClaim.objects.filter(state__in=UNSETTLED_CLAIM_STATES)
            .values_list("operation__kind", "step", "state")
            .annotate(n=Count("id"))
            .values_list("operation__kind", "step", "state", "n")
        )
        for kind, step, state, n in rows:
            labels = (*bounded_labels(kind, step, steps), state)
            claim_counts[labels] = claim_counts.get(labels, 0) + n
        for labels, n in sorted(claim_counts.items()):
            claims.add_metric(list(labels), n)
        yield claims

        # Unfinished operations only, through their partial index: the finished ones are
        # counted as they finish (payments_operation_transitions_total).
        operations = GaugeMetricFamily(
            "payments_operations",
            "Unfinished operations by kind and state (uncertain and needs_review want a "
            "person or the reconciler).",
            labels=["kind", "state"],
        )
        op_counts: dict[tuple[str, str], int] = {
            (kind, op_state.value): 0 for kind in steps for op_state in UNFINISHED_OPERATION_STATES
        }
        op_rows = (
            OperationRow.objects.filter(state__in=UNFINISHED_OPERATION_STATES)
            .values_list("kind", "state")
            .annotate(n=Count("id"))
            .values_list("kind", "state", "n")
        )
        for kind, op_state, n in op_rows:
            key = (kind if kind in steps else OTHER, op_state)
            op_counts[key] = op_counts.get(key, 0) + n
        for (kind, op_state), n in sorted(op_counts.items()):
            operations.add_metric([kind, op_state], n)
        yield operations

        oldest = StepClaim.objects.filter(state=ClaimState.UNCERTAIN).aggregate(
            at=Min("claimed_at")
        )["at"]
        age = (timezone.now() - oldest).total_seconds() if oldest else 0.0
        yield GaugeMetricFamily(
            "payments_oldest_uncertain_claim_age_seconds",
            "Age of the oldest uncertain claim since it was claimed; 0 when there is none.",
            value=max(age, 0.0),
        )

        yield self._replay_deadlines()

        last = FenceAuditRun.objects.order_by("-finished_at").first()
        if last is not None:
            yield GaugeMetricFamily(
                "payments_fence_audit_last_exit_code",
                "Exit code of the last fence_audit run: 0 clean, 1 findings, 2 provider unread.",
                value=last.exit_code,
            )
            yield GaugeMetricFamily(
                "payments_fence_audit_last_run_timestamp_seconds",
                "When the last fence_audit run finished (Unix time).",
                value=last.finished_at.timestamp(),
            )

    def _replay_deadlines(self) -> Metric:
        """The uncertainty clock per system: seconds until the nearest uncertain claim's key
        may be forgotten there (negative: past it; only a person settles it now)."""
        deadlines = GaugeMetricFamily(
            "payments_replay_deadline_seconds",
            "Seconds until the nearest replay deadline of an uncertain claim not held for a "
            "person, by external system (its key's first use plus the system's key retention, "
            "less a margin); negative once past. Absent: no such claim on that system.",
            labels=["system"],
        )
        # A claim held for a person (its deadline passed, a contradiction) has its person:
        # it must not hide the next claim nearing its own deadline.
        firsts = (
            StepClaim.objects.filter(state=ClaimState.UNCERTAIN)
            .exclude(look__hold__gt="")
            .values_list("system", "operation__kind", "step")
            .annotate(first=Min("claimed_at"))
            .values_list("system", "operation__kind", "step", "first")
        )
        nearest: dict[str, datetime] = {}
        for name, kind, step, first in firsts:
            system = claim_system_named(name, kind, step)
            if system is None:
                continue
            deadline = replay_deadline(system, first)
            nearest[system.name] = min(deadline, nearest.get(system.name, deadline))
        now = timezone.now()
        for name, deadline in sorted(nearest.items()):
            deadlines.add_metric([name], (deadline - now).total_seconds())
        return deadlines

    def _redis(self) -> Iterator[Metric]:
        client = _counter_redis()
        calls = CounterMetricFamily(
            "payments_provider_calls",
            "Provider calls made under a claim, by operation kind, step and outcome class.",
            labels=["kind", "step", "outcome"],
        )
        counted = {
            (kind, step, outcome.value): 0.0
            for kind, names in external_steps().items()
            for step in names
            for outcome in Outcome
        }
        for labels, count in _provider_calls(client).items():
            counted[labels] = counted.get(labels, 0.0) + count
        for labels, count in sorted(counted.items()):
            calls.add_metric(list(labels), count)
        yield calls

        transitions = CounterMetricFamily(
            "payments_operation_transitions",
            "Operations that entered a state (an outcome of a run or a decision), by kind and "
            "state, counted when the change committed.",
            labels=["kind", "state"],
        )
        changed = _transitions(client)
        for (kind, state), count in sorted(changed.items()):
            transitions.add_metric([kind, state], count)
        yield transitions
        yield CounterMetricFamily(
            "payments_operation_retries",
            "Transient failures that scheduled another attempt (entries into retrying).",
            value=sum(n for (_, state), n in changed.items() if state == OperationState.RETRYING),
        )

        duplicates = CounterMetricFamily(
            "inbox_duplicates_skipped",
            "Redelivered messages that the inbox skipped, per consumer.",
            labels=["consumer"],
        )
        for consumer, value in sorted(_read_counters(client, INBOX_DUPLICATES).items()):
            duplicates.add_metric([consumer], value)
        yield duplicates

        jobs = GaugeMetricFamily(
            "rq_jobs",
            "RQ jobs by queue and status (registries read without cleanup).",
            labels=["queue", "status"],
        )
        for name in settings.RQ_QUEUES:
            conn = redis_client(name, timeout=PROBE_TIMEOUT)
            jobs.add_metric([name, "queued"], cast(int, conn.llen(f"rq:queue:{name}")))
            for status, registry_class in RQ_REGISTRIES.items():
                # No cleanup: a scrape must not move jobs between registries.
                registry = registry_class(name, connection=conn)
                jobs.add_metric([name, status], registry.get_job_count(cleanup=False))
        yield jobs


_registry: CollectorRegistry | None = None


def registry() -> CollectorRegistry:
    """Return the registry the endpoint exposes (built once, on first use)."""
    global _registry
    if _registry is None:
        built = CollectorRegistry(auto_describe=False)  # no DB query at registration
        built.register(FenceCollector())
        _registry = built
    return _registry


# --- the endpoint ---------------------------------------------------------------------


def _authorized(request: HttpRequest) -> bool | None:
    """True: let in; False: authenticated but not allowed; None: no valid credentials."""
    token: str = getattr(settings, "METRICS_TOKEN", "") or ""
    header = request.headers.get("Authorization", "")
    if token and header[:7].lower() == "bearer ":
        return True if hmac.compare_digest(header[7:].strip(), token) else None
    user: Any = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return bool(user.is_active and user.is_staff)
    return None


@never_cache
@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Expose the metrics in Prometheus' text format to a scraper or a staff user."""
    allowed = _authorized(request)
    if allowed is None:
        response = HttpResponse("authentication required\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if not allowed:
        return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
