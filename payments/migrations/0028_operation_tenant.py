"""An operation's key namespace becomes a tenant the project supplies, not an API client.

`Operation.client` (a foreign key to ApiClient) becomes `Operation.tenant`, a
string: the JSON API's client N is the tenant "client:N" (ApiClient.tenant),
which is what its id went into each step's provider idempotency key as, so
every key derives as before (payments.engine.fence.derive_idempotency_key). A
project without the API supplies its own ("hotel:42") or none (""). The key
constraint becomes UNIQUE(tenant, scope, key) under the name it had, which a
previous release's INSERT ... ON CONFLICT ON CONSTRAINT names.

Production-safe, as 0012: it runs while a previous release still serves.

1. `tenant` is added with a constant default kept in the database (no table
   rewrite; a previous release's INSERT names no tenant).
2. A BEFORE INSERT trigger bridges the two releases while both write: a row
   the previous release writes (client_id, no tenant) gets "client:<id>"; a
   row this one writes with an API client's tenant gets its client_id, so the
   previous release still finds it by client. The foreign key's constraint
   is dropped first: a project's own tenant may read "client:<n>" with no
   such API client.
3. Existing rows get their tenant in batches of BATCH ids, each committed on
   its own (no long transaction, no lock on the whole table).
4. The unique index over (tenant, scope, key) is built CONCURRENTLY; an
   interrupted build is dropped and built again on the next run.
5. In one short transaction (waiting at most LOCK_TIMEOUT for its lock) the
   old constraint is dropped and the new index takes its name.

The column client_id and the trigger stay in the database for this release
(the model no longer has the field): the next release's migration drops
both, once no process of a release before this one can run.

Every step can run again: a run stopped anywhere (a lock not granted in
LOCK_TIMEOUT, a killed process) is finished by running `migrate` again.

Back to 0027 (`migrate payments 0027`): refused, changing nothing, while an
operation has a tenant of the project's own ("hotel:42": 0027 has only API
clients, and would merge those tenants' keys into one namespace). Otherwise
the old index is built CONCURRENTLY, takes the constraint's name in one short
transaction, and the trigger and the tenant column go; each row keeps its
client_id. The foreign key comes back NOT VALID (rows are not re-checked).
"""

from django.db import OperationalError, migrations, models, transaction

TABLE = "payments_operation"
CONSTRAINT = "payments_operation_client_scope_key_uniq"
INDEX = "payments_operation_tenant_scope_key"
OLD_INDEX = "payments_operation_client_scope_key"
BRIDGE = "payments_operation_tenant_bridge"
BATCH = 10_000
LOCK_TIMEOUT = "5s"

ADD_TENANT = f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tenant varchar(64) DEFAULT '' NOT NULL"
DROP_TENANT = f"ALTER TABLE {TABLE} DROP COLUMN IF EXISTS tenant"

DROP_CLIENT_FOREIGN_KEY = f"""
DO $$
DECLARE fk text;
BEGIN
    SELECT conname INTO fk FROM pg_constraint
    WHERE conrelid = '{TABLE}'::regclass AND contype = 'f'
      AND conkey = ARRAY[(SELECT attnum FROM pg_attribute
                          WHERE attrelid = '{TABLE}'::regclass AND attname = 'client_id')];
    IF fk IS NOT NULL THEN
        EXECUTE format('ALTER TABLE {TABLE} DROP CONSTRAINT %I', fk);
    END IF;
END $$;
"""

CREATE_BRIDGE = f"""
CREATE OR REPLACE FUNCTION {BRIDGE}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant = '' AND NEW.client_id IS NOT NULL THEN
        NEW.tenant := 'client:' || NEW.client_id;
    ELSIF NEW.client_id IS NULL AND NEW.tenant ~ '^client:[1-9][0-9]{{0,17}}$' THEN
        NEW.client_id := substr(NEW.tenant, 8)::bigint;
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS {BRIDGE} ON {TABLE};
CREATE TRIGGER {BRIDGE} BEFORE INSERT ON {TABLE} FOR EACH ROW EXECUTE FUNCTION {BRIDGE}();
"""

RESTORE_CLIENT_FOREIGN_KEY = f"""
ALTER TABLE {TABLE} ADD CONSTRAINT payments_operation_client_id_fk
    FOREIGN KEY (client_id) REFERENCES payments_apiclient (id)
    DEFERRABLE INITIALLY DEFERRED NOT VALID;
"""

DROP_BRIDGE = f"DROP TRIGGER IF EXISTS {BRIDGE} ON {TABLE}; DROP FUNCTION IF EXISTS {BRIDGE}();"

#: In one short transaction each: the constraint's name moves to the other index.
SWAP = [
    f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS {CONSTRAINT}",
    f"ALTER TABLE {TABLE} ADD CONSTRAINT {CONSTRAINT} UNIQUE USING INDEX {INDEX}",
]

BUILD_OLD_INDEX = (
    f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {OLD_INDEX} "
    f"ON {TABLE} (client_id, scope, key) NULLS NOT DISTINCT"
)

UNSWAP = [
    f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS {CONSTRAINT}",
    f"ALTER TABLE {TABLE} ADD CONSTRAINT {CONSTRAINT} UNIQUE USING INDEX {OLD_INDEX}",
]

#: A tenant 0027 holds: none, or an API client's (the trigger's pattern).
API_CLIENT_TENANT = r"^client:[1-9][0-9]{0,17}$"


def _in_one_transaction(schema_editor, statements: list[str]) -> None:
    """Run `statements` in one transaction waiting at most LOCK_TIMEOUT for a lock; a lock
    not granted rolls it back and says what to do."""
    connection = schema_editor.connection
    try:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            for statement in statements:
                cursor.execute(statement)
    except OperationalError as exc:
        raise RuntimeError(
            f"{TABLE} was not locked within {LOCK_TIMEOUT} (a long transaction holds it: "
            "pg_stat_activity shows which); nothing of this step changed. Run migrate again."
        ) from exc


def swap(apps, schema_editor) -> None:
    _in_one_transaction(schema_editor, SWAP)


def unswap(apps, schema_editor) -> None:
    _in_one_transaction(schema_editor, UNSWAP)


def fill_tenants(apps, schema_editor) -> None:
    """Give every API client's operation its tenant, BATCH ids at a time, each batch its
    own transaction (the migration runs outside one: `atomic = False`)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"SELECT min(id), max(id) FROM {TABLE}")
        low, high = cursor.fetchone()
        if low is None:
            return
        for start in range(low, high + 1, BATCH):
            cursor.execute(
                f"UPDATE {TABLE} SET tenant = 'client:' || client_id "
                "WHERE id >= %s AND id < %s AND client_id IS NOT NULL AND tenant = ''",
                [start, start + BATCH],
            )


def _drop_if_invalid(schema_editor, index: str) -> None:
    """Drop `index` (CONCURRENTLY) if an interrupted build left it INVALID."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [index]
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            cursor.execute(f"DROP INDEX CONCURRENTLY {index}")


def drop_index_if_invalid(apps, schema_editor) -> None:
    _drop_if_invalid(schema_editor, INDEX)


def drop_old_index_if_invalid(apps, schema_editor) -> None:
    _drop_if_invalid(schema_editor, OLD_INDEX)


def refuse_project_tenants(apps, schema_editor) -> None:
    """Stop the way back to 0027, before it changes anything, while an operation has a
    tenant of the project's own: 0027 keys operations by API client alone."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            f"SELECT count(*), min(tenant) FROM {TABLE} WHERE tenant <> '' AND tenant !~ %s",
            [API_CLIENT_TENANT],
        )
        count, example = cursor.fetchone()
    if count:
        raise RuntimeError(
            f"Not migrated back to 0027, nothing changed: {count} operation(s) have a tenant "
            f"of the project's own (e.g. {example!r}), which 0027 cannot hold (it keys "
            "operations by API client, and would merge those tenants' keys into one "
            "namespace). Keep this release, or remove those operations first."
        )


class Migration(migrations.Migration):
    atomic = False  # batches committed one by one; CREATE INDEX CONCURRENTLY

    dependencies = [("payments", "0027_shop_models_moved")]

    operations = [
        migrations.RunSQL(f"SET lock_timeout = '{LOCK_TIMEOUT}'", "RESET lock_timeout"),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="operation",
                    name="tenant",
                    field=models.CharField(blank=True, db_default="", max_length=64),
                ),
                migrations.RemoveConstraint(model_name="operation", name=CONSTRAINT),
                migrations.RemoveField(model_name="operation", name="client"),
                migrations.AddConstraint(
                    model_name="operation",
                    constraint=models.UniqueConstraint(
                        fields=("tenant", "scope", "key"), name=CONSTRAINT
                    ),
                ),
            ],
            database_operations=[
                # As AddField with db_default writes it (no table rewrite), run again or not.
                migrations.RunSQL(ADD_TENANT, DROP_TENANT),
                migrations.RunSQL(DROP_CLIENT_FOREIGN_KEY, RESTORE_CLIENT_FOREIGN_KEY),
                migrations.RunSQL(CREATE_BRIDGE, DROP_BRIDGE),
                migrations.RunSQL("RESET lock_timeout", f"SET lock_timeout = '{LOCK_TIMEOUT}'"),
                migrations.RunPython(fill_tenants, migrations.RunPython.noop),
                # CREATE INDEX CONCURRENTLY waits for older transactions by design.
                migrations.RunPython(drop_index_if_invalid, migrations.RunPython.noop),
                migrations.RunSQL(
                    f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} "
                    f"ON {TABLE} (tenant, scope, key)",
                    f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}",
                ),
                migrations.RunPython(swap, unswap),
                # The way back only (operations reverse in the opposite order): refused
                # first if it would merge tenants, then the old index built before the
                # swap back.
                migrations.RunSQL(migrations.RunSQL.noop, BUILD_OLD_INDEX),
                migrations.RunPython(migrations.RunPython.noop, drop_old_index_if_invalid),
                migrations.RunPython(migrations.RunPython.noop, refuse_project_tenants),
            ],
        ),
    ]
