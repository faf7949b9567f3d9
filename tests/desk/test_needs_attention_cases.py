"""Needs attention lists the cases to work, oldest first, a page at a time; its audit and chart
read plainly."""

from __future__ import annotations

import colorsys
import io
import re

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from payments.desk.display import BADGE_COLOURS
from payments.desk.views import attention
from payments.models import OperationState
from payments.provider.client import ProviderClient
from payments.shop.models import Order
from tests.support import builders, flows
from tests.support.users import VIEW, client_for, make_user


@pytest.mark.django_db
def test_cases__paginated_oldest_first_with_links_to_the_next_page(provider, monkeypatch):
    monkeypatch.setattr(attention, "CASES_PER_PAGE", 1)
    builders.uncertain(key="first-stuck", charged=False)
    builders.uncertain(key="then-stuck", charged=False)
    client = client_for(make_user("vera", *VIEW))
    url = reverse("admin:payments_operation_needs_attention")

    one, two = client.get(url), client.get(url, {"page": 2})

    assert [r["operation"].key for r in one.context["cases"].rows] == ["first-stuck"]
    assert [r["operation"].key for r in two.context["cases"].rows] == ["then-stuck"]
    assert "Page 1 of 2" in one.content.decode() and 'href="?page=2"' in one.content.decode()


def charged_again_by_a_script(queue) -> Order:
    """A paid order charged a second time by a script that names only the order (no operation
    key in its metadata), then found by the fence audit."""
    order = flows.paid_order(queue, amount=1999)
    with ProviderClient.from_settings() as client:
        client.create_payment_intent(
            amount=order.amount, currency=order.currency, payment_method="pm_card_visa",
            metadata={"order_id": str(order.pk)}, idempotency_key=f"script-{order.pk}",
        )  # fmt: skip
    with pytest.raises(CommandError):  # exit 1: it found the double charge, as meant
        call_command("fence_audit", stdout=io.StringIO())
    return order


# Transactional: the checkouts run in a real worker (a claim must commit before its call), and
# the double charge is a real second charge at the fake provider, found by the fence audit.
@pytest.mark.django_db(transaction=True)
def test_needs_attention__audit_and_chart__readable_words_and_cards_on_a_phone(provider, queue):
    order = charged_again_by_a_script(queue)
    lost = flows.uncertain_after_read_timeout(provider, queue, key="lost-answer")

    page = (
        client_for(make_user("vera", *VIEW))
        .get(reverse("admin:payments_operation_needs_attention"))
        .content.decode()
    )

    audit = page.split('id="desk-audit"', 1)[1]
    entities = audit.split('id="audit-double-charged-entities"', 1)[0].rsplit("<table", 1)[1]
    assert "desk-stack" in entities  # one card per row on a phone, as the other tables
    cells = audit.split('id="audit-double-charged-entities"', 1)[1].split("</table>", 1)[0]
    assert 'data-label="order"' in cells and f"Order {order.pk}" in cells
    assert "(outside the fence)" in cells and "(no such operation)" not in cells
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", audit.split("</table>", 1)[0])  # no ISO
    chart = page.split('class="desk-chart"', 1)[1].split("</svg>", 1)[0]
    assert re.search(r">\d\d:00 UTC<", chart)
    cases = page.split('id="desk-cases"', 1)[1].split("</table>", 1)[0]
    [case] = [r for r in cases.split("<tr")[1:] if lost.key in r]
    error = case.split('class="desk-case-error"', 1)[1].split("</td>", 1)[0]
    assert "<small>-</small>" not in error and "ReadTimeout" in error


def test_chart__needs_review_is_far_from_failed_in_hue():
    def hue(colour: str) -> float:
        r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
        return colorsys.rgb_to_hsv(r, g, b)[0] * 360

    review, failed = (
        BADGE_COLOURS[OperationState.NEEDS_REVIEW],
        BADGE_COLOURS[OperationState.FAILED],
    )
    apart = abs(hue(review) - hue(failed))
    assert min(apart, 360 - apart) >= 90, (review, failed)


@pytest.mark.django_db
def test_search__an_unknown_refund_id_says_the_provider_does_not_know_it(provider):
    page = (
        client_for(make_user("vera", *VIEW))
        .get("/admin/payments/operation/", {"q": "re_zzz"}, follow=True)
        .content.decode()
    )
    assert "No step has re_zzz, and the provider does not know it." in page


@pytest.mark.django_db
def test_cases__moved_from_uncertain_to_review__waiting_since_it_went_uncertain():
    """The operator's try: an operation uncertain for 40 minutes that the reconciler moved
    to review read "waiting 0 minutes" and sorted after a case 10 minutes old."""
    from datetime import timedelta

    from django.db import transaction
    from django.utils import timezone

    from payments.engine import fence
    from payments.engine.writes import fence_writes
    from payments.models import OperationEvent

    def aged(key: str, minutes: int):
        op, _claim, _ = builders.uncertain(key=key, charged=False)
        with fence_writes():
            for event in OperationEvent.objects.filter(operation=op):
                OperationEvent.objects.filter(pk=event.pk).update(
                    created_at=event.created_at - timedelta(minutes=minutes)
                )
        return op

    first = aged("uncertain-40-min-ago", 40)
    aged("uncertain-10-min-ago", 10)
    with transaction.atomic():  # as the reconciler moves it (payments.engine.recovery)
        locked = fence.locked_operation_in_tx(first.pk)
        fence.release_in_tx(
            locked, OperationState.NEEDS_REVIEW, actor="reconciler:t", reason="not found"
        )
    client = client_for(make_user("vera", *VIEW))

    page = client.get(reverse("admin:payments_operation_needs_attention"))

    rows = page.context["cases"].rows
    assert [r["operation"].key for r in rows] == ["uncertain-40-min-ago", "uncertain-10-min-ago"]
    assert rows[0]["age"].startswith("40")
    assert timezone.now() - rows[0]["operation"].waiting_since > timedelta(minutes=39)
    oldest_review = page.content.decode().split('id="oldest-needs-review"', 1)[1].split("</tr>")[0]
    assert 'needs review, waiting <strong class="age">40' in oldest_review  # as the cases
