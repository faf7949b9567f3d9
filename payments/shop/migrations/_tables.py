"""What payments 0027 and shop 0001 both do with the shop's tables: make the missing ones.

Not a migration (the loader skips a module whose name starts with "_"): a helper
both import, so that a table dropped by 0027 is made again, by its reverse or by
shop 0001, in one shape, the one the earlier migrations gave it.
"""

#: The shop's models and their tables, in the order the earlier migrations made them.
TABLES = [
    ("Order", "payments_order"),
    ("Invoice", "payments_invoice"),
    ("CreditNote", "payments_creditnote"),
    ("LedgerEntry", "payments_ledgerentry"),
    ("SalesDay", "payments_salesday"),
]


def existing_tables(schema_editor):
    return set(schema_editor.connection.introspection.table_names())


def make_missing_tables(apps, schema_editor, app_label):
    """Make each of the shop's tables the database lacks, from `app_label`'s model in the
    migration state `apps` ("payments" before 0027, "shop" after), empty."""
    existing = existing_tables(schema_editor)
    for name, table in TABLES:
        if table not in existing:
            schema_editor.create_model(apps.get_model(app_label, name))
            if name == "Order":
                _unique_key_as_an_index(schema_editor)


def _unique_key_as_an_index(schema_editor):
    """The order's (client, key) uniqueness as payments 0012 made it: a unique index built
    CONCURRENTLY, not a constraint (create_model makes a constraint, and a migration back
    past 0012 drops an index). After create_model's own deferred statements, which add
    the constraint when the migration ends."""
    schema_editor.deferred_sql += [
        "ALTER TABLE payments_order DROP CONSTRAINT payments_order_client_key_uniq",
        "CREATE UNIQUE INDEX payments_order_client_key_uniq"
        " ON payments_order (client_id, idempotency_key)",
    ]
