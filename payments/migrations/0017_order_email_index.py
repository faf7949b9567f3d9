"""The desk's search of orders by e-mail reads an index on LOWER(customer_email).

Built CONCURRENTLY (`atomic = False`): orders are written meanwhile; an index
an interrupted build left INVALID is dropped and built again by the next run.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models.functions import Lower

INDEX = "payments_order_email_lower"


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

    dependencies = [("payments", "0016_operation_purged_at")]

    operations = [
        migrations.RunPython(drop_if_invalid, drop_if_invalid),
        AddIndexConcurrently(
            model_name="order",
            index=models.Index(Lower("customer_email"), name=INDEX),
        ),
    ]
