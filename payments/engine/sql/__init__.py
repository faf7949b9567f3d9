"""The fence's SQL statements by name, read once (at import) from queries.sql.

Each statement is a block of queries.sql under a `-- name --` line, written out
whole: no statement is made by editing another's text. The comment lines right
under the name say what it does; they stay in the file, not in what is sent.
"""

from __future__ import annotations

import re
from importlib.resources import files

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


#: Every fence statement, by the name it has in queries.sql.
QUERIES: dict[str, str] = parse(files(__name__).joinpath("queries.sql").read_text())
