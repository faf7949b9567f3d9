"""A bench's figures table, written into docs/benchmarks.md between its markers.

Each table has its own pair of HTML comments in that page
(`<!-- NAME:begin ... -->` and `<!-- NAME:end -->`); what lies between them
is replaced whole, the rest of the page is left as it is.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

PAGE = Path("docs") / "benchmarks.md"


def page() -> Path:
    """docs/benchmarks.md of this checkout."""
    return Path(settings.BASE_DIR) / PAGE


def write_between_markers(path: Path, name: str, lines: list[str]) -> None:
    """Replace what lies between `name`'s markers in `path` with `lines`.

    Raises ValueError when the page lacks either marker (nothing is written).
    """
    text = path.read_text()
    begin, end = f"<!-- {name}:begin", f"<!-- {name}:end -->"
    start = text.find(begin)
    stop = text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{path} has no {begin} ... {end} markers")
    after_begin = text.index("-->", start) + len("-->")
    path.write_text(text[:after_begin] + "\n" + "\n".join(lines) + "\n" + text[stop:])
