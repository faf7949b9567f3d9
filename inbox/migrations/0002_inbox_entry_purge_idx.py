"""The purge's index: each consumer's rows in (handled_at, id) order."""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY cannot run in a transaction; it does not block
    # the handlers' inserts while it builds on a large inbox.
    atomic = False

    dependencies = [
        ("inbox", "0001_initial"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="inboxentry",
            index=models.Index(
                fields=["consumer", "handled_at", "id"], name="inbox_entry_purge_idx"
            ),
        ),
    ]
