"""Drop payments_claim_reference, replaced by the partial payments_claim_ref_given (0025).

CONCURRENTLY (`atomic = False`): it waits for older transactions without
blocking writes; Django's DROP INDEX CONCURRENTLY says IF EXISTS, so a run
stopped half-way can be run again.
"""

from django.contrib.postgres.operations import RemoveIndexConcurrently
from django.db import migrations


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0025_claim_reference_given")]

    operations = [
        RemoveIndexConcurrently(model_name="stepclaim", name="payments_claim_reference"),
    ]
