"""No external system's name or object shape in shared code (issue 38).

The engine, the desk, the observability, the webhooks plumbing, the API, the
models, the admin and the inbox read each system's declaration
(payments.engine.systems); a system's own package (payments/provider for the
Stripe-compatible provider, one per other system) is where its names live.
This reads the shared modules' code (comments and docstrings aside: they may
cite a system as an example) and fails naming every token that spells one.

What is still there is listed in `NOT_YET` with its count: a debt that only
shrinks. A file not listed, or a count above its entry, fails; a count below
its entry fails too, so that the entry is lowered with the fix.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = (
    "payments/engine",
    "payments/desk",
    "payments/observability",
    "payments/webhooks",
    "payments/api",
    "payments/models.py",
    "payments/admin.py",
    "payments/checks.py",
    "payments/conf.py",
    "payments/fence.py",
    "inbox",
    "templates",
)
#: Names and id shapes of the systems we know: Stripe's, Adyen's, the accounting API's.
SYSTEM_NAMES = re.compile(
    r"stripe|adyen|payment_?intent|psp_?reference|\b(pi|re|ch|evt|inv)_[A-Za-z0-9…]",
    re.IGNORECASE,
)
#: Shared modules that still name one system, and how many tokens: none left.
NOT_YET: dict[str, int] = {}


def _code_tokens(path: Path) -> list[str]:
    """A module's names and string literals, without its comments and docstrings."""
    tokens: list[str] = []
    before = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL):
            continue
        statement_start = before in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if token.type == tokenize.STRING and statement_start:
            before = token.type  # a docstring, or a bare string statement
            continue
        before = token.type
        if token.type in (tokenize.NAME, tokenize.STRING):
            tokens.append(token.string)
    return tokens


def _template_text(path: Path) -> list[str]:
    """A template's text without its {# comments #}."""
    return [re.sub(r"\{#.*?#\}", "", path.read_text(), flags=re.DOTALL)]


def _found() -> Counter[str]:
    found: Counter[str] = Counter()
    for shared in SHARED:
        base = ROOT / shared
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in files:
            if "migrations" in path.parts or path.suffix not in (".py", ".html"):
                continue
            pieces = _code_tokens(path) if path.suffix == ".py" else _template_text(path)
            count = sum(len(SYSTEM_NAMES.findall(piece)) for piece in pieces)
            if count:
                found[str(path.relative_to(ROOT))] = count
    return found


def test_shared_code_names_no_external_system():
    found = _found()

    grown = {f: n for f, n in found.items() if n > NOT_YET.get(f, 0)}
    shrunk = {f: found.get(f, 0) for f, n in NOT_YET.items() if found.get(f, 0) < n}
    assert not grown, f"a system's name in shared code (read its declaration instead): {grown}"
    assert not shrunk, f"fewer names than NOT_YET says: lower its entries to {shrunk}"


def test_the_scan_sees_a_name_in_code_and_not_in_a_comment(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Stripe in a docstring."""\n# pi_123 in a comment\nKIND = "payment_intent"\n'
    )

    tokens = _code_tokens(module)

    assert [t for t in tokens if SYSTEM_NAMES.search(t)] == ['"payment_intent"']
