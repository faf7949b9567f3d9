"""Claims record when the last request under their idempotency key was sent.

"Not found at the provider" may only count a grace period after the last
request sent under the key, whoever sent it (a worker, the reconciler's
same-key replay, the desk's). A nullable column: PostgreSQL adds it without
rewriting the table or blocking writes; claims older than it fall back to
their `claimed_at`.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("payments", "0010_fewer_fence_indexes")]

    operations = [
        migrations.AddField(
            model_name="stepclaim",
            name="last_request_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
