"""The fence's SQL: named statements of payments/engine/sql/queries.sql, each written whole.

The loader refuses a file whose names do not each mean one statement; the
fence runs the loaded text itself (no statement made by editing another's);
each statement that returns a model's rows names every column of the model.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest

from inbox.models import InboxEntry
from payments.engine import fence
from payments.engine.sql import QUERIES, named, parse
from payments.models import Operation, OperationState, StepClaim
from tests.support.flows import checkout

WORKER = "worker-q/1"

#: The statements that return one model's rows, by model.
RETURNS = {
    Operation: [
        "create_operation",
        "acquire_lease",
        "release_held_lease",
        "succeed_message",
        "deliver_message",
    ],
    StepClaim: [
        "insert_claim",
        "insert_claim_or_fail",
        "insert_claim_with_lease",
        "withdraw_claim",
        "settle_claim",
        "settle_claim_or_refuse",
    ],
}


def test_parse__statements_by_name__without_the_comments_under_the_name():
    text = "-- file comment\n\n-- one --\n-- what it does\nSELECT 1\n\n-- two --\nSELECT 2\n"

    assert parse(text) == {"one": "SELECT 1\n", "two": "SELECT 2\n"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- one --\nSELECT 1\n-- one --\nSELECT 2\n", "named twice"),
        ("-- one --\n-- only a comment\n\n-- two --\nSELECT 2\n", "has no statement"),
    ],
)
def test_parse__a_name_that_is_not_one_statement__refused(text, error):
    with pytest.raises(ValueError, match=error):
        parse(text)


def test_fence_constants__are_the_files_statements_as_loaded():
    """What the fence runs is the file's text, not a variant made from it."""
    for name in RETURNS[Operation] + RETURNS[StepClaim] + ["record_event", "note_request_sent"]:
        assert getattr(fence, name.upper()) is QUERIES[name], name


@pytest.mark.parametrize(
    ("model", "name"), [(model, name) for model, names in RETURNS.items() for name in names]
)
def test_a_statement_returning_a_models_rows__names_every_column_of_it(model, name):
    """The row becomes an instance by column name; a column a migration adds must be
    added to the statements that return the model (else its instances would lack it)."""
    final_select = QUERIES[name][QUERIES[name].rindex("\nSELECT ") :]

    missing = [
        f.column
        for f in model._meta.concrete_fields
        if not re.search(rf"\b{f.column}\b", final_select)
    ]
    assert missing == []


@pytest.mark.django_db(transaction=True)
def test_release_held_lease__sets_the_fields_given__leaves_the_others(queue):
    """One statement for every combination of fields: those not given keep their value."""
    first = fence.acquire_lease(checkout("q-release").pk, owner=WORKER, seconds=30).operation
    fence.release_held_lease(
        first, OperationState.RETRYING, owner=WORKER, attempts=2, last_error="x", result={"a": 1}
    )
    op = fence.acquire_lease(first.pk, owner=WORKER, seconds=30).operation

    released = fence.release_held_lease(
        op,
        OperationState.RETRYING,
        owner=WORKER,
        reason="again",
        last_error="timeout",
        next_attempt_at=op.created_at + timedelta(minutes=1),
    )

    assert released is not None
    assert (released.state, released.last_error, released.attempts, released.result) == (
        OperationState.RETRYING,
        "timeout",
        2,
        {"a": 1},
    )
    assert released.next_attempt_at == op.created_at + timedelta(minutes=1)
    again = fence.acquire_lease(op.pk, owner=WORKER, seconds=30).operation
    cleared = fence.release_held_lease(again, OperationState.SUCCEEDED, owner=WORKER, result=None)
    assert cleared is not None
    assert (cleared.result, cleared.attempts, cleared.last_error) == (None, 2, "timeout")


#: A fence table or constraint written as a literal, where `{Model}` belongs.
LITERAL_NAME = re.compile(
    r"\bpayments_(operation|stepclaim|operationevent|claimlook|providerevent|fenceauditrun)\b"
    r"|\binbox_inboxentry\b"
)


@pytest.mark.parametrize(
    "path", ["payments/engine/sql/queries.sql", "payments/engine/retention.py"]
)
def test_the_fence_sql__names_no_table_literally(path):
    """Issue 40: the statements name the fence's tables by their models (`{Operation}`),
    so the names come from `_meta` as the inbox's do; no `payments_operation` in the text."""
    text = (Path(__file__).resolve().parents[2] / path).read_text()

    assert LITERAL_NAME.findall(text) == []


def test_named__a_models_table_and_constraint_from_its_meta__other_braces_kept(monkeypatch):
    monkeypatch.setattr(Operation._meta, "db_table", "fence_operation")
    monkeypatch.setattr(StepClaim, "UNIQUE_CONSTRAINT", "fence_claim_uniq")

    text = named("INSERT INTO {Operation} ON CONFLICT ON CONSTRAINT {StepClaim.UNIQUE_CONSTRAINT}")

    assert text == 'INSERT INTO "fence_operation" ON CONFLICT ON CONSTRAINT "fence_claim_uniq"'
    assert named("SELECT {columns} FROM {table}") == "SELECT {columns} FROM {table}"


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("insert_claim", StepClaim),
        ("create_operation", Operation),
        ("deliver_message", InboxEntry),
    ],
)
def test_loaded_statements__carry_the_models_tables(name, model):
    assert f'"{model._meta.db_table}"' in QUERIES[name]
    assert "{" + model.__name__ + "}" not in QUERIES[name]
