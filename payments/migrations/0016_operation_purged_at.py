"""Retention: an operation remembers when its history was purged; the purge has its index.

`purged_at` is nullable (a previous release's INSERT names it not), so
PostgreSQL adds it without rewriting the table; the instant ACCESS EXCLUSIVE
lock runs under `lock_timeout` as in 0012 (past it, run `migrate` again).
`payments_op_unpurged` (id) over final operations not purged yet is what the
purge walks, oldest first; built CONCURRENTLY (`atomic = False`), dropped and
built again if an interrupted build left it INVALID.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models import Q

INDEX = "payments_op_unpurged"
SET_LOCK_TIMEOUT = "SET lock_timeout = '5s'"


def drop_if_invalid(apps, schema_editor) -> None:
    """Drop the index if an interrupted CREATE INDEX CONCURRENTLY left it INVALID."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [INDEX]
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            cursor.execute(f"DROP INDEX CONCURRENTLY {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0015_audit_checkpoint")]

    operations = [
        migrations.RunSQL(SET_LOCK_TIMEOUT, reverse_sql="RESET lock_timeout"),
        migrations.AddField(
            model_name="operation",
            name="purged_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        # CREATE INDEX CONCURRENTLY waits for older transactions by design: no timeout.
        migrations.RunSQL("RESET lock_timeout", reverse_sql=SET_LOCK_TIMEOUT),
        migrations.RunPython(drop_if_invalid, drop_if_invalid),
        AddIndexConcurrently(
            model_name="operation",
            index=models.Index(
                condition=Q(purged_at__isnull=True, state__in=["failed", "succeeded"]),
                fields=["id"],
                name=INDEX,
            ),
        ),
    ]
