"""Search by a reference a look saw at the provider, while its step is not settled.

During an outage a charge's answer is lost and its claim has no reference. The
desk's "Query the provider" reads the charge at the provider (for an operation
a worker may still run: a read only, nothing settled) and keeps what it saw on
the claim. An operator who has the `pi_` id from the provider's dashboard or a
customer then searches it: the operation must be found from what we recorded,
not only by asking the provider again (which may be down by then).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib import admin as django_admin
from django.contrib.auth.models import User
from django.test import RequestFactory
from django.utils import timezone

from payments.admin import OperationAdmin
from payments.engine.writes import fence_writes
from payments.models import ClaimState, Operation, OperationState, StepClaim
from tests.support import builders
from tests.support.history import FENCE_TABLES, planner_sees_larger, write_history
from tests.support.plans import history_read_by, statements_sent
from tests.support.users import client_for

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/payments/operation/"


def charged_then_worker_lost(key: str) -> tuple[Operation, StepClaim, str]:
    """The provider charged; the worker died before it recorded the answer, and the
    operation waits for its next attempt (a worker may still run it)."""
    op = builders.new_checkout(key)
    claim = builders.claim_charge(op)
    reference, _ = builders.call_provider(claim)
    later = timezone.now() + timedelta(minutes=5)
    builders.move(op, OperationState.RETRYING, reason="worker lost", next_attempt_at=later)
    return op, claim, reference


def test_search__a_reference_a_query_saw__finds_its_operation_with_the_provider_down(
    provider, operator, settings
):
    op, claim, reference = charged_then_worker_lost("seen-1")
    client = client_for(operator)
    client.post(
        CHANGELIST, {"action": "query_selected", "_selected_action": [op.pk], "post": "yes"}
    )
    claim.refresh_from_db()
    assert claim.provider_view["reference"] == reference  # what the look saw
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": "http://127.0.0.1:9"}  # no answer

    response = client.get(CHANGELIST, {"q": reference})

    assert [found.pk for found in response.context["cl"].result_list] == [op.pk]
    assert f"No step has {reference}" not in response.content.decode()
    # What the look saw settles nothing: the worker (or the reconciler) records the outcome.
    claim.refresh_from_db()
    op.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.CLAIMED, "")
    assert op.state == OperationState.RETRYING


def test_search__a_seen_reference__reads_the_claims_index_not_the_history():
    """Beside 3,000 operations the planner sees a thousand times larger, the search for a
    reference only a look saw reads no history (EXPLAIN ANALYZE of each statement)."""
    write_history(3000, open_every=500, failed_every=50)
    looked = StepClaim.objects.filter(state=ClaimState.UNCERTAIN).order_by("pk").first()
    assert looked is not None and looked.provider_reference == ""
    with fence_writes():  # hand-made state: what note_provider_view leaves after a look
        StepClaim.objects.filter(pk=looked.pk).update(seen_reference="pi_seen_42")
    model_admin = OperationAdmin(Operation, django_admin.site)
    request = RequestFactory().get(CHANGELIST, {"q": "pi_seen_42"})
    request.user = User(username="root", is_superuser=True, is_staff=True, is_active=True)

    def search() -> None:
        found, _ = model_admin.get_search_results(request, Operation.objects.all(), "pi_seen_42")
        assert list(found.values_list("pk", flat=True)) == [looked.operation_id]

    with planner_sees_larger(FENCE_TABLES):
        assert history_read_by(statements_sent(search), bound=50) == []
