"""The desk's chart reads the last day's succeeded operations through an index of their own.

Needs attention draws the outcomes of the last 24 hours: succeeded, failed,
uncertain and needs review operations by the hour they last changed. Failed
ones have `payments_op_failed` (updated_at) and the unfinished ones
`payments_op_unfinished`; the succeeded ones, almost all of a year of history,
had none, so the chart read every operation. `payments_op_succeeded`
(updated_at) over succeeded operations makes it a range of one day's rows. An
entry is written once, when an operation succeeds (succeeded is final).

Built CONCURRENTLY (`atomic = False`), as migration 0014 builds its indexes;
an index an interrupted build left INVALID is dropped and built again.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.models import Q


def drop_if_invalid(name: str) -> migrations.RunPython:
    """Drop index `name` if an interrupted CREATE INDEX CONCURRENTLY left it INVALID."""

    def run(apps, schema_editor) -> None:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [name]
            )
            row = cursor.fetchone()
            if row is not None and row[0]:
                cursor.execute(f"DROP INDEX CONCURRENTLY {name}")

    return migrations.RunPython(run, run)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0020_operationevent_provider_requests")]

    operations = [
        drop_if_invalid("payments_op_succeeded"),
        AddIndexConcurrently(
            model_name="operation",
            index=models.Index(
                fields=["updated_at"],
                name="payments_op_succeeded",
                condition=Q(state="succeeded"),
            ),
        ),
    ]
