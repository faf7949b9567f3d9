"""A new attempt an operator recognises (issue 37, finding 8): named after the first attempt's
key, in the derived scope, and never charged to the payment method the provider just declined
unless the operator says so.

Inside one test transaction (no worker runs): real PostgreSQL, the real HTTP fake provider.
"""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.desk import services as desk
from payments.desk.rules import DeskError
from payments.engine import fence
from payments.engine.writes import fence_writes
from payments.models import ClaimState, KeyScope, Operation, OperationState, StepClaim
from payments.shop.models import Order, OrderStatus
from tests.support import builders
from tests.support.users import client_for

pytestmark = pytest.mark.django_db

DECLINED = "pm_card_chargeDeclined"  # builders.declined's card


def desk_url(op: Operation) -> str:
    return reverse("admin:payments_operation_desk", args=[op.pk, "new_attempt"])


def field_html(page: str, name: str) -> str:
    """The <input> of field `name` on the page."""
    found = re.search(rf'<input[^>]*name="{name}"[^>]*>', page)
    assert found is not None, name
    return found.group(0)


def help_of(page: str, name: str) -> str:
    """The help text under field `name` on the desk's confirmation page."""
    found = re.search(
        rf'class="form-row field-{name}">.*?<div class="help">(.*?)</div>', page, re.S
    )
    return re.sub(r"<[^>]+>", "", found.group(1)) if found else ""


def failed_without_a_decline(key: str) -> Operation:
    """A checkout whose charge never reached the provider and failed for good: no decline."""
    op = builders.new_checkout(key)
    claim = builders.claim_charge(op)
    fence.settle_claim(claim, ClaimState.FAILED, actor=builders.WORKER, error="gave up: timeout")
    builders.move(op, OperationState.FAILED, reason="gave up", last_error="gave up")
    op.refresh_from_db()
    return op


# --- the key: after the first attempt, in the derived scope --------------------------------


def test_new_attempt__named_after_the_first_attempt_s_key_not_its_id(provider, senior):
    op, _ = builders.declined(key="order-6-checkout")

    new = desk.start_new_attempt(op, user=senior, reason="new card", payment_method="pm_card_visa")

    assert (new.key, new.scope) == ("order-6-checkout attempt 2", KeyScope.DERIVED)
    assert str(op.pk) not in new.key


def test_new_attempt__a_third_attempt_counts_from_the_first_key(provider, senior):
    op, _ = builders.declined(key="order-6-checkout")
    second = desk.start_new_attempt(op, user=senior, reason="x", payment_method="pm_card_visa")

    assert desk.next_attempt_key(second) == "order-6-checkout attempt 3"


def test_new_attempt__a_client_key_equal_to_the_name_never_collides(provider, senior):
    """The client may use the very string as its own key: another scope, two operations."""
    op, _ = builders.declined(key="order-6-checkout")
    order = create_order(amount=100, currency="eur", email="c@example.com")
    client_op, _ = request_checkout(
        order_id=order.pk, key="order-6-checkout attempt 2", payment_method="pm_card_visa",
        actor="api",
    )  # fmt: skip

    new = desk.start_new_attempt(op, user=senior, reason="x", payment_method="pm_card_visa")

    assert new.key == client_op.key and new.pk != client_op.pk
    assert (new.scope, client_op.scope) == (KeyScope.DERIVED, KeyScope.CLIENT)


def test_new_attempt__a_derived_first_key_carries_the_first_id_so_no_client_key_collides(
    provider, senior
):
    """A first attempt keyed by the system (a desk refund's key, say) may share its string with
    a client's key of another operation: the first's id keeps their attempts apart."""
    op, _ = builders.declined(key="derived-first")
    with fence_writes():  # hand-made state: the first attempt keyed by the system
        Operation.objects.filter(pk=op.pk).update(scope=KeyScope.DERIVED)
    op.refresh_from_db()

    assert desk.next_attempt_key(op) == f"derived-first attempt 2 (#{op.pk})"


def test_new_attempt__a_key_of_255_characters_still_names_a_key_that_fits(provider, senior):
    op, _ = builders.declined(key="k" * 255)

    new = desk.start_new_attempt(op, user=senior, reason="x", payment_method="pm_card_visa")

    assert len(new.key) <= 255
    assert new.key.startswith("kkkk") and new.key.endswith(f" attempt 2 (#{op.pk})")


# --- the payment method: never the declined one by default ---------------------------------


def test_new_attempt_page__after_a_decline__the_method_is_empty_and_the_declined_one_named(
    provider, senior
):
    op, _ = builders.declined(key="order-6-checkout")

    page = client_for(senior).get(desk_url(op)).content.decode()

    assert 'value="' not in field_html(page, "payment_method")  # nothing pre-filled
    assert DECLINED in help_of(page, "payment_method") and "declined" in help_of(
        page, "payment_method"
    )
    assert "as before" not in page  # blank no longer means the declined card
    assert 'name="charge_declined_again"' in page  # the explicit way to try it again
    assert "order-6-checkout attempt 2" in page


def test_new_attempt_form__blank_after_a_decline__refused_nothing_started(provider, senior):
    op, _ = builders.declined()

    response = client_for(senior).post(desk_url(op), {"reason": "customer called"})

    assert response.status_code != 302
    assert DECLINED in response.content.decode()
    assert not Operation.objects.filter(retry_of=op).exists()


def test_new_attempt_form__the_declined_method_again_unconfirmed__refused(provider, senior):
    op, _ = builders.declined()

    response = client_for(senior).post(
        desk_url(op), {"reason": "customer called", "payment_method": DECLINED}
    )

    assert response.status_code != 302
    assert "Charge the declined payment method again" in response.content.decode()
    assert not Operation.objects.filter(retry_of=op).exists()


def test_new_attempt_form__the_declined_method_again_confirmed__started_with_it(provider, senior):
    op, _ = builders.declined()

    response = client_for(senior).post(
        desk_url(op),
        {"reason": "bank unblocked it", "payment_method": DECLINED, "charge_declined_again": "on"},
    )

    assert response.status_code == 302
    assert Operation.objects.get(retry_of=op).params["payment_method"] == DECLINED


def test_new_attempt_form__another_method__started_with_it(provider, senior):
    op, _ = builders.declined()

    response = client_for(senior).post(
        desk_url(op), {"reason": "new card", "payment_method": "pm_card_visa"}
    )

    assert response.status_code == 302
    new = Operation.objects.get(retry_of=op)
    assert new.params["payment_method"] == "pm_card_visa"
    assert Order.objects.get(pk=op.params["order_id"]).status == OrderStatus.PROCESSING


@pytest.mark.parametrize("method", [None, "", DECLINED])
def test_start_new_attempt__the_declined_method_refused_by_the_service_too(
    provider, senior, method
):
    """The service decides, whoever calls it (the form only says it first)."""
    op, _ = builders.declined()

    with pytest.raises(DeskError, match=f"the provider declined {DECLINED}"):
        desk.start_new_attempt(op, user=senior, reason="x", payment_method=method)

    assert not Operation.objects.filter(retry_of=op).exists()


def test_start_new_attempt__the_declined_method_confirmed__accepted(provider, senior):
    op, _ = builders.declined()

    new = desk.start_new_attempt(
        op, user=senior, reason="bank unblocked it", payment_method=DECLINED,
        charge_declined_again=True,
    )  # fmt: skip

    assert new.params["payment_method"] == DECLINED


def test_new_attempt__not_declined__blank_keeps_the_method_and_the_page_says_so(provider, senior):
    """A charge that failed without the provider refusing it: its card was never declined."""
    op = failed_without_a_decline("timed-out")
    assert StepClaim.objects.get(operation=op).provider_reference == ""

    page = client_for(senior).get(desk_url(op)).content.decode()
    new = desk.start_new_attempt(op, user=senior, reason="provider was down")

    assert "pm_card_visa" in help_of(page, "payment_method") and "declined" not in help_of(
        page, "payment_method"
    )
    assert 'name="charge_declined_again"' not in page
    assert new.params["payment_method"] == "pm_card_visa"
