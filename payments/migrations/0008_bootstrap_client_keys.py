"""Operations asked for before API clients existed belong to the bootstrap client.

Until 0006 every request came with the one API_TOKEN, now the "bootstrap"
client. Without this, a client retrying a request from before the upgrade with
the same Idempotency-Key would not find its operation (its client was empty)
and would start a new one instead of getting the replay.
"""

from django.db import migrations

BOOTSTRAP_CLIENT = "bootstrap"  # payments.api.base.BOOTSTRAP_CLIENT


def adopt(apps, schema_editor):
    Operation = apps.get_model("payments", "Operation")
    ApiClient = apps.get_model("payments", "ApiClient")
    orphans = Operation.objects.filter(scope="client", client__isnull=True)
    if not orphans.exists():
        return
    client, _ = ApiClient.objects.get_or_create(name=BOOTSTRAP_CLIENT)
    orphans.update(client=client)


class Migration(migrations.Migration):
    dependencies = [("payments", "0007_provider_events")]

    operations = [migrations.RunPython(adopt, migrations.RunPython.noop)]
