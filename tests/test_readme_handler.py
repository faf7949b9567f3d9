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


def test_own_system_example__is_the_kit_deposit_file_verbatim_and_imports_only_the_api():
    """docs/handlers.md, "An external system in your own project", shows the whole of
    tests/kit/deposits.py (which tests/kit runs through every fence point); it reaches
    the fence through payments.fence alone."""
    text = (ROOT / "docs/handlers.md").read_text()
    section = text.split("## An external system in your own project", 1)[1].split("\n## ", 1)[0]
    shown = [
        b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "@operation(" in b
    ]
    source = (ROOT / "tests/kit/deposits.py").read_text()
    assert shown == [source]
    imported = re.findall(r"^from (payments[\w.]*) import", source, flags=re.M)
    assert imported == ["payments.fence"]
    names = re.search(r"from payments\.fence import \((.*?)\)", source, flags=re.S).group(1)
    assert {n.strip() for n in names.split(",") if n.strip()} <= set(payments.fence.__all__)


def test_an_effects_money_written_as_an_instance_method__refused_when_declared():
    """The desk reads `money` off the effect's class (a done step's recorded result, no
    instance): written as a plain method it passed every step's test and failed the
    operations list with a 500. Declaring the handler refuses it, naming the fix."""
    import pytest

    from payments.fence import ProviderEffect, operation

    class BookPickup(ProviderEffect):
        def money(self, result):  # the natural way, and wrong
            return None

    class Release(ProviderEffect):
        @staticmethod
        def money(result):
            return None

    with pytest.raises(TypeError, match=r"BookPickup\.money is read off the class.*@classmethod"):
        operation("kit_book_pickup", steps={"book": BookPickup})
    assert payments.fence._refuse_instance_methods("release", Release) is None
