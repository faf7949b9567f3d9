"""Index a claim's provider reference only when it has one.

`payments_claim_reference` held an entry for every claim, most of them the
empty reference of a local step (an invoice, marking an order paid) or of an
external step before its answer, and a new entry at each of those claims'
state changes. Nothing looks a claim up by an empty reference. The
replacement, `payments_claim_ref_given`, is partial (`provider_reference <>
''`): a fenced checkout writes 1 entry instead of 6 (tests/engine/test_indexes.py,
docs/benchmarks.md's WAL by relation).

Built CONCURRENTLY (`atomic = False`) here; the old index is dropped
CONCURRENTLY by 0026, a migration of its own, so that each step can be run
again after an interruption (a DROP INDEX CONCURRENTLY waits for every older
transaction, and a deploy's time-out may stop it): lookups by reference keep
an index all along, and neither step blocks writes. An index an interrupted
build left INVALID is dropped and built again (payments 0021's
`drop_if_invalid`).
"""

from importlib import import_module

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models import Q

drop_if_invalid = import_module("payments.migrations.0021_succeeded_index").drop_if_invalid


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0024_apiclient_payment_system")]

    operations = [
        drop_if_invalid("payments_claim_ref_given"),
        AddIndexConcurrently(
            model_name="stepclaim",
            index=models.Index(
                fields=["provider_reference"],
                name="payments_claim_ref_given",
                opclasses=["varchar_pattern_ops"],
                condition=~Q(provider_reference=""),
            ),
        ),
    ]
