"""`make bench-history`'s loader: copies of real checkouts' rows, references kept right."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Max, Min

from devtools.bench.history import Template, copies_for, load
from payments.models import Operation, OperationEvent, StepClaim
from payments.shop.models import Invoice, Order
from tests.support.flows import checkout
from tests.support.workers import run_fence_worker

pytestmark = pytest.mark.django_db(transaction=True)


def test_loader__copies_real_checkouts_to_a_few_hundred_operations(provider, queue):
    for n in range(3):
        checkout(f"tpl-{n}")
    run_fence_worker(queue)
    template = Template.read()
    assert template.operation_count == 9  # three checkouts and their two follow-ups each
    claims, events = StepClaim.objects.count(), OperationEvent.objects.count()

    copies = copies_for(template, 300)
    load(template, copies, span_days=400)

    total = copies + 1
    assert Operation.objects.count() == 9 * total >= 300
    assert StepClaim.objects.count() == claims * total
    assert OperationEvent.objects.count() == events * total
    assert Order.objects.count() == Invoice.objects.count() == 3 * total
    # Every copy's references point into the same copy: follow-ups to their checkout,
    # operations to their order, invoices to theirs.
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*) FROM payments_operation AS op
            LEFT JOIN payments_operation AS parent ON parent.id = op.parent_id
            LEFT JOIN payments_order AS o ON o.id::text = op.entity_id
            WHERE (op.parent_id IS NOT NULL AND split_part(parent.key, '~', 2)
                                                <> split_part(op.key, '~', 2))
               OR (op.entity_type = 'order' AND o.id IS NULL)
            """
        )
        assert cursor.fetchone()[0] == 0
    assert (
        StepClaim.objects.filter(state="done")
        .exclude(provider_reference="")
        .values("provider_reference")
        .distinct()
        .count()
        == StepClaim.objects.filter(state="done").exclude(provider_reference="").count()
    )
    spread = Operation.objects.aggregate(first=Min("created_at"), last=Max("created_at"))
    assert spread["last"] - spread["first"] > timedelta(days=390)
    # The sequences moved past the copies: the fence writes new rows as before.
    checkout("after-the-load")
    run_fence_worker(queue)
    assert Operation.objects.get(key="after-the-load").state == "succeeded"
