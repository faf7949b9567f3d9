"""The demo's verdict: work not drained in time is not an invariant violated."""

from __future__ import annotations

from devtools.chaos import ChaosConfig, ChaosResult, _violations

CLEAN = {
    "double_charges": 0,
    "charged_but_failed_orders": 0,
    "provider_successes_without_claim": 0,
    "double_refunds": 0,
    "over_refunds": 0,
    "refunds_without_claim": 0,
    "orders_with_more_than_one_invoice": 0,
    "orders_paid": 10,
    "paid_orders_with_one_invoice": 10,
    "paid_orders_with_one_ledger_line": 10,
    "refunds_refused_by_api": 0,
    "credit_notes": 2,
    "refunds_succeeded": 2,
    "orders_with_refunds": 2,
    "orders_with_refunds_matching": 2,
    "settled_in_time": True,
}


def result_with(**report: object) -> ChaosResult:
    return ChaosResult(config=ChaosConfig(), run_id="t", report={**CLEAN, **report})


def test_not_drained__pending_bookkeeping_is_no_violation():
    """A slow machine: paid orders whose ledger follow-ups are still pending were reported as
    "a paid order without exactly one ledger line"."""
    slow = result_with(settled_in_time=False, paid_orders_with_one_ledger_line=3)
    assert _violations(slow) == []


def test_not_drained__a_double_charge_is_still_a_violation():
    slow = result_with(settled_in_time=False, double_charges=1)
    assert _violations(slow) == ["1 double charges"]


def test_drained__missing_bookkeeping_is_a_violation():
    done = result_with(paid_orders_with_one_ledger_line=9)
    assert _violations(done) == ["a paid order without exactly one ledger line"]
