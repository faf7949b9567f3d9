"""An uncertain capture is settled by its own event: the provider's
`payment_intent.succeeded` names the authorisation (its metadata), and the
capture step declares that event and acts on the intent, so the event finds it.
"""

from __future__ import annotations

import pytest

from payments.captures.handler import request_capture
from payments.checkout.orders import create_order
from payments.engine import recovery, steps
from payments.engine.failpoints import AFTER_PROVIDER_ACCEPT, hooked
from payments.models import ClaimState, OperationState, ProviderEvent
from payments.webhooks.handling import handle_event
from tests.support.workers import run_worker
from tests.webhooks.test_settling import deliver

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_uncertain_capture__is_settled_by_its_succeeded_event(
    provider_with_secret, queue, monkeypatch
):
    provider = provider_with_secret
    order = create_order(amount=3000, currency="eur", email="event@example.com")
    op, _ = request_capture(
        order_id=order.pk, key="cap-ev", payment_method="pm_card_visa",
        amount_to_capture=2000, actor="t",
    )  # fmt: skip
    dropped: list[int] = []

    def drop_the_captures_answer() -> None:
        if not dropped:  # after the authorisation's 200: the capture's answer is lost
            dropped.append(provider.state.enqueue_faults("drop_after_accept", 1))

    with hooked(AFTER_PROVIDER_ACCEPT, drop_the_captures_answer):
        run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN, op.last_error
    assert op.claims.get(step="capture").state == ClaimState.UNCERTAIN

    def refuse(*args, **kwargs):
        raise AssertionError("the reconciler (or a lookup) ran: the event should settle it")

    monkeypatch.setattr(recovery, "reconcile", refuse)
    monkeypatch.setattr(steps, "_settle_from_lookup", refuse)
    (event,) = provider.state.events(type="payment_intent.succeeded")
    deliver(event)
    assert handle_event(event["id"], actor="provider-events:test") == "done"

    capture = op.claims.get(step="capture")
    assert capture.state == ClaimState.DONE
    assert capture.provider_reference.startswith("ch_")
    assert op.claims.get(step="authorize").state == ClaimState.DONE
    assert ProviderEvent.objects.get(pk=event["id"]).operation_id == op.pk
    run_worker(queue)  # the resumed operation replays both and records the capture
    op.refresh_from_db()
    assert op.state == OperationState.SUCCEEDED
