"""The desk speaks of a refund as a refund: every confirmation, button and money line.

The desk knows no business: each page is worded from the operation's handler
(its step names, `DeskHooks.describe`, its hooks). These tests walk every desk
action on refund operations an uncertain answer or a failure left behind, and
check that no page speaks of a checkout ("charge", "payment failed",
"invoice", "processing"); that "Start a new attempt" is offered on a failed
refund and says what it will do; and that a kind declaring no new attempt says
so instead of offering one.

Transactional: the refunds run in a real worker against the real fake provider
(a claim must commit before its call).
"""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.db import transaction
from django.urls import reverse

from payments.desk.views.actions import DESK_ACTIONS
from payments.engine import fence, handlers
from payments.engine.handlers import DeskHooks, Run, handler
from payments.models import Operation, OperationState
from payments.refunds.handler import request_refund
from payments.shop.models import Order, OrderStatus
from tests.support import builders, flows
from tests.support.users import client_for
from tests.support.workers import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

#: What a checkout's pages say and a refund's must not.
CHECKOUT_WORDS = ("charge", "payment failed", "invoice", "processing")
CHANGELIST = "/admin/payments/operation/"
NEEDS_ATTENTION = "/admin/payments/operation/needs-attention/"
#: Every desk action, with the step the ones that settle a step are about.
REFUND_ACTIONS = [(name, "refund" if name.startswith("mark_") else "") for name in DESK_ACTIONS]


#: Tags that separate words on the page (inline ones, such as <code>, do not).
BLOCKS = frozenset(
    "p div td th tr li ul table h1 h2 h3 br label a span input textarea title".split()
)


class _Words(HTMLParser):
    """What a person reads on a page: its text, button labels and tooltips (no style, script)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("style", "script"):
            self._hidden += 1
        found = dict(attrs)
        if tag == "input" and found.get("type") == "submit":
            self.parts.append(f" {found.get('value') or ''} ")
        if found.get("title"):
            self.parts.append(f" {found['title']} ")
        if tag in BLOCKS:
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("style", "script"):
            self._hidden -= 1
        if tag in BLOCKS:
            self.parts.append(" ")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.parts.append(data)


def words(html: str) -> str:
    """The page as a person reads it, whitespace collapsed."""
    parser = _Words()
    parser.feed(html)
    return " ".join("".join(parser.parts).split())


def checkout_words_in(text: str) -> list[str]:
    return [word for word in CHECKOUT_WORDS if word in text.lower()]


def desk_url(op: Operation, action: str, step: str = "") -> str:
    if step:
        return reverse("admin:payments_operation_desk_step", args=[op.pk, step, action])
    return reverse("admin:payments_operation_desk", args=[op.pk, action])


def change_url(op: Operation) -> str:
    return reverse("admin:payments_operation_change", args=[op.pk])


def uncertain_refund(provider, queue, order: Order, key: str = "refund-lost", amount: int = 600):
    """Refunded at the provider, the answer lost on the way back: uncertain."""
    provider.state.enqueue_faults("drop_after_accept", 1)
    op, _ = request_refund(order_id=order.pk, key=key, amount=amount, actor="api")
    run_worker(queue)
    assert provider.state.wait_idle(timeout=5)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    return op


def failed_refund(provider, queue, order: Order, key: str = "refund-down", amount: int = 400):
    """Every attempt refused before the provider did anything: failed, nothing refunded."""
    provider.state.enqueue_faults("fail_before", 3)
    op, _ = request_refund(order_id=order.pk, key=key, amount=amount, actor="api")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.FAILED
    assert provider.state.refunds(metadata={"operation_key": key}) == []
    return op


# --- every page and button of a refund -------------------------------------------------------


@pytest.mark.parametrize("left_by", ["uncertain", "failed"])
def test_refund_operation__page_and_buttons_speak_of_the_refund(provider, queue, senior, left_by):
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    build = uncertain_refund if left_by == "uncertain" else failed_refund
    op = build(provider, queue, order)

    page = client_for(senior).get(change_url(op)).content.decode()

    text = words(page)
    assert checkout_words_in(text) == [], text
    money = "€6.00" if left_by == "uncertain" else "€4.00"
    assert f"{money} refund of order {order.pk}" in text  # the handler's money line
    if left_by == "uncertain":  # the step's own name on its buttons
        assert "Mark refund succeeded" in text and "Mark refund failed" in text


@pytest.mark.parametrize("left_by", ["uncertain", "failed"])
@pytest.mark.parametrize("action, step", REFUND_ACTIONS)
def test_refund_confirmation__every_action_speaks_of_the_refund(
    provider, queue, senior, left_by, action, step
):
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    build = uncertain_refund if left_by == "uncertain" else failed_refund
    op = build(provider, queue, order)

    response = client_for(senior).get(desk_url(op, action, step))

    # Nobody asked the provider in this state yet: mark failed is refused (409), worded alike;
    # a failed refund has no step waiting: nothing to query (409). Any page the state
    # refuses answers 409, its refusal on it (an operator's walk: resume and new attempt
    # answered 200 where mark failed answered 409).
    refused = {
        "uncertain": {"mark_failed", "resume", "new_attempt"},
        "failed": {"mark_failed", "query_provider", "resume", "mark_succeeded"},
    }[left_by]
    assert response.status_code == (409 if action in refused else 200)
    assert bool(response.context["refused"]) is (action in refused)
    if step and left_by == "failed":  # the rule's own words, as the service says them
        assert response.context["refused"] == "step refund is settled already (failed)"
    text = words(response.content.decode())
    assert checkout_words_in(text) == [], f"{action} on a {left_by} refund: {text}"
    money = "€6.00" if left_by == "uncertain" else "€4.00"
    assert f"{money} refund of order {order.pk}" in text
    assert "What will happen" in text and "Yes, " in text
    if step:
        title = DESK_ACTIONS[action].title.replace("step", "refund")
        assert f"{title}: {op.key}" in text  # as its button names it
    if action == "new_attempt":  # an operator's walk: "stays failed" read on an uncertain one
        stays = "The old operation stays failed and links to the new one"
        assert (stays in text) == (left_by == "failed"), text
        if left_by == "uncertain":
            assert "Only a failed operation gets one: this one is uncertain." in text


def test_refund_confirmation__the_reference_is_a_refund_s(provider, queue, senior):
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    first = uncertain_refund(provider, queue, order, key="refund-a")
    client = client_for(senior)
    client.post(desk_url(first, "query_provider"))  # settled from the provider: re_… recorded
    second = uncertain_refund(provider, queue, order, key="refund-b", amount=900)

    page = client.get(desk_url(second, "mark_succeeded", "refund")).content.decode()

    text = words(page)
    assert "The id of step refund at the provider (re_…)" in text
    assert "a succeeded refund at the provider" in text
    assert "its remaining steps (credit_note) run in a worker" in text
    assert checkout_words_in(text) == []


def test_refund_confirmation__mark_failed_and_resume_change_nothing_else(provider, queue, senior):
    """A refund declares no failure or resume hook: the pages say the order stays as it is."""
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    op = failed_refund(provider, queue, order)
    client = client_for(senior)

    resume = words(client.get(desk_url(op, "resume")).content.decode())
    assert "fresh budget of attempts" in resume
    assert f"Its handler declares nothing to undo: order {order.pk} stays as it is" in resume

    uncertain = uncertain_refund(provider, queue, order, key="refund-c")
    mark_failed = words(client.get(desk_url(uncertain, "mark_failed", "refund")).content.decode())
    assert f"so order {order.pk} stays as it is" in mark_failed
    assert checkout_words_in(resume + mark_failed) == []


def test_refund_bulk_query__confirmation_speaks_of_the_refunds(provider, queue, operator):
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    op = uncertain_refund(provider, queue, order)

    response = client_for(operator).post(
        CHANGELIST, {"action": "query_selected", "_selected_action": [op.pk]}
    )

    assert response.status_code == 200
    text = words(response.content.decode())
    assert f"€6.00 refund of order {order.pk}" in text
    assert "Yes, query their systems" in text
    assert checkout_words_in(text) == []


def test_needs_attention__a_refund_s_money_is_never_added_to_a_charge_s(provider, queue, viewer):
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    op = uncertain_refund(provider, queue, order)
    uncertain_refund(provider, queue, order, key="refund-later", amount=1000)
    builders.uncertain(key="charge-in-doubt", charged=False)  # a charge's money in doubt too

    response = client_for(viewer).get(NEEDS_ATTENTION)

    by_state = {row["state"]: row for row in response.context["states"]}
    assert by_state["uncertain"]["totals"] == ["€19.99 checkout", "€16.00 refund"]
    assert "succeeded" not in by_state  # the paid checkout: nothing to do, no figure
    oldest = next(row for row in response.context["oldest"] if row["state"] == "uncertain")
    assert (oldest["oldest"]["operation"], oldest["oldest"]["amount"]) == (
        op,
        f"€6.00 refund of order {order.pk}",
    )
    assert "€41.00" not in response.content.decode()  # the paid charge's and the refunds'
    assert "€35.99" not in response.content.decode()  # the charge in doubt's and the refunds'


# --- a new attempt ----------------------------------------------------------------------------


def test_failed_refund__new_attempt_is_offered_explained_and_asks_the_same_refund(
    provider, queue, senior
):
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    op = failed_refund(provider, queue, order)
    client = client_for(senior)

    page = client.get(change_url(op)).content.decode()
    assert f'href="{desk_url(op, "new_attempt")}"' in page  # offered, not greyed out
    assert "Start a new attempt is unavailable" not in words(page)

    confirm = client.get(desk_url(op, "new_attempt"))
    text = words(confirm.content.decode())
    assert confirm.context["refused"] == ""
    assert "A new refund operation with the new key refund-down attempt 2" in text
    assert f"asks for the same again: €4.00 refund of order {order.pk}" in text
    assert "The old operation stays failed and links to the new one" in text
    assert "A new key sends step refund to the provider anew" in text
    assert 'name="payment_method"' not in confirm.content.decode()  # a refund takes none
    assert checkout_words_in(text) == []

    done = client.post(desk_url(op, "new_attempt"), {"reason": "the provider was down"})

    assert done.status_code == 302
    new = Operation.objects.get(retry_of=op)
    assert (new.kind, new.key, new.params["amount"]) == ("refund", "refund-down attempt 2", 400)
    run_worker(queue)
    new.refresh_from_db()
    order.refresh_from_db()
    assert new.state == OperationState.SUCCEEDED
    assert (order.status, order.refunded_amount) == (OrderStatus.PARTIALLY_REFUNDED, 400)
    assert len(provider.state.refunds(metadata={"order_id": str(order.pk)})) == 1
    again = words(client.get(change_url(op)).content.decode())
    assert f"Start a new attempt is unavailable: a new attempt exists already: {new.key}" in again


GIFT_CARD = "gift_card_test"


def _gift_card_line(op: Operation) -> str:
    return f"{op.params['credits']} gift card credits for customer {op.entity_id}"


@pytest.fixture
def gift_cards(monkeypatch):
    """A kind whose handler declares desk hooks but no new attempt (registered for one test)."""
    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers.registered_handlers()))

    @handler(GIFT_CARD, desk=DeskHooks(lock_entity=lambda op: None, describe=_gift_card_line))
    def issue_gift_card(run: Run) -> None:  # pragma: no cover - never run here
        raise AssertionError("not run in this test")

    return GIFT_CARD


def test_a_kind_without_a_new_attempt__says_so_and_starts_nothing(gift_cards, senior):
    with transaction.atomic():
        op, _ = fence.create_operation_in_tx(
            key="gift-1",
            kind=gift_cards,
            entity_type="customer",
            entity_id=7,
            params={"credits": 12},
            actor="api",
        )
    fence.acquire_lease(op.pk, owner="worker-1/1", seconds=30)
    with transaction.atomic():
        locked = fence.locked_operation_in_tx(op.pk)
        fence.release_in_tx(locked, OperationState.FAILED, actor="worker-1/1", reason="gave up")
    client = client_for(senior)
    why = (
        f"{gift_cards} operations declare no new attempt: a new one is asked for where they "
        "are started (the API, the business's own page)"
    )

    page = words(client.get(change_url(op)).content.decode())
    assert f"Start a new attempt is unavailable: {why}" in page
    assert f'href="{desk_url(op, "new_attempt")}"' not in page

    confirm = client.get(desk_url(op, "new_attempt"))
    assert confirm.context["refused"] == why
    text = words(confirm.content.decode())
    assert why in text and "12 gift card credits for customer 7" in text
    assert 'type="submit" class="default" value="Yes, start a new attempt" disabled' in (
        confirm.content.decode()
    )

    refused = client.post(desk_url(op, "new_attempt"), {"reason": "please"})

    assert refused.status_code == 409
    assert f"Nothing was changed: {why}" in words(refused.content.decode())
    assert not Operation.objects.filter(retry_of=op).exists()


def test_an_uncertain_refund_not_looked_up__its_evidence_speaks_of_a_refund(
    provider, queue, senior
):
    """An operator's try: a pending refund's page read "No payment seen at the provider
    yet": the provider's objects are payments, but this step makes a refund."""
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    op = uncertain_refund(provider, queue, order)

    text = words(client_for(senior).get(change_url(op)).content.decode())

    assert "No refund seen at the provider yet." in text
    assert "No payment seen" not in text


def test_a_refund_pending_at_the_provider__its_page_shows_what_the_provider_showed(
    provider, queue, senior
):
    """An operator walking an incident queried a refund the provider held as pending: the
    provider answered with the refund, pending, and the page still read "No refund seen at
    the provider yet." The pending refund, its status and amount are what it shows now, and
    "mark failed" is off, saying why (it may still succeed)."""
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    provider.state.configure(refund_status="pending")
    op, _ = request_refund(order_id=order.pk, key="refund-pending", amount=600, actor="api")
    run_worker(queue)
    op.refresh_from_db()
    assert op.state == OperationState.UNCERTAIN
    [pending] = provider.state.refunds()
    client = client_for(senior)

    client.post(desk_url(op, "query_provider"))
    text = words(client.get(change_url(op)).content.decode())

    assert "No refund seen at the provider yet." not in text
    assert f"shows {pending['id']} pending, €6.00" in text
    assert "Mark refund failed is unavailable" in text and "may still succeed" in text


def test_retries_refused_before_they_ran__are_no_look_ups(provider, queue, senior):
    """An operator's walk: a refund whose three requests the provider refused before doing
    anything (500s, timeouts to connect) read "1 + 2 look-ups" in the list, on its page
    and in the CSV, and "No lookup recorded" beside it. Nobody looked: a request refused
    before it ran counts neither as an attempt nor as a look-up."""
    order = flows.paid_order(queue, amount=2500, key="paid-first")
    op = failed_refund(provider, queue, order)
    claim = op.claims.get(step="refund")
    assert claim.requests_sent == 0  # none of them could move money

    listed = client_for(senior).get(reverse("admin:payments_operation_changelist"))

    [row] = [o for o in listed.context["cl"].result_list if o.pk == op.pk]
    assert (row.all_attempts, row.lookups) == (1, 0)
    assert "look-up" not in words(listed.content.decode()).split(op.key, 1)[1].split("€", 1)[0]
