"""The desk shows the export as an operation to work that moves no money.

Issue 38's traps: an export with a parent was hidden as a "follow-up" (Needs attention read
"0 Uncertain", the kind filter showed nothing), and its invoice total was counted as money
at stake. The desk reads the system's declaration (`moves_money`), never the export's name.
"""

from __future__ import annotations

import csv
import io

import pytest
from django.urls import reverse

from payments.engine.recovery import reconcile
from payments.models import OperationState
from tests.invoices.conftest import export_of
from tests.support import builders, flows
from tests.support.users import RECONCILE, VIEW, client_for, make_user
from tests.support.workers import run_worker

# Transactional: the checkout and its export run in a worker (a claim commits before its call).
pytestmark = pytest.mark.django_db(transaction=True)

NEEDS_ATTENTION = reverse("admin:payments_operation_needs_attention")
CHANGELIST = reverse("admin:payments_operation_changelist")


def uncertain_export(accounting, queue):
    accounting.state.enqueue_faults("drop_after_commit")
    _, op = flows.order_and_checkout(key="desk-exp")
    run_worker(queue)
    export = export_of(op)
    assert export.state == OperationState.UNCERTAIN
    return export


def test_uncertain_export__under_needs_attention__not_money_at_stake(accounting, queue):
    export = uncertain_export(accounting, queue)
    client = client_for(make_user("vera", *VIEW))

    page = client.get(NEEDS_ATTENTION)

    uncertain = next(r for r in page.context["states"] if r["state"] == OperationState.UNCERTAIN)
    assert uncertain["count"] == 1
    assert uncertain["totals"] == ["-"]  # an invoice's total moves no money
    assert [r["operation"].key for r in page.context["cases"].rows] == [export.key]
    assert page.context["follow_ups_open"] == 0  # the ledger line and counter succeeded


def test_export_kind__listed_by_the_kind_filter_and_by_default(accounting, queue):
    export = uncertain_export(accounting, queue)
    client = client_for(make_user("vera", *VIEW))

    by_kind = client.get(CHANGELIST, {"kind": "invoice_export"})
    default = client.get(CHANGELIST)

    assert [op.key for op in by_kind.context["cl"].result_list] == [export.key]
    assert export.key in [op.key for op in default.context["cl"].result_list]
    # The local follow-ups (ledger line, sales counter) stay hidden by default.
    assert {op.kind for op in default.context["cl"].result_list} == {"checkout", "invoice_export"}
    exported = client.get(f"{CHANGELIST}export.csv", {"kind": "invoice_export"})
    rows = list(csv.DictReader(io.StringIO(b"".join(exported.streaming_content).decode())))
    assert [(r["key"], r["follow_up"]) for r in rows] == [(export.key, "")]


def test_export_page__its_steps_and_the_invoice_reference(accounting, queue):
    export = uncertain_export(accounting, queue)
    reconcile()  # the same-key replay answers the stored 201
    run_worker(queue)
    export.refresh_from_db()
    client = client_for(make_user("vera", *VIEW))

    page = client.get(reverse("admin:payments_operation_change", args=[export.pk]))

    assert page.status_code == 200
    (invoice,) = accounting.state.invoices()
    assert invoice["id"] in page.content.decode()
    assert "invoice of order" in page.content.decode()  # its own words, not a charge
    found = client.get(CHANGELIST, {"q": invoice["id"]})
    assert [op.key for op in found.context["cl"].result_list] == [export.key]


def test_export_evidence__in_the_accounting_systems_words(accounting, queue):
    accounting.state.enqueue_faults("hold")  # the first request held: its key in flight
    _, op = flows.order_and_checkout(key="desk-held")
    run_worker(queue)
    export = export_of(op)
    client = client_for(make_user("vera", *VIEW))
    url = reverse("admin:payments_operation_change", args=[export.pk])

    before = client.get(url).content.decode()
    reconcile()  # a 409 for the replay, and a list that shows no invoice yet
    after = client.get(url).content.decode()
    accounting.state.release()

    assert "No invoice seen at the accounting system yet." in before
    assert "The accounting system&#x27;s consistent list at" in after
    assert "shows no invoice for it" in after


def test_export_page__its_look_up_button_names_the_accounting_system(accounting, queue):
    """The button and the refusal of "mark failed" said "the provider" for every system."""
    export = uncertain_export(accounting, queue)
    client = client_for(make_user("rita", *VIEW, RECONCILE))

    page = client.get(reverse("admin:payments_operation_change", args=[export.pk])).content
    mark_failed = client.get(
        reverse("admin:payments_operation_desk_step", args=[export.pk, "export", "mark_failed"])
    ).content.decode()

    assert "Query the accounting system now" in page.decode()
    # It moves no money: its line is not headed "Amount" (an outsider's catch).
    assert '<th scope="row">What</th>' in mark_failed
    assert '<th scope="row">Amount</th>' not in mark_failed
    assert "Query the provider now" not in page.decode()
    assert "nobody has asked the accounting system about step export" in mark_failed


@pytest.mark.parametrize("how", ["button", "bulk"])
def test_export_queried__the_report_names_the_accounting_system_not_the_provider(
    accounting, queue, how
):
    """An outsider's catch: "Queried LabelCo: the provider shows the step succeeded"."""
    export = uncertain_export(accounting, queue)
    client = client_for(make_user("rita", *VIEW, RECONCILE))
    if how == "button":
        url = reverse("admin:payments_operation_desk", args=[export.pk, "query_provider"])
        done = client.post(url, follow=True)
    else:
        selection = {"action": "query_selected", "_selected_action": [export.pk], "post": "yes"}
        done = client.post(CHANGELIST, selection, follow=True)

    report = done.content.decode().split('class="messagelist"', 1)[1].split("</ul>", 1)[0]
    assert "the accounting system shows the step succeeded" in report
    assert "the provider" not in report


def test_refused_export__resume_points_where_a_new_one_is_asked_not_at_a_missing_button(
    accounting, queue, monkeypatch
):
    """The export declares no new attempt: "start a new attempt instead" sent the operator
    to a button the same page refuses (a dead end). It says where a new one comes from."""
    from payments.desk.rules import available_actions
    from payments.invoices.effect import ExportInvoice

    real_request = ExportInvoice.request
    monkeypatch.setattr(
        ExportInvoice, "request", lambda self: {**real_request(self), "currency": "euro"}
    )
    _, op = flows.order_and_checkout(key="desk-exp-refused")
    run_worker(queue)
    export = export_of(op)
    assert export.state == OperationState.FAILED  # the API's 400: refused for good

    refused = available_actions(export).refused

    assert "declare no new attempt" in refused["new_attempt"]
    assert "start a new attempt instead" not in refused["resume"]
    assert "where it is started" in refused["resume"], refused["resume"]


def test_export_under_review__mark_failed_is_not_said_to_cancel_what_cannot_be_called_back(
    accounting, queue
):
    """The desk told the operator that marking the export failed "cancels what the
    accounting system holds": an invoice cannot be called back (its effect voids nothing)."""
    from payments.desk.evidence import evidence_html

    export = uncertain_export(accounting, queue)
    builders.move(export, OperationState.NEEDS_REVIEW, reason="not found")
    export.refresh_from_db()

    shown = str(evidence_html(export))

    assert "Under review for want of a decisive answer" in shown
    assert "cancels" not in shown
    assert "the accounting system cannot call it back" in shown
    assert "the the " not in shown


def test_mark_failed_words__name_the_accounting_system_not_the_provider():
    """A review's catch: the reasons mark failed records said "at the provider" for any
    system (the audit row and the step's error of an export marked failed)."""
    from payments.desk.services import _voided
    from payments.engine.effects import EffectResult
    from payments.engine.outcomes import Outcome
    from payments.engine.systems import system_named

    accounting = system_named("accounting")
    seen = EffectResult(Outcome.PERMANENT, reference="inv_9", data={"status": "voided"})

    assert _voided(None, accounting) == (
        "not at the accounting system, past the grace since the last request"
    )
    assert _voided(seen, accounting) == "inv_9 voided at the accounting system"
