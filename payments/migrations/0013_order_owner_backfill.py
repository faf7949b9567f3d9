"""Give every order from before 0012 its owner: the client of its first operation, else bootstrap.

Clients exist since 0006, and their checkouts and refunds name the order they
were for (`entity_type = 'order'`, `entity_id` = the order's id): an order gets
the client of its earliest checkout or refund operation that has a client, so
a client keeps reaching its own orders. An operation without a client came
through API_TOKEN (the bootstrap client's path). Orders with no such operation
(made before 0006, by the tools, or never paid) go to the bootstrap client, as
0008 did for operations: what 0012 already states for an order without one.

Batches of BATCH orders walked by primary key (`id > last ORDER BY id`: each
batch starts where the last one ended, so the whole table is read once), each
one UPDATE in its own short transaction (`atomic = False`), so that no lock is
held on many orders while checkouts and refunds lock them. Only orders without
a client are changed: safe to interrupt and run again. Reverse: nothing (the
column is dropped by reversing 0012).
"""

from django.db import migrations, transaction

BOOTSTRAP_CLIENT = "bootstrap"  # payments.api.base.BOOTSTRAP_CLIENT
BATCH = 1000

NEXT_BATCH = """
SELECT id FROM payments_order
WHERE id > %(last)s AND client_id IS NULL
ORDER BY id
LIMIT %(batch)s
"""

ADOPT_BATCH = """
UPDATE payments_order AS o
SET client_id = COALESCE(
    (
        SELECT op.client_id FROM payments_operation AS op
        WHERE op.entity_type = 'order'
          AND op.entity_id = o.id::text
          AND op.kind IN ('checkout', 'refund')
          AND op.client_id IS NOT NULL
        ORDER BY op.created_at, op.id
        LIMIT 1
    ),
    %(bootstrap)s
)
WHERE o.id = ANY(%(ids)s) AND o.client_id IS NULL
"""


def adopt(apps, schema_editor) -> None:
    Order = apps.get_model("payments", "Order")
    ApiClient = apps.get_model("payments", "ApiClient")
    if not Order.objects.filter(client__isnull=True).exists():
        return
    bootstrap, _ = ApiClient.objects.get_or_create(name=BOOTSTRAP_CLIENT)
    connection = schema_editor.connection
    last = 0
    while True:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(NEXT_BATCH, {"last": last, "batch": BATCH})
            ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return
            cursor.execute(ADOPT_BATCH, {"bootstrap": bootstrap.pk, "ids": ids})
        last = ids[-1]


class Migration(migrations.Migration):
    atomic = False  # one transaction per batch

    dependencies = [("payments", "0012_order_client")]

    operations = [migrations.RunPython(adopt, migrations.RunPython.noop)]
