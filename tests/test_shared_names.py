"""No external system's name or object shape in shared code (issue 38).

The engine, the desk, the observability, the webhooks plumbing, the API, the
models, the admin and the inbox read each system's declaration
(payments.engine.systems); a system's own package (payments/provider for the
Stripe-compatible provider, one per other system) is where its names live.
This reads the shared modules' code (comments and docstrings aside: they may
cite a system as an example) and fails naming every token that spells one.

What is still there is listed in `NOT_YET` with its count (none left), and the
imports of a system's package (`IMPORTS_NOT_YET`, the provider's webhook
endpoint and a few more): a debt that only shrinks. A file not listed, or more
than its entry, fails; less than its entry fails too, so that the entry is
lowered with the fix.
"""

from __future__ import annotations

import ast
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
    "payments/management",
    "inbox",
    "templates",
)
#: Names of the systems we know and of their objects: Stripe's, Adyen's.
SYSTEM_WORDS = r"stripe|adyen|payment_?intent|psp_?reference"
SYSTEM_NAMES = re.compile(SYSTEM_WORDS, re.IGNORECASE)
#: In a string, their id shapes too (in code, `re_path` is no refund).
SYSTEM_NAMES_IN_TEXT = re.compile(
    SYSTEM_WORDS + r"|\b(pi|re|ch|evt|inv)_[A-Za-z0-9…]", re.IGNORECASE
)
#: The packages of one system: a shared module reaches a system through its declaration.
SYSTEM_PACKAGES = ("payments.provider", "payments.adyen", "payments.invoices")
#: Shared modules that still name one system, and how many tokens: none left.
NOT_YET: dict[str, int] = {}
#: Shared modules that still import one system's package (issue 38 open): the provider's
#: webhook endpoint and its catch-up (its signature, its event object, its list of events),
#: the handler authors' base class and the provider's errors, re-exported by the public
#: API beside the neutral ones (payments.engine.outcomes) they subclass.
IMPORTS_NOT_YET = {
    "payments/fence.py": ["payments.provider.effect", "payments.provider.errors"],
    "payments/management/commands/fence_audit.py": ["payments.provider.errors"],
    "payments/webhooks/handling.py": ["payments.provider.client"],
    "payments/webhooks/sync.py": ["payments.provider.client"],
    "payments/webhooks/views.py": ["payments.provider", "payments.provider.client"],
}


def _code_tokens(path: Path) -> list[tuple[int, str]]:
    """A module's names and string literals (type, text), without comments and docstrings."""
    tokens: list[tuple[int, str]] = []
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
            tokens.append((token.type, token.string))
    return tokens


def _named(token: tuple[int, str]) -> int:
    kind, text = token
    pattern = SYSTEM_NAMES_IN_TEXT if kind == tokenize.STRING else SYSTEM_NAMES
    return len(pattern.findall(text))


def _template_text(path: Path) -> list[tuple[int, str]]:
    """A template's text without its {# comments #}."""
    return [(tokenize.STRING, re.sub(r"\{#.*?#\}", "", path.read_text(), flags=re.DOTALL))]


def _found() -> Counter[str]:
    found: Counter[str] = Counter()
    for shared in SHARED:
        base = ROOT / shared
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in files:
            if "migrations" in path.parts or path.suffix not in (".py", ".html"):
                continue
            pieces = _code_tokens(path) if path.suffix == ".py" else _template_text(path)
            count = sum(_named(piece) for piece in pieces)
            if count:
                found[str(path.relative_to(ROOT))] = count
    return found


def test_shared_code_names_no_external_system():
    found = _found()

    grown = {f: n for f, n in found.items() if n > NOT_YET.get(f, 0)}
    shrunk = {f: found.get(f, 0) for f, n in NOT_YET.items() if found.get(f, 0) < n}
    assert not grown, f"a system's name in shared code (read its declaration instead): {grown}"
    assert not shrunk, f"fewer names than NOT_YET says: lower its entries to {shrunk}"


def _imports() -> dict[str, list[str]]:
    """Each shared module's imports of a system's package."""
    found: dict[str, list[str]] = {}
    for shared in SHARED:
        base = ROOT / shared
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for path in files:
            if "migrations" in path.parts or path.suffix != ".py":
                continue
            names = sorted(
                {
                    node.module or ""
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom)
                }
                | {
                    alias.name
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Import)
                    for alias in node.names
                }
            )
            mine = [n for n in names if n.startswith(SYSTEM_PACKAGES)]
            if mine:
                found[str(path.relative_to(ROOT))] = mine
    return found


def test_shared_code_imports_no_systems_package_beyond_its_listed_debt():
    found = _imports()

    grown = {f: n for f, n in found.items() if not set(n) <= set(IMPORTS_NOT_YET.get(f, []))}
    assert not grown, f"a system's package imported by shared code: {grown}"
    paid = {f: n for f, n in IMPORTS_NOT_YET.items() if set(n) - set(found.get(f, []))}
    assert not paid, f"fewer imports than IMPORTS_NOT_YET says: lower its entries to {found}"


def test_the_scan_sees_a_name_in_code_and_not_in_a_comment(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Stripe in a docstring."""\n# pi_123 in a comment\nKIND = "payment_intent"\n'
        'ID = "pi_3Nx"\nurls = re_path\n'
    )

    named = [token for token in _code_tokens(module) if _named(token)]

    assert [text for _, text in named] == ['"payment_intent"', '"pi_3Nx"']
