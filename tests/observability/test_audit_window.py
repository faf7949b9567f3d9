"""`fence_audit` day by day: memory of one day whatever the window, a checkpoint to resume.

Thirty days of fenced charges at the fake provider (each with its done claim),
made a day at a time and aged a day (the fake's clock and the claims' times
together), so that every day of the window has as many as the last.
"""

from __future__ import annotations

import io
import tracemalloc
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from payments.models import FenceAuditRun, StepClaim
from payments.observability import audit_window
from payments.observability.audit_window import claims_of, first_claim_id_from
from payments.provider.client import ProviderClient
from payments.provider.errors import TransientProviderError

pytestmark = pytest.mark.django_db(transaction=True)

DAYS = 30
PER_DAY = 40

INSERT_CHARGE = """
WITH op AS (
    INSERT INTO payments_operation (
        key, scope, kind, entity_type, entity_id, params, fingerprint, state, attempts,
        last_error, lease_owner, job_id, created_at, updated_at
    )
    VALUES (%(key)s, 'derived', 'checkout', 'order', %(key)s, '{}', '', 'succeeded', 1,
            '', '', '', now(), now())
    RETURNING id
)
INSERT INTO payments_stepclaim (
    operation_id, step, state, idempotency_key, provider_reference, error, attempts,
    claimed_by, claimed_at, settled_at, updated_at
)
SELECT id, 'charge', 'done', %(key)s, %(reference)s, '', 1, 'test', now(), now(), now() FROM op
"""


def run_audit(*args: str) -> tuple[str, int]:
    out = io.StringIO()
    try:
        call_command("fence_audit", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue(), exc.returncode
    return out.getvalue(), 0


@pytest.fixture
def month_of_charges(provider) -> None:
    """DAYS days of PER_DAY fenced charges, today's the last."""
    with ProviderClient.from_settings() as client:
        for day in range(DAYS):
            for n in range(PER_DAY):
                key = f"checkout:order:{day}-{n}"
                intent = client.create_payment_intent(
                    amount=1500,
                    currency="eur",
                    payment_method="pm_card_visa",
                    metadata={"operation_key": key, "step": "charge"},
                    idempotency_key=f"{key}:charge",
                )
                with connection.cursor() as cursor:
                    cursor.execute(INSERT_CHARGE, {"key": key, "reference": intent.id})
            if day < DAYS - 1:  # a day passes for everything made so far
                provider.state.age(86400)
                with connection.cursor() as cursor:
                    cursor.execute(
                        "UPDATE payments_stepclaim SET claimed_at = claimed_at - interval '1 day'"
                    )


def _peak(*args: str) -> tuple[int, str, int]:
    tracemalloc.start()
    try:
        output, code = run_audit(*args)
        return tracemalloc.get_traced_memory()[1], output, code
    finally:
        tracemalloc.stop()


def test_audit__thirty_days_take_the_memory_of_one(month_of_charges):
    # Warm: imports, connections, and the bounded caches (compiled queries, psycopg's)
    # that a longer run fills further than a day's.
    run_audit("--since", f"{DAYS}d")
    one_day, output_1, code_1 = _peak("--since", "1d")
    month, output_30, code_30 = _peak("--since", f"{DAYS}d")

    assert (code_1, code_30) == (0, 0), output_1 + output_30
    run = FenceAuditRun.objects.order_by("-finished_at").first()
    assert run.summary["provider_successes"] == DAYS * PER_DAY
    assert run.summary["done_claims"] == DAYS * PER_DAY
    assert run.summary["days"] == DAYS
    assert month < 2 * one_day, (one_day, month)


def test_audit__the_summary_keeps_counts_and_the_first_findings(provider, monkeypatch):
    monkeypatch.setattr(audit_window, "TOP_FINDINGS", 3)
    with ProviderClient.from_settings() as client:
        for n in range(5):  # charged outside the fence: five unfenced successes
            client.create_payment_intent(
                amount=1500,
                currency="eur",
                payment_method="pm_card_visa",
                metadata={"order_id": str(100 + n)},
                idempotency_key=f"outside-{n}",
            )

    output, code = run_audit("--since", "1h")

    assert code == 1
    summary = FenceAuditRun.objects.get().summary
    assert summary["counts"]["unfenced"] == 5 and len(summary["unfenced"]) == 3
    assert summary["findings"] == 5
    assert "... and 2 more" in output


def test_audit__since_last_starts_where_the_last_run_stopped(provider):
    run_audit("--since", "2d")
    first = FenceAuditRun.objects.get()

    run_audit("--since", "last")

    second = FenceAuditRun.objects.exclude(pk=first.pk).get()
    assert second.window_start == first.checkpoint
    assert second.summary["since"] == "last"


def test_audit__a_run_stopped_by_the_provider_keeps_the_days_it_finished(provider, monkeypatch):
    """The provider fails on the third day: the stored run's checkpoint is the second's end,
    and the next `--since last` audits from there."""
    calls = {"n": 0}
    real = audit_window.audit_day

    def failing_on_the_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise TransientProviderError("connection refused")
        return real(*args, **kwargs)

    monkeypatch.setattr("payments.management.commands.fence_audit.audit_day", failing_on_the_third)
    _, code = run_audit("--since", "5d")
    stopped = FenceAuditRun.objects.get()

    assert code == 2
    assert stopped.checkpoint == stopped.window_start + timedelta(days=2)
    monkeypatch.setattr("payments.management.commands.fence_audit.audit_day", real)
    assert run_audit("--since", "last")[1] == 0
    resumed = FenceAuditRun.objects.exclude(pk=stopped.pk).get()
    assert resumed.window_start == stopped.checkpoint
    assert resumed.summary["days"] == 4  # three whole days and the part of today


def test_claims_of_a_day__are_found_through_the_primary_key(month_of_charges):
    now = timezone.now()
    start, end = now - timedelta(days=3), now - timedelta(days=2)
    day = claims_of(start, end)

    by_time = StepClaim.objects.filter(claimed_at__gte=start, claimed_at__lt=end)
    assert set(StepClaim.objects.filter(day).values_list("id", flat=True)) == set(
        by_time.values_list("id", flat=True)
    )
    assert StepClaim.objects.filter(day).count() == PER_DAY
    assert first_claim_id_from(now + timedelta(days=1)) > StepClaim.objects.latest("id").id
