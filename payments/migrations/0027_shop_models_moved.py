"""The shop's models (Order, Invoice, CreditNote, LedgerEntry, SalesDay) leave this app.

They move to the app `shop` (payments/shop, its migration 0001) in the
migration state: their tables keep their names, rows, indexes and
constraints. The fence's own tables never referenced them.

Where the shop is not installed (a project that fences its own models) and
its tables are empty (the earlier migrations made them on a new database),
they are dropped: a project without the shop has none of its tables (and its
test runner's flush is not stopped by `payments_order`'s foreign key to the
API clients). Tables holding rows are never dropped: a deployment that left
the shop out of INSTALLED_APPS keeps them, and shop 0001 takes them back.
Backwards, dropped tables are made again (empty).
"""

from django.apps import apps as installed
from django.db import migrations

from payments.shop.migrations._tables import TABLES, existing_tables, make_missing_tables

#: How long the drop waits for a lock on the shop's tables (a long transaction on them).
LOCK_TIMEOUT = "5s"
def drop_unused_shop_tables(apps, schema_editor):
    """Drop the shop's tables where the shop is not installed and every one is empty.

    Locked first (ACCESS EXCLUSIVE, waiting at most LOCK_TIMEOUT): no row can be
    committed between the check and the drop, and a long transaction on them fails
    the migration fast instead of queueing every query behind it. The migration is
    one transaction: the locks hold until it commits.
    """
    if installed.is_installed("payments.shop"):
        return
    existing = existing_tables(schema_editor)
    present = [table for _, table in TABLES if table in existing]
    if not present:
        return
    quoted = [schema_editor.quote_name(table) for table in present]
    schema_editor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
    schema_editor.execute(f"LOCK TABLE {', '.join(quoted)} IN ACCESS EXCLUSIVE MODE")
    with schema_editor.connection.cursor() as cursor:
        for table in quoted:
            cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {table})")
            if cursor.fetchone()[0]:
                return  # rows: kept for the shop (or for whoever reads them)
    for table in reversed(quoted):
        schema_editor.execute(f"DROP TABLE {table}")


def make_dropped_shop_tables(apps, schema_editor):
    """Backwards: make again (empty) the shop's tables dropped above, as 0026 had them."""
    make_missing_tables(apps, schema_editor, "payments")


class Migration(migrations.Migration):
    dependencies = [
        ("payments", "0026_drop_claim_reference"),
    ]

    operations = [
        migrations.RunPython(drop_unused_shop_tables, make_dropped_shop_tables),
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.RemoveField(
                    model_name="creditnote",
                    name="order",
                ),
                migrations.RemoveField(
                    model_name="invoice",
                    name="order",
                ),
                migrations.RemoveField(
                    model_name="ledgerentry",
                    name="order",
                ),
                migrations.RemoveField(
                    model_name="order",
                    name="client",
                ),
                migrations.DeleteModel(
                    name="SalesDay",
                ),
                migrations.DeleteModel(
                    name="CreditNote",
                ),
                migrations.DeleteModel(
                    name="Invoice",
                ),
                migrations.DeleteModel(
                    name="LedgerEntry",
                ),
                migrations.DeleteModel(
                    name="Order",
                ),
            ],
        ),
    ]
