"""Drop the index on handled_at alone: each handled message wrote an entry in it.

The admin listed entries newest first by handled_at; it now lists them by id
(the order they were recorded in), through the primary key. The purge reads
each consumer's rows through `inbox_entry_purge_idx` (consumer, handled_at,
id), as before. Dropped CONCURRENTLY: no lock that would stop the handlers'
inserts meanwhile; the reverse builds it again, CONCURRENTLY.
"""

from django.contrib.postgres.operations import RemoveIndexConcurrently
from django.db import migrations


class Migration(migrations.Migration):
    atomic = False  # DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("inbox", "0002_inbox_entry_purge_idx")]

    operations = [
        RemoveIndexConcurrently(model_name="inboxentry", name="inbox_entry_handled_at_idx"),
    ]
