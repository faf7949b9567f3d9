"""The README's handler example is the capture handler, as it runs (tests/captures run it)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import payments.fence
from payments.captures import handler

ROOT = Path(__file__).resolve().parents[1]


def example(path: str) -> str:
    """The page's first Python block that declares an operation (its handler example)."""
    text = (ROOT / path).read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "@operation(" in b]
    assert blocks, f"{path} has no handler example"
    return blocks[0]


def test_readme_example__is_the_capture_handler_verbatim():
    block = example("README.md")
    imports, _, code = block.partition("\n\n\n")
    assert code.strip() in inspect.getsource(handler)
    names = re.match(r"from payments\.fence import (.*)", imports).group(1).split(", ")
    assert set(names) <= set(payments.fence.__all__)


def test_handlers_doc_example__is_the_readme_example():
    assert example("docs/handlers.md") == example("README.md")
