"""payments_fence_refuse(message): raise SQLSTATE PF001 with `message`.

A statement sent ahead of its answer (payments.engine.fence: an outcome queued
in front of the unit's next statement and its COMMIT) must fail when it
changes nothing, or the statements behind it in the pipeline, the COMMIT
included, would run as if it had. SQL has no way to raise an error; this
function is it. `CASE WHEN <changed> THEN true ELSE payments_fence_refuse(...) END`
in the statement's last SELECT raises it only then.

Workers of this release need it: run `migrate` before starting them (they refuse
to start while a payments or inbox migration is not applied). It comes before
0010, whose index builds may take long on a large table.
"""

from django.db import migrations

REFUSAL_SQLSTATE = "PF001"  # payments.engine.fence.REFUSAL_SQLSTATE


class Migration(migrations.Migration):
    dependencies = [("payments", "0008_bootstrap_client_keys")]

    operations = [
        migrations.RunSQL(
            f"""
            CREATE OR REPLACE FUNCTION payments_fence_refuse(message text) RETURNS boolean
            LANGUAGE plpgsql VOLATILE AS $$
            BEGIN
                RAISE EXCEPTION USING ERRCODE = '{REFUSAL_SQLSTATE}', MESSAGE = message;
            END
            $$
            """,
            reverse_sql="DROP FUNCTION IF EXISTS payments_fence_refuse(text)",
        )
    ]
