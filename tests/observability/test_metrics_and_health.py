"""The Prometheus endpoint (auth, names, values after a run) and /healthz."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import transaction
from django.db.models import Count
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from inbox.handlers import inbox_guard
from payments.engine import fence
from payments.engine.handlers import registered_handlers
from payments.engine.signals import provider_call_finished
from payments.engine.writes import fence_writes
from payments.models import (
    UNFINISHED_OPERATION_STATES,
    UNSETTLED_CLAIM_STATES,
    Operation,
    OperationState,
    StepClaim,
)
from payments.observability.metrics import COUNTER_PREFIX
from payments.refunds.handler import request_refund
from payments.shop.models import OrderStatus
from tests.support import builders
from tests.support.flows import order_and_checkout
from tests.support.workers import run_worker

TOKEN = "metrics-token-for-tests-0123456789"

pytestmark = pytest.mark.django_db(transaction=True)  # workers commit before provider calls


def scrape(client, token: str = TOKEN) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def total(samples, name: str, **labels: str) -> float:
    """Sum the samples of `name` whose labels include `labels` (any other label summed over)."""
    return sum(
        v for (n, have), v in samples.items() if n == name and set(labels.items()) <= set(have)
    )


def label_values(samples, name: str, label: str) -> set[str]:
    return {dict(have)[label] for (n, have) in samples if n == name}


@pytest.fixture
def metrics_token(settings) -> str:
    settings.METRICS_TOKEN = TOKEN
    return TOKEN


# --- protection ---------------------------------------------------------------------


def test_metrics__refuses_without_credentials_or_with_a_wrong_token(client, metrics_token):
    anonymous = client.get("/metrics")
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-token")
    assert (anonymous.status_code, wrong.status_code) == (401, 401)
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert b"payments_" not in anonymous.content + wrong.content


def test_metrics__no_token_configured_means_no_bearer_access(client, settings, redis_conn):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401


def test_metrics__staff_session_may_read_other_users_may_not(client, settings, redis_conn):
    settings.METRICS_TOKEN = ""
    users = get_user_model().objects
    client.force_login(users.create_user("clerk", is_staff=False))
    assert client.get("/metrics").status_code == 403
    client.force_login(users.create_user("ops", is_staff=True))
    assert client.get("/metrics").status_code == 200


# --- values -------------------------------------------------------------------------


def test_metrics__names_and_values_after_a_run(client, metrics_token, provider, queue):
    provider.state.enqueue_faults("fail_before", 1)  # the first charge is refused once
    order_and_checkout()
    order_and_checkout(pm="pm_card_chargeDeclined")
    order_and_checkout()
    run_worker(queue)
    with inbox_guard("emails", "message-1") as first:
        assert first
    with inbox_guard("emails", "message-1") as again:  # a redelivery: skipped and counted
        assert not again

    samples = scrape(client)

    # Gauges mirror the unfinished rows, per kind and step (follow-ups have their own kinds);
    # the finished ones are counted as they finish.
    claims = (
        StepClaim.objects.filter(state__in=UNSETTLED_CLAIM_STATES)
        .values_list("operation__kind", "step", "state")
        .annotate(n=Count("id"))
    )
    for kind, step, state, n in claims:
        assert value(samples, "payments_step_claims", kind=kind, step=step, state=state) == n
    for state in UNSETTLED_CLAIM_STATES:
        count = StepClaim.objects.filter(state=state).count()
        assert total(samples, "payments_step_claims", state=state) == count, state
    assert label_values(samples, "payments_step_claims", "state") == {"claimed", "uncertain"}
    for state in UNFINISHED_OPERATION_STATES:
        count = Operation.objects.filter(state=state).count()
        assert total(samples, "payments_operations", state=state) == count, state
        for kind in registered_handlers():
            count = Operation.objects.filter(kind=kind, state=state).count()
            assert value(samples, "payments_operations", kind=kind, state=state) == count
    assert {"succeeded", "failed"}.isdisjoint(label_values(samples, "payments_operations", "state"))
    changes = "payments_operation_transitions_total"
    for state in (OperationState.SUCCEEDED, OperationState.FAILED):
        for kind in registered_handlers():
            count = Operation.objects.filter(kind=kind, state=state).count()
            assert value(samples, changes, kind=kind, state=state) == count, (kind, state)
    assert value(samples, changes, kind="checkout", state="failed") == 1
    assert value(samples, changes, kind="checkout", state="succeeded") == 2
    assert value(samples, changes, kind="checkout", state="retrying") == 1
    assert value(samples, changes, kind="refund", state="succeeded") == 0
    assert value(samples, "payments_oldest_uncertain_claim_age_seconds") == 0
    charge = {"kind": "checkout", "step": "charge"}
    assert value(samples, "payments_provider_calls_total", **charge, outcome="success") == 2
    assert value(samples, "payments_provider_calls_total", **charge, outcome="permanent") == 1
    assert value(samples, "payments_provider_calls_total", **charge, outcome="transient") == 1
    assert value(samples, "payments_provider_calls_total", **charge, outcome="uncertain") == 0
    assert total(samples, "payments_provider_calls_total", kind="refund") == 0
    assert value(samples, "payments_operation_retries_total") == 1
    assert value(samples, "inbox_duplicates_skipped_total", consumer="emails") == 1
    assert value(samples, "rq_jobs", queue="payments", status="failed") == 0
    assert value(samples, "rq_jobs", queue="payments", status="queued") == 0
    assert value(samples, "payments_metrics_source_up", source="database") == 1
    assert value(samples, "payments_metrics_source_up", source="redis") == 1
    assert ("payments_fence_audit_last_exit_code", ()) not in samples  # no audit yet
    assert not [name for name, _ in samples if name == "payments_replay_deadline_seconds"]


def test_metrics__refunds_are_labelled_with_their_kind_and_steps(
    client, metrics_token, provider, queue
):
    order, _ = order_and_checkout()
    run_worker(queue)
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    provider.state.enqueue_faults("fail_before", 1)  # the refund is refused once, then made
    request_refund(order_id=order.pk, key="refund-1", amount=500, actor="test")
    run_worker(queue)

    samples = scrape(client)

    refund = {"kind": "refund", "step": "refund"}
    assert value(samples, "payments_provider_calls_total", **refund, outcome="success") == 1
    assert value(samples, "payments_provider_calls_total", **refund, outcome="transient") == 1
    assert value(samples, "payments_provider_calls_total", **refund, outcome="uncertain") == 0
    charge = {"kind": "checkout", "step": "charge"}
    assert value(samples, "payments_provider_calls_total", **charge, outcome="success") == 1
    assert value(samples, "payments_provider_calls_total", **charge, outcome="transient") == 0
    changes = "payments_operation_transitions_total"
    assert value(samples, changes, kind="refund", state="succeeded") == 1
    assert value(samples, changes, kind="refund", state="retrying") == 1
    assert value(samples, "payments_operations", kind="refund", state="retrying") == 0
    # Only external steps call the provider: no series for a local step.
    assert "credit_note" not in label_values(samples, "payments_provider_calls_total", "step")


def test_metrics__kind_and_step_labels_are_bounded_by_the_registered_handlers(
    client, metrics_token, queue
):
    """Whatever is recorded, label values are registered kinds and steps, or `other`."""
    now = timezone.now()
    with fence_writes():  # rows a removed handler left behind
        gone = Operation.objects.create(
            key="legacy-1", kind="gift_card", entity_type="order", entity_id="1",
            params={}, fingerprint="x",
        )  # fmt: skip
        StepClaim.objects.create(operation=gone, step="redeem", claimed_by="t", claimed_at=now)
        renamed = Operation.objects.create(
            key="legacy-2", kind="checkout", entity_type="order", entity_id="2",
            params={}, fingerprint="y",
        )  # fmt: skip
        StepClaim.objects.create(
            operation=renamed, step="charge_v0", claimed_by="t", claimed_at=now
        )
    counters = COUNTER_PREFIX + "payments_provider_calls_total"
    queue.connection.hincrby(counters, "gift_card|redeem|success", 2)
    queue.connection.hincrby(counters, "checkout|charge|teleported", 1)
    provider_call_finished.send(sender=None, outcome="success", kind="checkout", step="nope")
    provider_call_finished.send(sender=None, outcome="uncertain", kind="gift_card", step="x")

    samples = scrape(client)

    assert value(samples, "payments_operations", kind="other", state="pending") == 1
    assert value(samples, "payments_operations", kind="checkout", state="pending") == 1
    assert value(samples, "payments_step_claims", kind="other", step="other", state="claimed") == 1
    assert (
        value(samples, "payments_step_claims", kind="checkout", step="other", state="claimed") == 1
    )
    calls = "payments_provider_calls_total"
    assert value(samples, calls, kind="other", step="other", outcome="success") == 2
    assert value(samples, calls, kind="other", step="other", outcome="uncertain") == 1
    assert value(samples, calls, kind="checkout", step="other", outcome="success") == 1
    assert value(samples, calls, kind="checkout", step="charge", outcome="other") == 1
    kinds = set(registered_handlers()) | {"other"}
    steps = {s for spec in registered_handlers().values() for s in spec.known_steps} | {"other"}
    for name in ("payments_operations", "payments_step_claims", calls):
        assert label_values(samples, name, "kind") <= kinds, name
    for name in ("payments_step_claims", calls):
        assert label_values(samples, name, "step") <= steps, name
    assert label_values(samples, calls, "outcome") <= {
        "success", "permanent", "transient", "uncertain", "conflict", "other"
    }  # fmt: skip


def test_metrics__a_state_change_counts_when_it_commits_never_when_rolled_back(
    client, metrics_token, queue
):
    op = builders.new_checkout("counted")
    changes = "payments_operation_transitions_total"
    fence.acquire_lease(op.pk, owner="worker-test", seconds=30)

    with pytest.raises(RuntimeError), transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        fence.release_in_tx(locked, OperationState.NEEDS_REVIEW, actor="worker-test")
        raise RuntimeError("the run's transaction rolls back")
    rolled_back = value(scrape(client), changes, kind="checkout", state="needs_review")
    builders.move(op, OperationState.NEEDS_REVIEW, reason="a person decides")

    samples = scrape(client)
    assert rolled_back == 0
    assert value(samples, changes, kind="checkout", state="needs_review") == 1
    assert value(samples, "payments_operations", kind="checkout", state="needs_review") == 1


def test_metrics__counters_live_in_redis_and_survive_the_process(client, metrics_token, queue):
    # What a work horse that has since exited left behind, and a counter from before
    # the kind and step labels (its calls count under `other`).
    counters = COUNTER_PREFIX + "payments_provider_calls_total"
    queue.connection.hincrby(counters, "checkout|charge|uncertain", 3)
    queue.connection.hincrby(counters, "uncertain", 2)

    samples = scrape(client)

    calls = "payments_provider_calls_total"
    assert value(samples, calls, kind="checkout", step="charge", outcome="uncertain") == 3
    assert value(samples, calls, kind="other", step="other", outcome="uncertain") == 2


def test_metrics__an_uncertain_claim_shows_its_age(client, metrics_token, provider, queue):
    provider.state.configure(slow_delay=1.5)  # longer than the 1 s read timeout
    provider.state.enqueue_faults("slow", 1)
    _, op = order_and_checkout()
    run_worker(queue)
    with fence_writes():  # hand-made state, as the test says
        op.claims.filter(step="charge").update(claimed_at=op.created_at.replace(year=2000))

    samples = scrape(client)

    assert value(samples, "payments_operations", kind="checkout", state="uncertain") == 1
    assert total(samples, "payments_operations", state="uncertain") == 1
    assert (
        value(samples, "payments_step_claims", kind="checkout", step="charge", state="uncertain")
        == 1
    )
    assert value(samples, "payments_oldest_uncertain_claim_age_seconds") > 365 * 86400
    # The uncertainty clock: its key is long forgotten at the provider (24 h): past it.
    assert value(samples, "payments_replay_deadline_seconds", system="provider") < -365 * 86400
    assert value(samples, "payments_step_claims", kind="checkout", step="charge", state="uncertain")
    assert (
        value(
            samples,
            "payments_provider_calls_total",
            kind="checkout",
            step="charge",
            outcome="uncertain",
        )
        == 1
    )
    assert provider.state.wait_idle(timeout=5)


def test_metrics__the_last_fence_audit_is_exposed(client, metrics_token, provider, redis_conn):
    call_command("fence_audit", "--since", "1h", stdout=io.StringIO())

    samples = scrape(client)

    assert value(samples, "payments_fence_audit_last_exit_code") == 0
    assert value(samples, "payments_fence_audit_last_run_timestamp_seconds") > 0


def test_metrics__an_unreachable_redis_is_reported_not_fatal(
    client, metrics_token, settings, closed_port
):
    settings.RQ_QUEUES = {"payments": {"URL": f"redis://127.0.0.1:{closed_port}/15"}}

    samples = scrape(client)

    assert value(samples, "payments_metrics_source_up", source="redis") == 0
    assert value(samples, "payments_metrics_source_up", source="database") == 1
    labels = (("kind", "checkout"), ("state", "uncertain"), ("step", "charge"))
    assert ("payments_step_claims", labels) in samples


# --- /healthz -----------------------------------------------------------------------


def test_healthz__ok_when_database_and_redis_answer(client, redis_conn):
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok", "redis": "ok"}
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]


def test_healthz__503_naming_redis_when_it_is_unreachable(client, settings, closed_port):
    settings.RQ_QUEUES = {
        "payments": {"URL": f"redis://:pw-{closed_port}@127.0.0.1:{closed_port}/15"}
    }

    response = client.get("/healthz")

    assert response.status_code == 503
    assert response.json() == {"status": "error", "database": "ok", "redis": "unreachable"}
    assert str(closed_port) not in response.content.decode()  # no URL, no password


def test_healthz__needs_no_authentication_and_answers_only_get(client, redis_conn):
    assert client.post("/healthz").status_code == 405
    assert client.head("/healthz").status_code == 200


def test_metrics__a_claim_held_for_a_person__does_not_hide_the_next_deadline(
    client, metrics_token, provider
):
    """Past its deadline a claim is held for a person; the gauge tells of the next one."""
    _, held, _ = builders.uncertain(key="held", charged=False, age=timedelta(hours=30))
    fence.hold_looks(held, "its replay window ended: a person decides")
    _, waiting, _ = builders.uncertain(key="waiting", charged=False, age=timedelta(hours=2))

    seconds = value(scrape(client), "payments_replay_deadline_seconds", system="provider")

    assert 20 * 3600 < seconds < 21 * 3600  # 24 h less the hour's margin, 2 h gone
