"""Orders belong to an API client, and remember the Idempotency-Key that created them.

Production-safe, as 0010: the three columns are nullable or have a constant
default kept in the database (a previous release's INSERT names none of them),
so PostgreSQL adds them without rewriting the table. Adding them still takes
an ACCESS EXCLUSIVE lock on payments_order for an instant, and the REFERENCES a
SHARE ROW EXCLUSIVE lock on payments_apiclient: behind a long transaction that
wait would queue every checkout behind it, so these steps run with
`lock_timeout` (LOCK_TIMEOUT): past it the migration stops with "canceling
statement due to lock timeout" and is simply run again. The unique index
on (client, idempotency_key) is built CONCURRENTLY (the migration runs outside
a transaction: `atomic = False`), so orders are written meanwhile. An
interrupted build leaves the index INVALID: running `migrate` again drops it
(CONCURRENTLY) and builds it again. Existing orders get their owner in 0013;
until then, and for orders a previous release's web process still writes
during the deploy, an order without a client is the bootstrap client's.
"""

import django.db.models.deletion
from django.db import migrations, models

INDEX = "payments_order_client_key_uniq"
LOCK_TIMEOUT = "5s"
SET_LOCK_TIMEOUT = f"SET lock_timeout = '{LOCK_TIMEOUT}'"


def drop_if_invalid(apps, schema_editor) -> None:
    """Drop the index (CONCURRENTLY) if an interrupted CREATE INDEX CONCURRENTLY left it
    INVALID, so that the next statement builds it again."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [INDEX]
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            cursor.execute(f"DROP INDEX CONCURRENTLY {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0011_claim_last_request")]

    operations = [
        # The session's setting (atomic = False: every step runs on the one connection).
        migrations.RunSQL(SET_LOCK_TIMEOUT, reverse_sql="RESET lock_timeout"),
        migrations.AddField(
            model_name="order",
            name="client",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="orders",
                to="payments.apiclient",
            ),
        ),
        migrations.AddField(
            model_name="order",
            name="idempotency_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddField(
            model_name="order",
            name="request_fingerprint",
            field=models.CharField(blank=True, db_default="", max_length=64),
        ),
        # CREATE INDEX CONCURRENTLY waits for older transactions by design: no timeout.
        migrations.RunSQL("RESET lock_timeout", reverse_sql=SET_LOCK_TIMEOUT),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddConstraint(
                    model_name="order",
                    constraint=models.UniqueConstraint(
                        fields=("client", "idempotency_key"), name=INDEX
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(drop_if_invalid, migrations.RunPython.noop),
                migrations.RunSQL(
                    f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} "
                    "ON payments_order (client_id, idempotency_key)",
                    reverse_sql=f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}",
                ),
            ],
        ),
    ]
