"""The audit's findings that refunds settle, judged over every day of the window.

A payment the fence did not make (no done claim carries it), and its refunds,
listed by an in-memory ledger as a system's consistent lists would list them:
by `created`, each day with its clock margin on both sides, so that a refund
made at midnight is listed on both days. The refunds are the system's own too (no
claim carries them): the refund audit's findings, not these.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from payments.engine.systems import Ledger, LedgerEntry
from payments.observability.audit_window import WindowAudit, audit_day, days

pytestmark = pytest.mark.django_db

START = datetime(2026, 11, 1, tzinfo=UTC)
MIDNIGHT = int((START + timedelta(days=1)).timestamp())
PAYMENT = LedgerEntry("pi_outside", True, {"order_id": "7"}, 1000, int(START.timestamp()) + 60)


def refund(rid: str, amount: int, created: int) -> LedgerEntry:
    return LedgerEntry(rid, True, {}, amount, created, parent=PAYMENT.id)


def audited(*refunds: LedgerEntry) -> WindowAudit:
    """Two days audited one at a time, as fence_audit does."""

    def ledger(start: int, end: int) -> Ledger:
        return Ledger(
            payments=[PAYMENT] if start <= PAYMENT.created < end else [],
            refunds=[r for r in refunds if start <= r.created < end],
        )

    window = WindowAudit()
    spans = list(days(START, START + timedelta(days=2)))
    for n, (start, end) in enumerate(spans):
        window.add_day(audit_day(ledger, start, end, first=n == 0, last=n == len(spans) - 1))
    return window


def test_refunded_in_part__a_refund_listed_on_both_days_counts_once__still_a_finding():
    window = audited(refund("re_midnight", 600, MIDNIGHT))

    summary = window.as_summary()
    assert summary["unfenced"] == [PAYMENT.id] and summary["counts"]["unfenced"] == 1
    assert summary["refunded_in_full"] == []


def test_refunded_in_full_over_two_days__not_a_finding__named_refunded():
    window = audited(
        refund("re_midnight", 600, MIDNIGHT), refund("re_next_day", 400, MIDNIGHT + 3600)
    )

    summary = window.as_summary()
    assert summary["unfenced"] == [] and summary["counts"]["unfenced"] == 0
    assert summary["findings"] == summary["refunds"]["findings"]  # only the refunds' own
    assert summary["refunded_in_full"] == [PAYMENT.id]
