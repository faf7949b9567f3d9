"""A claim keeps the reference a look saw at the provider (`StepClaim.seen_reference`).

The desk's search by reference read `provider_reference` only, which a claim
gets when its step is settled (or a reconcile finds it in progress). A look
that saw the provider's object while the step stays unsettled (the desk's query
of an operation a worker may still run, a contradiction held for review) kept
the reference in `provider_view`'s JSON alone, where no index serves a search.

Added with a constant default kept in the database, as 0023 added `system`: no
table rewrite, and a previous release's INSERT (which names no such column)
still works. Its index is built CONCURRENTLY by 0030.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("payments", "0028_operation_tenant")]

    operations = [
        migrations.AddField(
            model_name="stepclaim",
            name="seen_reference",
            field=models.CharField(blank=True, db_default="", default="", max_length=255),
        ),
    ]
