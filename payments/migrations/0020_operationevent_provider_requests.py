"""Audit rows carry the provider requests behind them: HTTP status, request id, key.

A nullable column without a default: PostgreSQL adds it to payments_operationevent
without rewriting the table, and a previous release's INSERT, which does not name
it, leaves it NULL. Adding it still takes an ACCESS EXCLUSIVE lock for an instant,
and every transition writes an audit row: behind a long transaction that wait would
queue every checkout, so it runs under `lock_timeout` (as 0012). Past it the
migration stops with "canceling statement due to lock timeout" and is run again.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("payments", "0019_stepclaim_requests_sent")]

    operations = [
        # SET LOCAL: for this migration's transaction only.
        migrations.RunSQL("SET LOCAL lock_timeout = '5s'", reverse_sql=migrations.RunSQL.noop),
        migrations.AddField(
            model_name="operationevent",
            name="requests",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
