"""Every order from before 0012 belongs to the bootstrap client (as 0008 did for operations).

Until 0006 every request came with the one API_TOKEN, the bootstrap client;
orders made since by other clients cannot be told apart, and stay with the
bootstrap client too (the rule 0012 states: an order without a client is the
bootstrap client's, so nothing changes for any caller by running this).

Batches of BATCH rows, each its own short transaction (`atomic = False`), so
that no lock is held on many orders while checkouts and refunds lock them; the
partial scan for `client_id IS NULL` uses 0012's index. Safe to interrupt and
run again. Reverse: nothing (the column is dropped by reversing 0012).
"""

from django.db import migrations, transaction

BOOTSTRAP_CLIENT = "bootstrap"  # payments.api.base.BOOTSTRAP_CLIENT
BATCH = 1000


def adopt(apps, schema_editor) -> None:
    Order = apps.get_model("payments", "Order")
    ApiClient = apps.get_model("payments", "ApiClient")
    orphans = Order.objects.filter(client__isnull=True)
    if not orphans.exists():
        return
    client, _ = ApiClient.objects.get_or_create(name=BOOTSTRAP_CLIENT)
    while True:
        with transaction.atomic():
            batch = list(orphans.order_by("pk").values_list("pk", flat=True)[:BATCH])
            if not batch:
                return
            orphans.filter(pk__in=batch).update(client=client)


class Migration(migrations.Migration):
    atomic = False  # one transaction per batch

    dependencies = [("payments", "0012_order_client")]

    operations = [migrations.RunPython(adopt, migrations.RunPython.noop)]
