"""The fence's tables keep only the indexes a query uses.

Every index of a table gets an entry on each insert, and on each update that
changes an indexed column: every state change of an operation or a claim (the
state is indexed). A fenced checkout wrote 136 index entries (worker side); 44
of them went to indexes no query needed (tests/engine/test_indexes.py):
- operation.client_id and stepclaim.operation_id: each the first column of a
  unique index that serves the same lookups (and the foreign keys' checks);
- stepclaim.idempotency_key: nothing looks a claim up by it (the admin's search
  matches case-insensitively, which no plain index serves);
- stepclaim.provider_reference had two, a plain one (equality) and Django's
  `_like` one (varchar_pattern_ops: prefix searches, which a btree in a
  non-C collation cannot serve); the `_like` one serves equality too and
  stays, renamed;
- operationevent.created_at: every read of the audit is one operation's rows;
- operation.retry_of_id and parent_id: kept, but only for the rows that have one.

Production-safe: no statement takes a lock that stops writes for longer than
its catalogue change. New indexes are built CONCURRENTLY before the ones they
replace are dropped CONCURRENTLY (so the migration runs outside a
transaction: `atomic = False`). Every step can run again: an interrupted run
is finished by the next one, which drops (CONCURRENTLY) an index an interrupted
build left INVALID and builds it again. Reversible, the same way: the reverse
builds the old indexes again.
"""

import functools

from django.db import migrations, models
from django.db.models import Q


def drop_if_invalid(apps, schema_editor, *, name: str) -> None:
    """Drop index `name` (CONCURRENTLY) if an interrupted CREATE INDEX CONCURRENTLY left it
    INVALID. A RunPython function (functools.partial names the index)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [name]
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            cursor.execute(f"DROP INDEX CONCURRENTLY {name}")


def _drop_if_invalid(name: str) -> functools.partial[None]:
    return functools.partial(drop_if_invalid, name=name)


def create(
    name: str, table: str, definition: str, *, reverse: bool = True
) -> list[migrations.operations.base.Operation]:
    """Build index `name` without blocking writes (again, if an interrupted build left it
    INVALID); the reverse drops it (with `reverse`)."""
    return [
        migrations.RunPython(_drop_if_invalid(name), migrations.RunPython.noop),
        migrations.RunSQL(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} {definition}",
            reverse_sql=(
                f"DROP INDEX CONCURRENTLY IF EXISTS {name}" if reverse else migrations.RunSQL.noop
            ),
        ),
    ]


def drop(name: str, table: str, definition: str) -> list[migrations.operations.base.Operation]:
    """Drop index `name` without blocking writes; the reverse builds it again (again, if
    an interrupted reverse left it INVALID)."""
    return [
        migrations.RunSQL(
            f"DROP INDEX CONCURRENTLY IF EXISTS {name}",
            reverse_sql=f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} {definition}",
        ),
        # Reversed, this runs first: before the build above.
        migrations.RunPython(migrations.RunPython.noop, _drop_if_invalid(name)),
    ]


def fk(to: str, related_name: str, *, null: bool) -> models.ForeignKey:
    return models.ForeignKey(
        blank=null,
        db_index=False,
        null=null,
        on_delete=models.deletion.PROTECT,
        related_name=related_name,
        to=to,
    )


class Migration(migrations.Migration):
    atomic = False  # CREATE / DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0009_fence_refuse")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="stepclaim", name="payments_claim_idem_key"),
                migrations.AlterField(
                    model_name="operation",
                    name="client",
                    field=fk("payments.apiclient", "operations", null=True),
                ),
                migrations.AlterField(
                    model_name="operation",
                    name="parent",
                    field=fk("payments.operation", "follow_ups", null=True),
                ),
                migrations.AlterField(
                    model_name="operation",
                    name="retry_of",
                    field=fk("payments.operation", "retries", null=True),
                ),
                migrations.AlterField(
                    model_name="stepclaim",
                    name="operation",
                    field=fk("payments.operation", "claims", null=False),
                ),
                migrations.AlterField(
                    model_name="operationevent",
                    name="created_at",
                    field=models.DateTimeField(auto_now_add=True),
                ),
                migrations.AlterField(
                    model_name="stepclaim",
                    name="provider_reference",
                    field=models.CharField(blank=True, max_length=255),
                ),
                migrations.AddIndex(
                    model_name="operation",
                    index=models.Index(
                        condition=Q(retry_of__isnull=False),
                        fields=["retry_of"],
                        name="payments_op_retry_of",
                    ),
                ),
                migrations.AddIndex(
                    model_name="operation",
                    index=models.Index(
                        condition=Q(parent__isnull=False),
                        fields=["parent"],
                        name="payments_op_parent",
                    ),
                ),
                migrations.AddIndex(
                    model_name="stepclaim",
                    index=models.Index(
                        fields=["provider_reference"],
                        name="payments_claim_reference",
                        opclasses=["varchar_pattern_ops"],
                    ),
                ),
            ],
            database_operations=[],
        ),
        # The database's side, outside SeparateDatabaseAndState: `sqlmigrate` prints the SQL
        # and does not run the RunPython steps. Each step can run again: a run interrupted
        # half-way is finished by the next.
        # The partial indexes first: lookups by retry_of / parent stay indexed.
        *create(
            "payments_op_retry_of",
            "payments_operation",
            "(retry_of_id) WHERE retry_of_id IS NOT NULL",
        ),
        *create(
            "payments_op_parent",
            "payments_operation",
            "(parent_id) WHERE parent_id IS NOT NULL",
        ),
        *drop(
            "payments_operation_retry_of_id_f3aec5ea",
            "payments_operation",
            "(retry_of_id)",
        ),
        *drop("payments_operation_parent_id_befe4438", "payments_operation", "(parent_id)"),
        *drop("payments_operation_client_id_22ca80a3", "payments_operation", "(client_id)"),
        *drop(
            "payments_stepclaim_operation_id_777da3cd",
            "payments_stepclaim",
            "(operation_id)",
        ),
        *drop("payments_claim_idem_key", "payments_stepclaim", "(idempotency_key)"),
        *drop(
            "payments_operationevent_created_at_315b3e80",
            "payments_operationevent",
            "(created_at)",
        ),
        # Django's `_like` index on provider_reference becomes the one index on it
        # (a new one is built if it is gone: a database set up some other way).
        migrations.RunSQL(
            "ALTER INDEX IF EXISTS payments_stepclaim_provider_reference_98bbd9af_like "
            "RENAME TO payments_claim_reference",
            reverse_sql="ALTER INDEX IF EXISTS payments_claim_reference "
            "RENAME TO payments_stepclaim_provider_reference_98bbd9af_like",
        ),
        *create(
            "payments_claim_reference",
            "payments_stepclaim",
            "(provider_reference varchar_pattern_ops)",
            reverse=False,  # the rename's reverse gives it its old name back
        ),
        *drop(
            "payments_stepclaim_provider_reference_98bbd9af",
            "payments_stepclaim",
            "(provider_reference)",
        ),
    ]
