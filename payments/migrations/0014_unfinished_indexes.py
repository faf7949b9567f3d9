"""The recovery loop reads through indexes over unfinished rows only.

Every interval the sweeper, the reconciler and its stranded pass look for
operations and claims that are not finished; at start-up the worker and check
`payments.E010` look for names recorded on them. Finished rows are almost all
of a year of history and none of these queries wants them:

- `payments_op_unfinished` (state, next_attempt_at) over operations that are
  not succeeded or failed replaces `payments_op_state_due` over every
  operation: an operation leaves it when it finishes (no entry is written for
  the final state);
- `payments_op_failed` (updated_at) over failed operations: the stranded pass
  and E010 look at failed operations whose claims may still resume them;
- `payments_claim_unsettled` (claimed_at) over claims that are claimed or
  uncertain replaces `payments_claim_state_age` over every claim.

Built CONCURRENTLY before the ones they replace are dropped CONCURRENTLY
(`atomic = False`); an index an interrupted build left INVALID is dropped and
built again by the next run. Reversible the same way.
"""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models
from django.db.models import Q

UNFINISHED = ["pending", "running", "retrying", "uncertain", "needs_review"]
UNSETTLED = ["claimed", "uncertain"]


def drop_if_invalid(name: str) -> migrations.RunPython:
    """Drop index `name` if an interrupted CREATE INDEX CONCURRENTLY left it INVALID."""

    def run(apps, schema_editor) -> None:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [name]
            )
            row = cursor.fetchone()
            if row is not None and row[0]:
                cursor.execute(f"DROP INDEX CONCURRENTLY {name}")

    return migrations.RunPython(run, run)


class Migration(migrations.Migration):
    atomic = False  # CREATE / DROP INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("payments", "0013_order_owner_backfill")]

    operations = [
        drop_if_invalid("payments_op_unfinished"),
        AddIndexConcurrently(
            model_name="operation",
            index=models.Index(
                fields=["state", "next_attempt_at"],
                name="payments_op_unfinished",
                condition=Q(state__in=UNFINISHED),
            ),
        ),
        drop_if_invalid("payments_op_failed"),
        AddIndexConcurrently(
            model_name="operation",
            index=models.Index(
                fields=["updated_at"], name="payments_op_failed", condition=Q(state="failed")
            ),
        ),
        drop_if_invalid("payments_claim_unsettled"),
        AddIndexConcurrently(
            model_name="stepclaim",
            index=models.Index(
                fields=["claimed_at"],
                name="payments_claim_unsettled",
                condition=Q(state__in=UNSETTLED),
            ),
        ),
        RemoveIndexConcurrently(model_name="operation", name="payments_op_state_due"),
        drop_if_invalid("payments_op_state_due"),
        RemoveIndexConcurrently(model_name="stepclaim", name="payments_claim_state_age"),
        drop_if_invalid("payments_claim_state_age"),
    ]
