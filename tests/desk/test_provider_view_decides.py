"""What the provider showed for an unsettled step decides what the desk offers and counts.

A charge whose answer was lost (the fake provider's `drop_after_accept`: it charges, then
closes the connection) is uncertain in the fence; the fence audit then sees the success at
the provider and notes it on the claim. Transactional: the checkout runs in a real worker
(its claim must commit before its call).
"""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from payments.models import ClaimState, Operation, OperationState
from payments.shop.models import Order
from tests.support import flows
from tests.support.users import RECONCILE, VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def answer_lost(provider, queue, key: str = "lost-1") -> Operation:
    """A checkout charged at the provider whose answer never came back: uncertain."""
    provider.state.enqueue_faults("drop_after_accept", 1)
    op = flows.checkout(key)
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return op


def audited(op: Operation) -> str:
    """Run the fence audit, which notes the success on the claim; the provider's reference."""
    try:
        call_command("fence_audit", stdout=io.StringIO())
    except CommandError:
        pass  # exit 1: it found the success without a done claim, as meant
    view = op.claims.get(step="charge").provider_view
    assert isinstance(view, dict)
    assert view["status"] == "succeeded"
    return str(view["reference"])


def mark_failed_url(op: Operation) -> str:
    return reverse("admin:payments_operation_desk_step", args=[op.pk, "charge", "mark_failed"])


def test_mark_failed_page__the_provider_showed_success__refused_and_mark_succeeded_offered(
    provider, queue
):
    op = answer_lost(provider, queue)
    reference = audited(op)
    client = client_for(make_user("olga", *VIEW, RECONCILE))

    page = client.get(mark_failed_url(op)).content.decode()

    assert "No object at the provider is known" not in page
    assert "The provider showed step <strong>charge</strong> succeeded" in page
    refusal = page.split('class="errornote desk-state-forbids"', 1)[1].split("</p>", 1)[0]
    assert reference in refusal and "mark it succeeded" in refusal
    assert 'desk-danger" value="Yes, check and mark failed" disabled' in page
    succeeded_url = reverse(
        "admin:payments_operation_desk_step", args=[op.pk, "charge", "mark_succeeded"]
    )
    assert f'href="{succeeded_url}"' in page
    form = client.get(succeeded_url).content.decode()
    assert f'value="{reference}"' in form  # prefilled with what the provider showed
    change = client.get(reverse("admin:payments_operation_change", args=[op.pk])).content.decode()
    assert (
        f"Mark charge failed is unavailable: the provider showed step charge succeeded ({reference})"
        in change
    )


def test_mark_failed_post__the_provider_showed_success__refused_nothing_changed(provider, queue):
    op = answer_lost(provider, queue)
    reference = audited(op)
    client = client_for(make_user("olga", *VIEW, RECONCILE))

    response = client.post(mark_failed_url(op), {"reason": "looks failed"})

    assert response.status_code == 409
    assert reference in response.content.decode()
    claim = op.claims.get(step="charge")
    assert (claim.state, claim.provider_reference) == (ClaimState.UNCERTAIN, "")
    assert Operation.objects.get(pk=op.pk).state == OperationState.UNCERTAIN
    assert provider.state.stats()["cancel_requests"] == 0


def test_mark_failed__never_asked_in_this_state__get_and_post_refused_nothing_changed(
    provider, queue
):
    op = answer_lost(provider, queue)
    before = Operation.objects.get(pk=op.pk)
    client = client_for(make_user("olga", *VIEW, RECONCILE))
    reason = "nobody has asked the provider about step charge since the operation became uncertain"

    shown = client.get(mark_failed_url(op))
    posted = client.post(mark_failed_url(op), {"reason": "customer says it failed"})

    assert shown.status_code == posted.status_code == 409
    assert reason in shown.content.decode() and reason in posted.content.decode()
    assert "Nothing was changed" in posted.content.decode()
    claim = op.claims.get(step="charge")
    assert (claim.state, claim.provider_reference, claim.provider_view) == (
        ClaimState.UNCERTAIN, "", None
    )  # fmt: skip
    after = Operation.objects.get(pk=op.pk)
    assert (after.state, after.updated_at) == (before.state, before.updated_at)
    assert provider.state.stats()["cancel_requests"] == 0


def test_order_page__charge_answer_lost_but_the_provider_showed_it__charged_at_the_provider(
    provider, queue, settings
):
    dashboard = "https://dashboard.example/payments/{reference}"
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_DASHBOARD_URL": dashboard}
    op = answer_lost(provider, queue)
    reference = audited(op)
    order = Order.objects.get(pk=int(op.entity_id))

    page = (
        client_for(make_user("vera", *VIEW))
        .get(reverse("admin:shop_order_change", args=[order.pk]))
        .content.decode()
    )

    charged = page.split('id="desk-charged"', 1)[1].split("</div>", 1)[0]
    assert "€25.00" in charged and "at the provider, not yet settled" in charged
    table = page.split('id="desk-movements"', 1)[1].split("</table>", 1)[0]
    [row] = [r for r in table.split("<tr")[1:] if reference in r]
    assert "at the provider, not yet settled" in row and "€25.00" in row
    assert f'href="{dashboard.format(reference=reference)}"' in row
