"""A worker SIGKILLed just after the accounting system's 201: the redelivered job makes no
second invoice.

Real worker processes (tests.support.workers.Supervisor: a worker restarted when it dies,
beside the recovery loop) against the fake accounting API over real HTTP.
"""

from __future__ import annotations

import pytest

from payments.invoices.effect import external_id
from payments.invoices.names import EXPORT
from payments.models import ClaimState, Operation, OperationState
from tests.invoices.conftest import accounting_env, export_of
from tests.support import flows
from tests.support.workers import SIMPLE, Supervisor

# Transactional: the worker processes must see the committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


def test_worker_killed_after_the_201__redelivered__exactly_one_invoice(
    accounting, provider, queue, tmp_path
):
    _, op = flows.order_and_checkout(key="exp-crash")
    point = f"after_provider_accept@{EXPORT}"
    marker = tmp_path / "failpoint"
    env = accounting_env(
        provider, accounting, FENCE_FAILPOINTS=point, FENCE_FAILPOINT_MARKER=str(marker)
    )
    supervisor = Supervisor(env, "export-crash", SIMPLE)

    def exported() -> bool:
        export = Operation.objects.filter(parent=op, kind="invoice_export").first()
        return export is not None and export.state == OperationState.SUCCEEDED

    stderr = supervisor.run_until(
        exported, timeout=60, what=f"the export to succeed after a crash at {point}"
    )

    assert marker.with_name(f"failpoint.{point}").exists(), f"no crash happened:\n{stderr}"
    export = export_of(op)
    (invoice,) = accounting.state.invoices(external_id=external_id(export))
    claim = export.claims.get(step=EXPORT)
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, invoice["id"])
    assert len(accounting.state.invoices()) == 1
