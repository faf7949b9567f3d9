"""The last fence audit's box says which of its findings are settled now (issue 37, finding 8).

An audit is a snapshot: its findings stayed red on Needs attention after every one of them
was settled. The box now shows, per finding, what the fence holds now, only what is still
open in red, and how many are settled since the audit.

Inside one test transaction (no worker runs): real PostgreSQL, the real HTTP fake provider.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from payments.desk import services as desk
from payments.desk.display import when
from payments.engine import fence
from payments.models import ClaimState, FenceAuditRun, StepClaim
from tests.support import builders
from tests.support.users import client_for

pytestmark = pytest.mark.django_db

NEEDS_ATTENTION = reverse("admin:payments_operation_needs_attention")
RED = "#b02a37"


def audit_run(**summary: Any) -> FenceAuditRun:
    """A fence audit that found `summary`'s findings (exit 1), a few minutes ago."""
    finished = timezone.now() - timedelta(minutes=5)
    return FenceAuditRun.objects.create(
        started_at=finished - timedelta(seconds=3),
        finished_at=finished,
        window_start=finished - timedelta(days=1),
        exit_code=1,
        summary={"clean": False, **summary},
    )


def audit_box(client) -> str:
    page = client.get(NEEDS_ATTENTION).content.decode()
    return page.split('id="desk-audit"', 1)[1]


def table(box: str, table_id: str) -> str:
    return box.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]


def title(box: str, table_id: str) -> str:
    found = re.search(rf'<h3[^>]*id="{table_id}-title"[^>]*>', box)
    assert found is not None, table_id
    return found.group(0)


def rows(html: str) -> list[str]:
    return html.split("<tbody>", 1)[1].split("<tr")[1:]


def words(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def result_row(box: str) -> str:
    return box.split("Result</th>", 1)[1].split("</tr>", 1)[0]


@pytest.fixture
def lost_answer(provider):
    """An uncertain charge the provider took; the audit found it unfenced and stale."""
    op, claim, reference = builders.uncertain(key="lost-answer", charged=True)
    run = audit_run(
        findings=2,
        unfenced=[reference],
        stale_uncertain=["lost-answer/charge"],
        steps={reference: "lost-answer/charge"},
        counts={"unfenced": 1, "stale_uncertain": 1},
    )
    return op, claim, reference, run


def test_audit_box__findings_settled_since__not_red_and_counted(
    lost_answer, operator, viewer, queue
):
    op, claim, reference, run = lost_answer
    desk.query_provider([op.pk], user=operator)  # the reconciler records the charge done
    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)

    box = audit_box(client_for(viewer))

    assert (
        f"2 of 2 findings settled since the audit at {when(run.finished_at)}; "
        "run fence_audit again to confirm"
    ) in words(box)
    assert not re.search(r"<h3[^>]*desk-audit-finding", box)  # no title red
    assert 'class="desk-audit-open"' not in box  # no row red
    assert RED not in result_row(box)
    [unfenced] = rows(table(box, "audit-unfenced"))
    assert "desk-audit-settled" in unfenced and "lost-answer/charge" in words(unfenced)
    [stale] = rows(table(box, "audit-stale"))
    assert "desk-audit-settled" in stale and "Done" in words(stale)


def test_audit_box__findings_still_open__red_and_none_settled(lost_answer, viewer, queue):
    box = audit_box(client_for(viewer))

    assert "0 of 2 findings settled since the audit" in words(box)
    assert "desk-audit-finding" in title(box, "audit-unfenced")
    assert "desk-audit-finding" in title(box, "audit-stale")
    [stale] = rows(table(box, "audit-stale"))
    assert "desk-audit-open" in stale and "still uncertain" in words(stale)
    assert RED in result_row(box)


def test_audit_box__one_settled_one_open__only_the_open_one_red(provider, viewer, queue):
    settled, claim, _ = builders.uncertain(key="settled-since", charged=False)
    fence.settle_claim(
        claim, ClaimState.FAILED, actor=builders.WORKER, error="refused: card_declined"
    )
    builders.uncertain(key="still-lost", charged=False)
    audit_run(
        findings=2,
        stale_uncertain=["settled-since/charge", "still-lost/charge"],
        counts={"stale_uncertain": 2},
    )

    box = audit_box(client_for(viewer))

    assert "1 of 2 findings settled since the audit" in words(box)
    first, second = rows(table(box, "audit-stale"))
    assert "desk-audit-settled" in first and "desk-audit-open" not in first
    assert "desk-audit-open" in second
    assert "desk-audit-finding" in title(box, "audit-stale")
    assert RED in result_row(box)


def test_audit_box__findings_the_audit_did_not_list_count_as_open(
    lost_answer, operator, viewer, queue
):
    op, *_ = lost_answer
    run = FenceAuditRun.objects.get()
    run.summary = {**run.summary, "findings": 7, "counts": {"unfenced": 6, "stale_uncertain": 1}}
    run.save()
    desk.query_provider([op.pk], user=operator)

    box = audit_box(client_for(viewer))

    assert "2 of 7 findings settled since the audit" in words(box)
    assert "desk-audit-finding" in title(box, "audit-unfenced")  # 5 not shown, not known settled
    assert "desk-audit-finding" not in title(box, "audit-stale")


def test_audit_box__a_done_claim_the_provider_did_not_show_stays_open(provider, viewer, queue):
    op, claim = builders.succeeded(key="paid-once")
    audit_run(
        findings=1,
        unknown_references=[claim.provider_reference],
        steps={claim.provider_reference: "paid-once/charge"},
        counts={"unknown_references": 1},
    )

    box = audit_box(client_for(viewer))

    [row] = rows(table(box, "audit-unknown"))
    assert "desk-audit-open" in row
    assert "0 of 1 findings settled" in words(box)


def test_audit_box__a_double_charge_stays_open_until_a_new_audit(provider, viewer, queue):
    """The desk cannot tell a double charge is settled: the money went out twice."""
    op, claim = builders.succeeded(key="charged-once")
    audit_run(
        findings=1,
        double_charges=[
            {"operation_key": "charged-once", "step": "charge", "references": ["pi_a", "pi_b"]}
        ],
        counts={"double_charges": 1},
    )

    box = audit_box(client_for(viewer))

    assert "desk-audit-finding" in title(box, "audit-double-charges")
    assert "0 of 1 findings settled" in words(box)


def test_audit_box__an_unfenced_refund_now_carried_by_a_claim__settled(provider, viewer, queue):
    op, claim = builders.succeeded(key="refund-carried")
    assert StepClaim.objects.filter(provider_reference=claim.provider_reference).exists()
    audit_run(
        findings=0,
        refunds={
            "clean": False,
            "findings": 1,
            "unfenced": [claim.provider_reference],
            "unknown_references": [],
            "double_refunds": [],
            "over_refunds": [],
        },
    )

    box = audit_box(client_for(viewer))

    assert "1 of 1 findings settled since the audit" in words(box)
    assert "desk-audit-finding" not in title(box, "audit-refunds")


def test_audit_box__a_clean_audit_says_nothing_of_settling(provider, viewer, queue):
    FenceAuditRun.objects.create(
        started_at=timezone.now(),
        finished_at=timezone.now(),
        window_start=timezone.now() - timedelta(days=1),
        exit_code=0,
        summary={"clean": True, "findings": 0},
    )

    box = audit_box(client_for(viewer))

    assert "clean (exit 0)" in box and "findings settled" not in box
