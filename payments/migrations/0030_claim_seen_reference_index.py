"""Index the references looks saw (`payments_claim_seen_ref`), over the claims that have one.

Partial (`seen_reference <> ''`): a claim no look found an object for (every
step that got its answer) writes no entry. Built CONCURRENTLY (`atomic =
False`), in a migration of its own so that it can be run again after an
interruption, as 0025 builds `payments_claim_ref_given`; an index an
interrupted build left INVALID is dropped and built again.
"""

from importlib import import_module

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models import Q

drop_if_invalid = import_module("payments.migrations.0021_succeeded_index").drop_if_invalid


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0029_claim_seen_reference")]

    operations = [
        drop_if_invalid("payments_claim_seen_ref"),
        AddIndexConcurrently(
            model_name="stepclaim",
            index=models.Index(
                fields=["seen_reference"],
                name="payments_claim_seen_ref",
                condition=~Q(seen_reference=""),
            ),
        ),
    ]
