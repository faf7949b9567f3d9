"""The payment page's provider timeline: who sent each request, and the newest rows kept.

Transactional: the checkout runs in a real worker against the real fake provider (a claim
must commit before its call); its answer is dropped for real (`drop_after_accept`).
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from payments.desk.services import query_provider
from payments.desk.views import payment
from payments.models import Operation, OperationEvent
from payments.shop.models import Order
from tests.support import flows
from tests.support.users import RECONCILE, VIEW, client_for, make_user
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def settled_by_an_operator(provider, queue) -> tuple[Operation, str]:
    """A charge claimed and sent by a worker, its answer lost, then settled by olga's look-up
    (who took the claim over); (operation, the worker that claimed it)."""
    provider.state.enqueue_faults("drop_after_accept", 1)
    op = flows.checkout("taken-over")
    run_worker(queue)
    worker = OperationEvent.objects.get(operation=op, step="charge", reason="claimed").actor
    query_provider([op.pk], user=make_user("olga", *VIEW, RECONCILE))
    assert op.claims.get(step="charge").claimed_by != worker  # taken over since
    return op, worker


def timeline_rows(op: Operation) -> list[str]:
    order = Order.objects.get(pk=int(op.entity_id))
    page = (
        client_for(make_user("vera", *VIEW))
        .get(reverse("admin:shop_order_change", args=[order.pk]))
        .content.decode()
    )
    table = page.split('id="desk-timeline"', 1)[1].split("</table>", 1)[0]
    return table.split("<tbody>", 1)[1].split("<tr")[1:]


def test_timeline__claim_taken_over_later__the_claimed_row_names_who_claimed_it(provider, queue):
    op, worker = settled_by_an_operator(provider, queue)

    [claimed] = [r for r in timeline_rows(op) if "claimed, then sent" in r]

    who = claimed.split('class="desk-who">', 1)[1].split("</td>", 1)[0]
    assert who == worker


def test_timeline__more_events_than_it_shows__the_newest_are_kept(provider, queue, monkeypatch):
    op, _ = settled_by_an_operator(provider, queue)
    monkeypatch.setattr(payment, "TIMELINE_ROWS", 2)

    rows = timeline_rows(op)

    assert len(rows) == 2
    assert any("→ done" in r for r in rows), rows
