"""What the operators' screens show: money, the provider's view, ages, lists, forms, 403, index.

Inside one test transaction (no worker runs): real PostgreSQL, the real HTTP
fake provider behind the desk. Each test names the finding of issue 11 it
asserts.
"""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from payments.checkout.followups import write_follow_ups_in_tx
from payments.checkout.handler import request_checkout
from payments.checkout.orders import create_order
from payments.engine import fence
from payments.engine.effects import EffectResult
from payments.engine.outcomes import Outcome
from payments.engine.writes import fence_writes
from payments.models import FenceAuditRun, Operation, OperationEvent, OperationState, StepClaim
from payments.money import decimal_amount, format_money
from payments.shop.models import Invoice
from tests.support import builders
from tests.support.builders import order_of
from tests.support.users import RECONCILE, VIEW, client_for, make_user

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/payments/operation/"
NEEDS_ATTENTION = "/admin/payments/operation/needs-attention/"
EXPORT = "/admin/payments/operation/export.csv"
DASHBOARD = "https://dashboard.example/payments/{reference}"
#: Django's default English date format ("Nov. 30, 2026, 8:41 p.m."): never on a desk page.
DJANGO_DATE = re.compile(r"\b[A-Z][a-z]{2,8}\.? \d{1,2}, \d{4}|\b[ap]\.m\.")
DESK_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC\b")


def change_url(op: Operation) -> str:
    return reverse("admin:payments_operation_change", args=[op.pk])


def desk_url(op: Operation, action: str, step: str = "") -> str:
    if step:
        return reverse("admin:payments_operation_desk_step", args=[op.pk, step, action])
    return reverse("admin:payments_operation_desk", args=[op.pk, action])


def checkout_in(currency: str, amount: int, key: str, email: str = "buyer@example.com"):
    order = create_order(amount=amount, currency=currency, email=email)
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="api")
    return op


def with_follow_ups(op: Operation, reference: str = "pi_follow") -> list[Operation]:
    """The paid order's ledger and counter operations, as mark_paid writes them."""
    with transaction.atomic():
        write_follow_ups_in_tx(order_of(op), reference, parent=op, actor="checkout")
    return list(Operation.objects.filter(parent=op).order_by("pk"))


def result_keys(page: str) -> list[str]:
    """The operation keys listed in the changelist's table, in order."""
    if 'id="result_list"' not in page:
        return []  # no table at all: nothing found
    table = page.split('id="result_list"', 1)[1].split("</table>", 1)[0]
    return re.findall(r'<th class="field-key"><a href="[^"]+">([^<]+)</a>', table)


def age_state(op: Operation, minutes: int) -> None:
    with fence_writes():  # hand-made state, as the test says
        OperationEvent.objects.filter(operation=op, step="", to_state=op.state).update(
            created_at=timezone.now() - timedelta(minutes=minutes)
        )


def stale_running(key: str) -> Operation:
    """A worker took the lease, then died: running, its lease run out 10 minutes ago."""
    op = builders.new_checkout(key)
    fence.acquire_lease(op.pk, owner="worker-9/99", seconds=30)
    with fence_writes():  # hand-made state, as the test says
        Operation.objects.filter(pk=op.pk).update(
            lease_expires_at=timezone.now() - timedelta(minutes=10)
        )
    op.refresh_from_db()
    return op


# --- money ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amount, currency, shown, plain",
    [
        (5000, "jpy", "¥5,000", "5000"),
        (4999, "eur", "€49.99", "49.99"),
        (4999, "EUR", "€49.99", "49.99"),
        (1234, "kwd", "KWD1.234", "1.234"),
        (None, "eur", "-", ""),
        (100, "", "-", ""),
    ],
)
def test_money__by_the_currency_s_own_exponent(amount, currency, shown, plain):
    assert format_money(amount, currency) == shown
    assert decimal_amount(amount, currency) == plain


def test_money__amount_column_on_operations_orders_and_invoices(provider, viewer):
    yen = checkout_in("jpy", 5000, "yen-order")
    euro, _ = builders.succeeded(key="euro-order")  # 19.99 EUR, invoiced
    Invoice.objects.create(
        order=order_of(yen),
        number="INV-YEN",
        amount=5000,
        currency="jpy",
        provider_reference="pi_y",
    )
    client = client_for(viewer)

    operations = client.get(CHANGELIST).content.decode()
    orders = client.get(reverse("admin:shop_order_changelist")).content.decode()
    invoices = client.get(reverse("admin:shop_invoice_changelist")).content.decode()
    page = client.get(change_url(yen)).content.decode()

    for listing in (operations, orders, invoices):
        assert "¥5,000" in listing and "50.00" not in listing
    assert "€19.99" in operations and "€19.99" in orders
    assert '<td class="field-amount">¥5,000</td>' in operations
    assert "¥5,000" in page  # and on the operation's own page
    assert "4999" not in invoices and "5000" not in invoices


def test_money__needs_attention_totals_per_state_without_follow_ups(provider, viewer, queue):
    builders.uncertain(key="u1", charged=False)
    builders.uncertain(key="u2", charged=False)
    checkout_in("jpy", 5000, "yen-pending")
    paid, _ = builders.succeeded(key="paid")
    with_follow_ups(paid)  # two follow-ups with the same amount: not money at stake

    response = client_for(viewer).get(NEEDS_ATTENTION)

    by_state = {row["state"]: row for row in response.context["states"]}
    # Each total names its kind (checkout, refund, capture are registered), whichever are open.
    assert (by_state["uncertain"]["count"], by_state["uncertain"]["total"]) == (
        2,
        "€39.98 checkout",
    )
    assert (by_state["pending"]["count"], by_state["pending"]["total"]) == (1, "¥5,000 checkout")
    assert "succeeded" not in by_state  # done: no money at stake, no figure
    assert by_state["failed"]["total"] == "-"
    page = response.content.decode()
    assert "€39.98" in page and "¥5,000" in page
    assert response.context["follow_ups_open"] == 2


def test_failed_with_a_new_attempt__its_money_is_the_attempts_not_the_failed_tiles(
    provider, viewer, queue
):
    """An operator's walk: the Failed tile kept €333.00 "at stake" after the refund's new
    attempt had succeeded. A failed operation with a new attempt is still counted failed,
    but its money is the attempt's, in the attempt's own state; the tile says so."""
    declined, _ = builders.declined(key="card-declined")
    retried, _ = builders.declined(key="declined-then-paid")
    attempt, _ = request_checkout(  # the declined order is open for a new attempt
        order_id=order_of(retried).pk, key="second-card", payment_method="pm_card_visa", actor="api"
    )
    assert attempt.retry_of_id == retried.pk
    builders.move(attempt, OperationState.SUCCEEDED)

    response = client_for(viewer).get(NEEDS_ATTENTION)

    failed = {row["state"]: row for row in response.context["states"]}["failed"]
    assert failed["count"] == 2  # both failed
    assert failed["totals"] == ["€19.99 checkout", "1 retried: its money under its attempt"]


def test_follow_ups_not_succeeded__the_link_lists_those_it_counts(provider, viewer, queue):
    """Needs attention's "N not succeeded" link opens a list of those N: the succeeded
    follow-ups of an earlier order, and the checkouts, are not in it."""
    earlier, _ = builders.succeeded(key="paid-earlier")
    done = with_follow_ups(earlier, reference="pi_earlier")
    paid, _ = builders.succeeded(key="paid-now")
    waiting, failed = with_follow_ups(paid, reference="pi_now")
    with fence_writes():  # hand-made states, as the test says
        succeeded = Operation.objects.filter(pk__in=[op.pk for op in done])
        succeeded.update(state=OperationState.SUCCEEDED)
        Operation.objects.filter(pk=failed.pk).update(state=OperationState.FAILED)
    client = client_for(viewer)

    attention = client.get(NEEDS_ATTENTION)
    listed = client.get(attention.context["follow_ups_url"])

    assert attention.context["follow_ups_open"] == 2
    assert sorted(result_keys(listed.content.decode())) == sorted([waiting.key, failed.key])
    assert listed.context["cl"].result_count == 2


# --- the provider beside us ------------------------------------------------------------


def test_operation_page__shows_what_the_provider_showed_with_a_dashboard_link(
    provider, viewer, settings
):
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_DASHBOARD_URL": DASHBOARD}
    op, claim, reference = builders.uncertain(key="seen-at-provider", charged=True)
    found = EffectResult(
        Outcome.SUCCESS,
        reference=reference,
        data={"status": "succeeded", "amount": 1999, "currency": "eur"},
    )
    fence.note_provider_view(claim, found, source="fence_audit")

    page = client_for(viewer).get(change_url(op)).content.decode()

    view = page.split('class="desk-table desk-stack desk-provider-view"', 1)[1].split(
        "</table>", 1
    )[0]
    assert "succeeded" in view and "€19.99" in view and "fence_audit" in view
    assert reference in view
    assert f'href="https://dashboard.example/payments/{reference}"' in view
    assert DESK_DATE.search(view)  # when it was checked, in the desk's one format
    assert "≠ ours" not in view  # the provider's amount is ours


def test_operation_page__provider_view_flags_another_amount_and_not_found(provider, viewer):
    op, claim, reference = builders.uncertain(key="odd-amount", charged=True)
    found = EffectResult(
        Outcome.SUCCESS,
        reference=reference,
        data={"status": "succeeded", "amount": 2999, "currency": "eur"},
    )
    fence.note_provider_view(claim, found, source="query")
    other, other_claim, _ = builders.uncertain(key="nothing-there", charged=False)
    fence.note_provider_view(other_claim, None, source="reconciler")
    client = client_for(viewer)

    odd = client.get(change_url(op)).content.decode()
    missing = client.get(change_url(other)).content.decode()

    assert "€29.99" in odd and "≠ ours" in odd
    assert "dashboard.example" not in odd  # no PROVIDER_DASHBOARD_URL: no link
    assert "not found" in missing and "reconciler" in missing


def test_operation_page__says_when_the_provider_was_not_asked_yet(provider, viewer):
    op, _, _ = builders.uncertain(key="never-asked", charged=False)
    page = client_for(viewer).get(change_url(op)).content.decode()
    assert "Not looked up yet" in page


# --- age and staleness -------------------------------------------------------------------


def test_age__shown_for_every_unfinished_state_on_the_list_and_page(provider, viewer):
    pending = builders.new_checkout("waiting")
    retrying = builders.move(builders.new_checkout("again"), OperationState.RETRYING)
    age_state(pending, 12)
    age_state(retrying, 125)
    client = client_for(viewer)

    listing = client.get(CHANGELIST).content.decode()
    page = client.get(change_url(pending)).content.decode()

    assert "12\xa0minutes" in listing and "2\xa0hours, 5\xa0minutes" in listing
    assert "12\xa0minutes" in page


def test_stale__running_with_an_expired_lease_is_badged_and_filterable(provider, viewer):
    stale = stale_running("worker-died")
    live = builders.new_checkout("worker-alive")
    fence.acquire_lease(live.pk, owner="worker-1/1", seconds=600)
    client = client_for(viewer)

    listing = client.get(CHANGELIST).content.decode()
    filtered = client.get(CHANGELIST, {"lease": "stale"}).content.decode()
    page = client.get(change_url(stale)).content.decode()
    attention = client.get(NEEDS_ATTENTION)

    assert listing.count('class="desk-stale-badge"') == 1
    assert result_keys(filtered) == ["worker-died"]
    assert 'class="desk-stale-badge"' in page and "worker-9/99" in page
    assert attention.context["stale_count"] == 1


def test_attempts_count_requests_sent_and_lookups_apart__last_error_from_the_audit_trail(
    provider, viewer
):
    op, claim, _ = builders.uncertain(key="tried-thrice", charged=False)
    with fence_writes():  # hand-made state, as the test says
        StepClaim.objects.filter(pk=claim.pk).update(attempts=3)
    builders.move(op, OperationState.NEEDS_REVIEW, reason="not found after the grace period")
    op.refresh_from_db()
    assert (op.attempts, op.last_error) == (0, "")

    client = client_for(viewer)
    listing = client.get(CHANGELIST).content.decode()
    page = client.get(change_url(op)).content.decode()

    # Three take-overs of a claim whose request was sent once: one attempt, two look-ups.
    assert re.search(
        r'<td class="field-attempts_shown">1 <small[^>]*>\+&nbsp;2&nbsp;look-ups', listing
    )
    assert re.search(r'field-attempts_shown.*?<div class="readonly">1 <small', page, re.S)
    last_error = re.search(
        r'field-last_error_shown.*?<div class="readonly">(.*?)</div>', page, re.S
    )
    assert "not found after the grace period" in last_error.group(1)


# --- lists ---------------------------------------------------------------------------------


def test_search__operations_by_customer_email_needs_the_order_permission(provider, viewer):
    checkout_in("eur", 1000, "carol-checkout", email="Carol@Example.com")
    builders.new_checkout("someone-else")
    only_operations = make_user("oscar", "payments.view_operation")

    found = client_for(viewer).get(CHANGELIST, {"q": "carol@example.com"}).content.decode()
    hidden = client_for(only_operations).get(CHANGELIST, {"q": "carol@example.com"})

    assert result_keys(found) == ["carol-checkout"]
    assert result_keys(hidden.content.decode()) == []


@pytest.mark.parametrize("term", ["key", "order_id", "reference"])
def test_search__operations_by_key_order_id_and_reference(provider, viewer, term):
    op, claim = builders.succeeded(key="find-me-please")
    builders.succeeded(key="not-me")
    value = {
        "key": "find-me-please",
        "order_id": op.entity_id,
        "reference": claim.provider_reference,
    }

    page = client_for(viewer).get(CHANGELIST, {"q": value[term]}).content.decode()

    assert result_keys(page) == ["find-me-please"]


def test_search__orders_by_id_and_email(provider, viewer):
    carol = create_order(amount=1000, currency="eur", email="carol@example.com")
    dave = create_order(amount=2000, currency="eur", email="dave@example.com")
    url = reverse("admin:shop_order_changelist")
    client = client_for(viewer)

    by_email = client.get(url, {"q": "CAROL@example.com"}).content.decode()
    by_id = client.get(url, {"q": str(dave.pk)}).content.decode()

    assert reverse("admin:shop_order_change", args=[carol.pk]) in by_email
    assert reverse("admin:shop_order_change", args=[dave.pk]) not in by_email
    assert reverse("admin:shop_order_change", args=[dave.pk]) in by_id
    assert "carol@example.com" not in by_email.split('id="result_list"', 1)[1]  # not listed


def test_follow_ups__hidden_by_default_with_a_filter_to_show_them(provider, viewer):
    op, _ = builders.succeeded(key="paid-order")
    follow_ups = with_follow_ups(op)
    assert len(follow_ups) == 2
    client = client_for(viewer)

    default = result_keys(client.get(CHANGELIST).content.decode())
    shown = result_keys(client.get(CHANGELIST, {"followups": "all"}).content.decode())
    only = result_keys(client.get(CHANGELIST, {"followups": "only"}).content.decode())
    by_kind = result_keys(client.get(CHANGELIST, {"kind": "record_sale"}).content.decode())

    assert default == ["paid-order"]
    assert set(shown) == {"paid-order", *(f.key for f in follow_ups)}
    assert set(only) == {f.key for f in follow_ups}
    assert by_kind == [next(f.key for f in follow_ups if f.kind == "record_sale")]


def test_follow_ups__not_counted_in_the_headline_figures(provider, viewer, queue):
    op, _ = builders.succeeded(key="paid-order")
    with_follow_ups(op)  # two pending follow-ups

    response = client_for(viewer).get(NEEDS_ATTENTION)
    index = client_for(viewer).get(reverse("admin:index"))

    counts = {row["state"]: row["count"] for row in response.context["states"]}
    assert counts["pending"] == 0 and "succeeded" not in counts
    assert {r["state"]: r["count"] for r in index.context["desk_counts"]}["pending"] == 0


def test_dates__one_format_on_every_desk_page(provider, viewer, queue):
    op, _ = builders.failed_after_charge(key="dated")
    FenceAuditRun.objects.create(
        started_at=timezone.now(),
        finished_at=timezone.now(),
        window_start=timezone.now() - timedelta(days=1),
        exit_code=0,
        summary={"clean": True},
    )
    order = order_of(op)
    client = client_for(viewer)
    pages = {
        "list": client.get(CHANGELIST),
        "operation": client.get(change_url(op)),
        "needs attention": client.get(NEEDS_ATTENTION),
        "order": client.get(reverse("admin:shop_order_change", args=[order.pk])),
        "orders": client.get(reverse("admin:shop_order_changelist")),
    }

    for name, response in pages.items():
        page = response.content.decode()
        assert DJANGO_DATE.search(page) is None, name
        assert DESK_DATE.search(page), name


def test_bulk_query__lists_the_result_of_each_operation(provider, operator):
    first, _, _ = builders.uncertain(key="bulk-a", charged=True)
    second, _, _ = builders.uncertain(key="bulk-b", charged=True, pm="pm_card_chargeDeclined")
    selection = {"action": "query_selected", "_selected_action": [first.pk, second.pk]}

    response = client_for(operator).post(CHANGELIST, {**selection, "post": "yes"}, follow=True)

    page = response.content.decode()
    report = page.split('class="desk-query-report"', 1)[1].split("</ul>", 1)[0]
    rows = re.findall(r'<li class="desk-query-row[^"]*">(.*?)</li>', report, re.S)
    assert len(rows) == 2
    first_row, second_row = sorted(rows, key=lambda row: "bulk-b" in row)
    assert "bulk-a</a>: the provider shows the step succeeded" in first_row
    assert "state-retrying" in first_row
    assert "bulk-b</a>: the provider refused the step" in second_row
    assert "state-failed" in second_row


def test_csv_export__the_filtered_list(provider, viewer):
    builders.uncertain(key="=HYPERLINK(1)", charged=False)
    checkout_in("jpy", 5000, "yen-pending")
    builders.succeeded(key="done-already")
    client = client_for(viewer)

    listing = client.get(CHANGELIST, {"state__exact": "uncertain"}).content.decode()
    assert f"{EXPORT}?state__exact=uncertain" in listing  # the link keeps the filters
    response = client.get(EXPORT, {"state__exact": "uncertain"})
    everything = client.get(EXPORT)

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    assert "attachment" in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert [r["key"] for r in rows] == ["'=HYPERLINK(1)"]  # not a formula in a spreadsheet
    assert (rows[0]["amount"], rows[0]["currency"], rows[0]["state"]) == (
        "19.99",
        "EUR",
        "uncertain",
    )
    assert rows[0]["attempts"] == "1" and "customer_email" not in rows[0]
    all_rows = list(csv.DictReader(io.StringIO(b"".join(everything.streaming_content).decode())))
    yen = next(r for r in all_rows if r["key"] == "yen-pending")
    assert (yen["amount"], yen["currency"]) == ("5000", "JPY")
    assert len(all_rows) == 3


def test_csv_export__needs_view_permission(db):
    nobody = make_user("nobody")
    response = client_for(nobody).get(EXPORT)
    assert response.status_code == 403
    assert "payments.view_operation" in response.content.decode()


# --- forms ---------------------------------------------------------------------------------


def test_form__a_refused_action_keeps_what_was_typed(provider, operator):
    op, claim, _ = builders.uncertain(key="keep-my-words", charged=True)
    typed = {
        "reference": "pi_0000000000000000000000000000000000",
        "reason": "seen on the dashboard",
    }

    response = client_for(operator).post(desk_url(op, "mark_succeeded", "charge"), typed)

    page = response.content.decode()
    assert response.status_code == 409  # no redirect: the form comes back
    assert "Nothing was changed" in page
    assert 'value="pi_0000000000000000000000000000000000"' in page
    assert re.search(r"<textarea[^>]*>\s*seen on the dashboard</textarea>", page)
    claim.refresh_from_db()
    assert claim.provider_reference == ""


def test_form__the_reference_field_fits_a_pi_id(provider, operator):
    op, _, _ = builders.uncertain(key="wide-field", charged=True)

    page = client_for(operator).get(desk_url(op, "mark_succeeded", "charge")).content.decode()

    field = re.search(r'<input[^>]*name="reference"[^>]*>', page).group(0)
    width = int(re.search(r"width: (\d+)ch", field).group(1))
    assert width >= 40 and 'size="48"' in field


# --- 403 ----------------------------------------------------------------------------------


def test_403__styled_and_names_the_missing_permission(provider, viewer):
    op, _, _ = builders.uncertain(key="not-yours", charged=True)
    nobody = make_user("nobody")
    reconciler = make_user("rita", *VIEW, RECONCILE)

    action = client_for(viewer).get(desk_url(op, "resume"))
    new_attempt = client_for(reconciler).get(desk_url(op, "new_attempt"))
    listing = client_for(nobody).get(CHANGELIST)
    attention = client_for(nobody).get(NEEDS_ATTENTION)
    edit = client_for(viewer).post(change_url(op), {"state": "succeeded"})

    assert action.status_code == 403
    assert "payments.reconcile_operation" in action.content.decode()
    assert "payments.start_new_attempt" in new_attempt.content.decode()
    assert "payments.view_operation" in listing.content.decode()
    assert "payments.view_operation" in attention.content.decode()
    assert edit.status_code == 403 and "nobody edits operations" in edit.content.decode()
    page = action.content.decode()
    assert "You may not open this page (403)" in page
    assert 'id="header"' in page  # the admin's own frame, not Django's bare page


# --- the admin index -------------------------------------------------------------------------


def test_index__shows_the_desk_above_the_apps_with_counts(provider, viewer):
    builders.uncertain(key="u1", charged=False)
    builders.uncertain(key="u2", charged=False)
    stale_running("stuck")
    nobody_else = make_user("inez", "shop.view_order")

    response = client_for(viewer).get(reverse("admin:index"))
    other = client_for(nobody_else).get(reverse("admin:index")).content.decode()

    page = response.content.decode()
    main = page.split('id="content-main"', 1)[1].split('id="content-related"', 1)[0]
    assert 'id="payments-desk-module"' in main  # in the main column, not under Recent actions
    assert main.index("payments-desk-module") < main.index("app-payments")
    counts = {r["state"]: r["count"] for r in response.context["desk_counts"]}
    assert (counts["uncertain"], counts["running"], counts["stale"]) == (2, 1, 1)
    assert f"{CHANGELIST}?state__exact=uncertain" in main
    assert "payments-desk-module" not in other


def test_admin_site__is_the_desks_own_subclass_not_the_global_one_patched():
    """STYLE.md 27: the desk's home page and layout come from an AdminSite subclass (the
    project's default site), never from attributes assigned to Django's own instance."""
    from django.contrib import admin
    from django.contrib.admin.sites import AdminSite

    from payments.desk.site import DeskAdminSite

    assert type(admin.site._wrapped) is DeskAdminSite
    assert not {"index", "index_template", "enable_nav_sidebar"} & set(vars(admin.site._wrapped))
    assert (DeskAdminSite.index_template, DeskAdminSite.enable_nav_sidebar) == (
        "admin/payments/index.html",
        False,
    )
    assert (AdminSite.index_template, AdminSite.enable_nav_sidebar) == (None, True)


# --- the last fence audit ---------------------------------------------------------------------


def test_needs_attention__renders_the_audit_as_tables_with_links(provider, viewer, queue, settings):
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_DASHBOARD_URL": DASHBOARD}
    first, _ = builders.succeeded(key="charged-once")
    second = builders.move(builders.new_checkout(key="charged-again"), OperationState.FAILED)
    order = order_of(first)
    FenceAuditRun.objects.create(
        started_at=timezone.now(),
        finished_at=timezone.now(),
        window_start=timezone.now() - timedelta(days=1),
        exit_code=1,
        summary={
            "clean": False,
            "findings": 3,
            "provider_successes": 4,
            "done_claims": 2,
            "double_charges": [
                {"operation_key": "charged-once", "step": "charge", "references": ["pi_a", "pi_b"]}
            ],
            "unfenced": ["pi_c"],
            "unknown_references": [],
            "stale_uncertain": ["charged-again/charge"],
            "steps": {"pi_a": "charged-once/charge", "pi_c": "charged-again/charge"},
            "double_charged_entities": [
                {
                    "entity_type": "order",
                    "entity_id": str(order.pk),
                    "references": ["pi_a", "pi_c"],
                    "operations": ["charged-once", "charged-again"],
                }
            ],
        },
    )

    page = client_for(viewer).get(NEEDS_ATTENTION).content.decode()

    audit = page.split('id="desk-audit"', 1)[1]
    assert "{'" not in audit and "[{" not in audit  # no Python or JSON literals
    double = audit.split('id="audit-double-charges"', 1)[1].split("</table>", 1)[0]
    assert f'href="{change_url(first)}">charged-once</a>' in double
    assert 'href="https://dashboard.example/payments/pi_b"' in double
    entities = audit.split('id="audit-double-charged-entities"', 1)[1].split("</table>", 1)[0]
    order_url = reverse("admin:shop_order_change", args=[order.pk])
    assert f'href="{order_url}">Order {order.pk}</a>' in entities
    assert f'href="{change_url(second)}">charged-again</a>' in entities
    unfenced = audit.split('id="audit-unfenced"', 1)[1].split("</table>", 1)[0]
    assert "pi_c" in unfenced and f'href="{change_url(second)}">charged-again</a>' in unfenced
    stale = audit.split('id="audit-stale"', 1)[1].split("</table>", 1)[0]
    assert "charged-again" in stale and '<td data-label="step">charge</td>' in stale
    assert "Double charges per order: 1" in audit and "Provider successes" in audit
