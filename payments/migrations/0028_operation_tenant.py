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

Every step can run again, either way: a run stopped anywhere (a lock not
granted in LOCK_TIMEOUT, a killed process) is finished by running the same
`migrate` again; a step already done (the constraint already over the
columns it moves to) is skipped.

Back to 0027 (`migrate payments 0027`, with this release's processes
stopped): refused, changing nothing, while an operation has a tenant of the
project's own ("hotel:42": 0027 has only API clients, and would merge those
tenants' keys into one namespace), checked first and again under each lock.
Otherwise the old index is built CONCURRENTLY and takes the constraint's name
in one short transaction (not done, the old index is dropped again: left
behind it would refuse two tenants' equal keys); then, in one more, the
trigger and the tenant column go and the foreign key comes back NOT VALID
(rows are not re-checked). Each row keeps its client_id.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import OperationalError, migrations, models, transaction

TABLE = "payments_operation"
CONSTRAINT = "payments_operation_client_scope_key_uniq"
INDEX = "payments_operation_tenant_scope_key"
OLD_INDEX = "payments_operation_client_scope_key"
BRIDGE = "payments_operation_tenant_bridge"
BATCH = 10_000
LOCK_TIMEOUT = "5s"

ADD_TENANT = f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tenant varchar(64) DEFAULT '' NOT NULL"

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

CLIENT_FOREIGN_KEY = "payments_operation_client_id_fk"

#: The way back: the foreign key again (NOT VALID: rows are not re-checked), if missing.
RESTORE_CLIENT_FOREIGN_KEY = f"""
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conrelid = '{TABLE}'::regclass AND contype = 'f'
          AND conkey = ARRAY[(SELECT attnum FROM pg_attribute
                              WHERE attrelid = '{TABLE}'::regclass AND attname = 'client_id')]
    ) THEN
        ALTER TABLE {TABLE} ADD CONSTRAINT {CLIENT_FOREIGN_KEY}
            FOREIGN KEY (client_id) REFERENCES payments_apiclient (id)
            DEFERRABLE INITIALLY DEFERRED NOT VALID;
    END IF;
END $$;
"""

BUILD_INDEX = (
    f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {INDEX} ON {TABLE} (tenant, scope, key)"
)
BUILD_OLD_INDEX = (
    f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {OLD_INDEX} "
    f"ON {TABLE} (client_id, scope, key) NULLS NOT DISTINCT"
)

#: A tenant 0027 holds: none, or an API client's (the trigger's pattern).
API_CLIENT_TENANT = r"^client:[1-9][0-9]{0,17}$"


@contextmanager
def _locked(schema_editor) -> Iterator[Any]:
    """A transaction holding TABLE exclusively, its lock waited for at most LOCK_TIMEOUT;
    a lock not granted rolls it back and says what to do."""
    connection = schema_editor.connection
    try:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            cursor.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            yield cursor
    except OperationalError as exc:
        raise RuntimeError(
            f"{TABLE} was not locked within {LOCK_TIMEOUT} (a long transaction holds it: "
            "pg_stat_activity shows which); nothing of this step changed. Run migrate again."
        ) from exc


def _key_on(schema_editor, column: str) -> bool:
    """Whether CONSTRAINT is the unique key over (`column`, scope, key) already."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = %s::regclass AND conname = %s",
            [TABLE, CONSTRAINT],
        )
        row = cursor.fetchone()
    return row is not None and f"({column}, scope, key)" in row[0]


def _drop_index(schema_editor, index: str, *, only_invalid: bool) -> None:
    """Drop `index` CONCURRENTLY if it exists (with `only_invalid`: if an interrupted
    build left it INVALID)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [index]
        )
        row = cursor.fetchone()
        if row is not None and (row[0] or not only_invalid):
            cursor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {index}")


def _refuse_project_tenants(cursor) -> None:
    """Stop the way back to 0027 while an operation has a tenant of the project's own:
    0027 keys operations by API client alone, and would merge those tenants' keys."""
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


def _build(schema_editor, column: str, index: str, build: str) -> None:
    """`index` (over `column`, scope, key) built CONCURRENTLY by `build`, an interrupted
    build dropped first; nothing to do once the key constraint is over `column`."""
    if _key_on(schema_editor, column):
        return
    _drop_index(schema_editor, index, only_invalid=True)
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(build)


def _move_key(cursor, index: str) -> None:
    """The key constraint's name moves to `index` (inside a `_locked` transaction)."""
    cursor.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS {CONSTRAINT}")
    cursor.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT {CONSTRAINT} UNIQUE USING INDEX {index}")


def build_index(apps, schema_editor) -> None:
    """The unique index over (tenant, scope, key)."""
    _build(schema_editor, "tenant", INDEX, BUILD_INDEX)


def drop_index(apps, schema_editor) -> None:
    _drop_index(schema_editor, INDEX, only_invalid=False)


def swap(apps, schema_editor) -> None:
    """The key constraint's name moves to the new index, in one short transaction."""
    if _key_on(schema_editor, "tenant"):
        return
    with _locked(schema_editor) as cursor:
        _move_key(cursor, INDEX)


def unswap(apps, schema_editor) -> None:
    """Back: the key constraint's name moves to the old index, in one short transaction
    that refuses a project's own tenant written meanwhile. Not done, the old index is
    dropped: left in place it would refuse two tenants' equal keys."""
    if _key_on(schema_editor, "client_id"):
        return
    try:
        with _locked(schema_editor) as cursor:
            _refuse_project_tenants(cursor)
            _move_key(cursor, OLD_INDEX)
    except Exception:
        _drop_index(schema_editor, OLD_INDEX, only_invalid=False)
        raise


def build_old_index(apps, schema_editor) -> None:
    """Back: the old unique index over (client_id, scope, key), before the constraint
    moves to it."""
    _build(schema_editor, "client_id", OLD_INDEX, BUILD_OLD_INDEX)


def refuse_project_tenants(apps, schema_editor) -> None:
    """Back, first: refused before anything changes (and again under each lock after)."""
    with schema_editor.connection.cursor() as cursor:
        _refuse_project_tenants(cursor)


def back_to_client_ids(apps, schema_editor) -> None:
    """Back, last, in one transaction: the trigger and the tenant column go, the foreign
    key comes back (NOT VALID), refused if a project's own tenant was written meanwhile."""
    with _locked(schema_editor) as cursor:
        _refuse_project_tenants(cursor)
        cursor.execute(f"DROP TRIGGER IF EXISTS {BRIDGE} ON {TABLE}")
        cursor.execute(f"DROP FUNCTION IF EXISTS {BRIDGE}()")
        cursor.execute(RESTORE_CLIENT_FOREIGN_KEY)
        cursor.execute(f"ALTER TABLE {TABLE} DROP COLUMN IF EXISTS tenant")


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
            # Every step can run again. Back to 0027 they run in the opposite order: the
            # refusal, the old index, the swap back, then the column, trigger and key.
            database_operations=[
                migrations.RunPython(migrations.RunPython.noop, back_to_client_ids),
                # As AddField with db_default writes it (no table rewrite).
                migrations.RunSQL(ADD_TENANT, migrations.RunSQL.noop),
                migrations.RunSQL(DROP_CLIENT_FOREIGN_KEY, migrations.RunSQL.noop),
                migrations.RunSQL(CREATE_BRIDGE, migrations.RunSQL.noop),
                migrations.RunSQL("RESET lock_timeout", migrations.RunSQL.noop),
                migrations.RunPython(fill_tenants, migrations.RunPython.noop),
                # CREATE INDEX CONCURRENTLY waits for older transactions by design.
                migrations.RunPython(build_index, drop_index),
                migrations.RunPython(swap, unswap),
                migrations.RunPython(migrations.RunPython.noop, build_old_index),
                migrations.RunPython(migrations.RunPython.noop, refuse_project_tenants),
            ],
        ),
    ]
