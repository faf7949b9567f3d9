"""The demo's verdict: work not drained in time is not an invariant violated."""

from __future__ import annotations

import pytest

from devtools.chaos.run import ChaosConfig, ChaosResult, _violations, never_claimed
from tests.support import builders

CLEAN = {
    "double_charges": 0,
    "charged_but_failed_orders": 0,
    "provider_successes_without_claim": 0,
    "provider_successes_never_claimed": 0,
    "double_refunds": 0,
    "over_refunds": 0,
    "refunds_without_claim": 0,
    "refunds_never_claimed": 0,
    "orders_with_more_than_one_invoice": 0,
    "double_captures": 0,
    "holds_left_after_failure": 0,
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


#: What work in flight leaves behind when the run stops waiting, figure by figure: a worker
#: killed between the provider's answer and the record (a success or refund whose claim is
#: not done yet), a new attempt charged but its order not marked paid yet, a follow-up or a
#: refund not run yet.
PENDING = {
    "provider_successes_without_claim": 2,
    "refunds_without_claim": 1,
    "charged_but_failed_orders": 1,
    "paid_orders_with_one_invoice": 8,
    "paid_orders_with_one_ledger_line": 3,
    "credit_notes": 1,
    "orders_with_refunds_matching": 1,
    "holds_left_after_failure": 1,
}


@pytest.mark.parametrize(("figure", "value"), sorted(PENDING.items()))
def test_not_drained__each_figure_work_in_flight_leaves_is_no_violation(figure, value):
    assert _violations(result_with(settled_in_time=False, **{figure: value})) == []


@pytest.mark.parametrize(("figure", "value"), sorted(PENDING.items()))
def test_drained__each_of_those_figures_is_a_violation(figure, value):
    assert len(_violations(result_with(**{figure: value}))) == 1


@pytest.mark.parametrize(
    ("figure", "said"),
    [
        ("double_charges", "1 double charges"),
        ("provider_successes_never_claimed", "1 provider successes never claimed"),
        ("double_refunds", "1 double refunds"),
        ("over_refunds", "1 orders refunded more than their charge"),
        ("refunds_never_claimed", "1 provider refunds never claimed"),
        ("orders_with_more_than_one_invoice", "an order with more than one invoice"),
        ("double_captures", "1 orders captured twice"),
    ],
)
def test_not_drained__money_twice_or_outside_the_fence_is_still_a_violation(figure, said):
    """No pending work explains these: a charge or refund its key and step never claimed."""
    assert _violations(result_with(settled_in_time=False, **{figure: 1})) == [said]


def test_every_figure_is_judged_drained_or_not():
    """A figure added to the verdict is listed here as pending work or as money."""
    judged = set(PENDING) | {
        "double_charges",
        "provider_successes_never_claimed",
        "double_refunds",
        "over_refunds",
        "refunds_never_claimed",
        "orders_with_more_than_one_invoice",
        "double_captures",
        "refunds_refused_by_api",
    }
    assert judged | {
        "orders_paid",
        "refunds_succeeded",
        "orders_with_refunds",
        "settled_in_time",
    } == set(CLEAN)


@pytest.mark.django_db
def test_never_claimed__a_success_whose_claim_is_in_flight_is_not_counted(provider):
    """Charged, the answer lost: its claim is uncertain, not done. Work in flight, not a
    charge outside the fence; one under a key nobody claimed is."""
    op, claim, reference = builders.uncertain(key="in-flight", charged=True)
    metadata = {
        reference: {"operation_key": op.key, "step": claim.step},
        "pi_outside": {"operation_key": "nobody-claimed-this", "step": claim.step},
        "pi_no_key": {},
    }

    assert never_claimed([reference], metadata) == 0
    assert never_claimed([reference, "pi_outside", "pi_no_key"], metadata) == 2


EXPORTED = {
    "double_invoices_any_operation": 0,
    "invoices_outside_the_fence": 0,
    "paid_orders_exported_once": 10,
}


def test_export__a_double_invoice_is_a_violation_drained_or_not():
    export = {**EXPORTED, "double_invoices_any_operation": 1}
    assert _violations(result_with(settled_in_time=False, export=export)) == [
        "1 invoices exported twice"
    ]


def test_export__a_paid_order_not_exported_yet_is_one_only_once_drained():
    export = {**EXPORTED, "paid_orders_exported_once": 9}
    assert _violations(result_with(settled_in_time=False, export=export)) == []
    assert _violations(result_with(export=export)) == [
        "a paid order not exported exactly once to the accounting system"
    ]
