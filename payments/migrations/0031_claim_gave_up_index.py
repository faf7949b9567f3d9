"""Index the claims the fence gave up on before anything ran (`payments_claim_gave_up`).

Needs attention looks for operations an outage failed before anything ran
older than its 24 h list, and the operations list filters them (any age):
both read these claims first, a few per outage, then their operations by
primary key. Without it they read every failed operation (a year's declines)
or every claim. Partial (`state = 'failed' AND error LIKE 'gave up: %'`):
nothing else writes an entry. Built CONCURRENTLY (`atomic = False`), in a
migration of its own, as 0025 and 0030; an INVALID leftover is dropped first.
"""

from importlib import import_module

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models import Q

drop_if_invalid = import_module("payments.migrations.0021_succeeded_index").drop_if_invalid


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0030_claim_seen_reference_index")]

    operations = [
        drop_if_invalid("payments_claim_gave_up"),
        AddIndexConcurrently(
            model_name="stepclaim",
            index=models.Index(
                fields=["operation"],
                name="payments_claim_gave_up",
                condition=Q(state="failed", error__startswith="gave up: "),
            ),
        ),
    ]
