"""One JSON record at the start and one at the end of every step attempt.

Transactional: the fence commits each claim before the provider call, and the
worker runs in this process on this connection.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

import pytest

from payments.engine import fence
from payments.engine.handlers import get_handler
from payments.engine.runtime import Run
from payments.engine.steps import run_external_step
from payments.engine.telemetry import OUTCOMES
from payments.exceptions import StepBusy
from payments.models import OperationState
from tests.support.flows import order_and_checkout
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

CHECKOUT_STEPS = {"charge", "invoice", "confirmation_email", "mark_paid"}
COMMON_FIELDS = {
    "time",
    "level",
    "logger",
    "message",
    "event",
    "message_type",
    "operation_key",
    "step",
    "step_kind",
    "entity_type",
    "entity_id",
    "attempt",
    "worker_id",
    "started_at",
}
END_FIELDS = COMMON_FIELDS | {
    "ended_at",
    "duration_ms",
    "transaction",
    "outcome",
    "provider_reference",
    "error",
}


def by_step(records: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        grouped[record["step"]].append(record)
    return grouped


def test_step_records__one_start_and_one_end_per_step_with_every_field(provider, queue, json_log):
    order, op = order_and_checkout()

    run_worker(queue)

    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
    grouped = by_step(json_log.steps())
    assert set(grouped) == CHECKOUT_STEPS
    for step, records in grouped.items():
        assert [r["event"] for r in records] == ["step.start", "step.end"], step
        start, end = records
        assert COMMON_FIELDS <= set(start), step
        assert END_FIELDS <= set(end), step
        for record in records:
            assert record["message_type"] == "checkout"
            assert record["operation_key"] == op.key
            assert record["entity_type"] == "order"
            assert record["entity_id"] == str(order.pk)
            assert record["attempt"] == 1
            assert record["worker_id"]
        assert end["outcome"] == "success"
        assert end["transaction"] == "commit"
        assert end["error"] is None
        started = datetime.fromisoformat(end["started_at"])
        assert started == datetime.fromisoformat(start["started_at"])
        assert datetime.fromisoformat(end["ended_at"]) >= started
        assert end["duration_ms"] >= 0
    kinds = {step: records[0]["step_kind"] for step, records in grouped.items()}
    assert kinds == {
        "charge": "external",
        "invoice": "local",
        "confirmation_email": "side_effect",
        "mark_paid": "local",
    }
    charge_end = grouped["charge"][1]
    claim = op.claims.get(step="charge")
    assert charge_end["provider_reference"] == claim.provider_reference
    assert charge_end["provider_reference"].startswith("pi_")


def test_step_records__a_decline_ends_permanent_with_its_reference(provider, queue, json_log):
    _, op = order_and_checkout(pm="pm_card_chargeDeclined")

    run_worker(queue)

    records = by_step(json_log.steps())
    assert set(records) == {"charge"}  # nothing after a refused charge
    end = records["charge"][-1]
    assert (end["outcome"], end["transaction"]) == ("permanent", "commit")
    assert end["error"] == "StepRefused"
    assert end["provider_reference"] == op.claims.get(step="charge").provider_reference


def test_step_records__transient_tries_are_counted_by_attempt(provider, queue, json_log):
    provider.state.enqueue_faults("fail_before", 2)
    _, op = order_and_checkout()

    run_worker(queue)

    ends = [r for r in json_log.steps() if r["step"] == "charge" and r["event"] == "step.end"]
    assert [(r["attempt"], r["outcome"]) for r in ends] == [
        (1, "transient"),
        (2, "transient"),
        (3, "success"),
    ]
    # The claim's release is committed, so the next try may take it at once.
    assert {r["transaction"] for r in ends[:2]} == {"commit"}


def test_step_records__replayed_steps_end_skipped_without_a_call(provider, queue, json_log):
    _, op = order_and_checkout()
    run_worker(queue)
    spec = get_handler(op.kind)
    json_log.buffer.truncate(0)
    json_log.buffer.seek(0)

    run_external_step(op, "charge", spec.effect("charge", op), owner="test-worker")
    run = Run(op, "test-worker", spec)
    run.local("invoice", lambda: {"invoice": "again"})
    run.unit.commit()

    ends = {r["step"]: r for r in json_log.steps() if r["event"] == "step.end"}
    assert (ends["charge"]["outcome"], ends["charge"]["transaction"]) == ("skipped", "none")
    # The done claim is found before the function runs: nothing written, nothing rolled back.
    assert (ends["invoice"]["outcome"], ends["invoice"]["transaction"]) == ("skipped", "none")
    assert ends["charge"]["worker_id"] == "test-worker"
    assert provider.state.stats()["create_requests"] == 1


def test_step_records__a_live_claim_of_another_worker_ends_busy(provider, queue, json_log):
    _, op = order_and_checkout()  # not run: the claim below stands for a worker in the middle of it
    fence.claim_step(op, "charge", owner="other-worker", lease_seconds=30)
    spec = get_handler(op.kind)

    with pytest.raises(StepBusy):
        run_external_step(op, "charge", spec.effect("charge", op), owner="test-worker")

    end = json_log.steps()[-1]
    assert (end["event"], end["outcome"], end["transaction"]) == ("step.end", "busy", "none")
    assert provider.state.stats()["create_requests"] == 0


def test_step_records__a_lost_answer_ends_uncertain_at_warning(provider, queue, json_log):
    provider.state.configure(slow_delay=1.5)  # longer than the 1 s read timeout
    provider.state.enqueue_faults("slow", 1)
    order_and_checkout()

    run_worker(queue)

    end = json_log.steps()[-1]
    assert (end["step"], end["outcome"], end["transaction"]) == ("charge", "uncertain", "commit")
    assert end["level"] == "WARNING"
    assert provider.state.wait_idle(timeout=5)


def test_step_records__outcome_classes_are_the_documented_ones():
    assert set(OUTCOMES) == {
        "success",
        "permanent",
        "transient",
        "uncertain",
        "conflict",
        "skipped",
        "busy",
    }


def test_step_records__a_wrong_call_raises_its_type_error_before_anything_is_logged(
    provider, queue, json_log
):
    """traced() names a call's arguments by position; a call the step refuses (an argument
    passed by position where the step takes it by keyword only) raises before any record,
    and counts no provider call."""
    _, op = order_and_checkout()
    spec = get_handler(op.kind)

    with pytest.raises(TypeError):
        run_external_step(op, "charge", spec.effect("charge", op), "test-worker")

    assert json_log.steps() == []
    assert provider.state.stats()["create_requests"] == 0
