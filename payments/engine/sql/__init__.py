"""The fence's SQL statements by name, read once (at import) from queries.sql.

Each statement is a block of queries.sql under a `-- name --` line, written out
whole: no statement is made by editing another's text. The comment lines right
under the name say what it does; they stay in the file, not in what is sent.

A statement names the fence's tables and constraints by their models, `{Operation}`
or `{Operation.KEY_CONSTRAINT}`, never by a literal `payments_...`: `named` puts
in each model's `_meta.db_table` (or the constraint's name), quoted, once at
import, as inbox.services does for its table.
"""

from __future__ import annotations

import re
from importlib.resources import files

from psycopg.sql import Identifier

from inbox.models import InboxEntry
from payments import models

#: The models a statement may name, and how: `{Model}` or `{Model.CONSTANT}`. The
#: inbox's rows too: a message's handler commits its inbox row with the fence's.
FENCE_MODELS = {
    "Operation": models.Operation,
    "StepClaim": models.StepClaim,
    "OperationEvent": models.OperationEvent,
    "ClaimLook": models.ClaimLook,
    "ProviderEvent": models.ProviderEvent,
    "FenceAuditRun": models.FenceAuditRun,
    "InboxEntry": InboxEntry,
}
_NAMED = re.compile(r"\{(" + "|".join(FENCE_MODELS) + r")(?:\.([A-Z_]+))?\}")

#: A block's first line: `-- name --`.
_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """The statements of a queries file by name (the comments under each name left out).

    A name given twice, or a block without a statement, raises ValueError: a
    file that loads is one whose every name means one statement.
    """
    parts = _HEADER.split(text)
    statements: dict[str, str] = {}
    for name, block in zip(parts[1::2], parts[2::2], strict=True):
        if name in statements:
            raise ValueError(f"queries: {name!r} is named twice")
        lines = block.strip().splitlines()
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        if not lines:
            raise ValueError(f"queries: {name!r} has no statement")
        statements[name] = "\n".join(lines) + "\n"
    return statements


def named(text: str) -> str:
    """`text` with each `{Model}` replaced by the model's table and each
    `{Model.CONSTANT}` by that constraint's name, quoted. Other braces (a
    psycopg.sql template's `{table}`) are left as they are."""

    def name(found: re.Match[str]) -> str:
        model = FENCE_MODELS[found[1]]
        raw = getattr(model, found[2]) if found[2] else model._meta.db_table
        return Identifier(raw).as_string()

    return _NAMED.sub(name, text)


#: Every fence statement, by the name it has in queries.sql, its tables named.
QUERIES: dict[str, str] = {
    name: named(statement)
    for name, statement in parse(files(__name__).joinpath("queries.sql").read_text()).items()
}
