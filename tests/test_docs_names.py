"""Every file, module, name, link and management command the docs mention exists.

Docs drift silently: a module is renamed, a command dropped, and README.md
goes on naming the old one. This reads README.md and docs/*.md (and the
comments of project/settings.py, which point readers at files) and fails
naming each mention that no longer resolves:

- a backticked path starting with one of the repository's folders
  (`payments/engine/fence.py`, `docs/operators.md`), relative to the repository root;
- a backticked dotted name under the project's packages (`payments.engine.recovery`,
  `payments.engine.fence.db_now()`), importable as a module or a module's attribute;
  `app.E001` check ids and `app.codename` permissions are checked as such;
- the names a code block imports (`from payments.fence import Run`);
- `manage.py <command>`, in backticks or code blocks: a command Django knows;
- a relative Markdown link (`[design](design.md#giving-up)`), its file and anchor.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.apps import apps
from django.core.management import get_commands

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("payments", "inbox", "project", "devtools")
#: Top-level folders a backticked path may start with (anything else, such as `var/`,
#: is made by a run, or is a URL path).
TOP_FOLDERS = (*PACKAGES, "tests", "docs", "templates", ".ci")
FILE_SUFFIXES = (".py", ".md", ".toml", ".txt", ".ini", ".example", ".html", ".json", ".cfg")

#: Names of the handler API being built in issue 29 (payments.fence); the docs already
#: describe it. The integrator empties this once that work is merged.
NOT_YET: set[str] = set()

#: Dotted spans that name no module or attribute, each with what it is instead.
NOT_PYTHON = {
    "payments.alerts": "a logger (mail_admins)",
}

INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
CHECK_ID = re.compile(r"^[a-z_]+\.[EW]\d{3}$")
IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+([\w\s,()]+?)\s*(?:#.*)?$", re.M)
COMMAND = re.compile(r"manage\.py\s+([a-z_][a-z0-9_]*)")
COMMENT_PATH = re.compile(rf"\b((?:{'|'.join(TOP_FOLDERS)})/[\w./-]*\w)")


def doc_texts() -> Iterator[tuple[Path, str, str]]:
    """(file, prose without code blocks, code blocks) of every doc."""
    for path in DOCS:
        text = path.read_text()
        blocks = "\n".join(FENCE.findall(text))
        yield path, FENCE.sub("", text), blocks


def is_path(span: str) -> bool:
    if any(c in span for c in " <>*{}$") or span.startswith(("/", "http")):
        return False
    if "/" in span:
        return span.split("/", 1)[0] in TOP_FOLDERS
    return False


def path_exists(span: str) -> bool:
    return (ROOT / span.rstrip("/")).exists()


def resolves(name: str) -> bool:
    """Whether `name` is a module, or an attribute (chain) of the longest module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue
            raise
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def permission_names() -> set[str]:
    """`app_label.codename` of every permission the models declare, and the RQ pages' own."""
    from payments.desk.rq_access import MANAGE_QUEUES  # made without a model (post_migrate)

    names = {MANAGE_QUEUES}
    for model in apps.get_models():
        meta = model._meta
        for action in meta.default_permissions:
            names.add(f"{meta.app_label}.{action}_{meta.model_name}")
        for codename, _ in meta.permissions:
            names.add(f"{meta.app_label}.{codename}")
    return names


def dotted_ok(name: str) -> bool:
    if name in NOT_YET or name in NOT_PYTHON:
        return True
    if CHECK_ID.match(name):
        return name.split(".")[0] in PACKAGES
    if name in permission_names():
        return True
    return resolves(name)


def check_name(name: str, kind: str) -> list[str]:
    """[] when `name` resolves, else what to report (an import that breaks on the way too)."""
    try:
        return [] if dotted_ok(name) else [f"{kind} `{name}`"]
    except ImportError as exc:
        return [f"{kind} `{name}` (importing it fails: {exc})"]


def all_commands() -> set[str]:
    """Every management command, the devtools app's included even where it is off."""
    devtools_commands = ROOT / "devtools" / "management" / "commands"
    return set(get_commands()) | {p.stem for p in devtools_commands.glob("*.py")}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if line.startswith("#"):
            slug = github_anchor(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_mentions(path: Path, prose: str, blocks: str) -> list[str]:
    broken = []
    commands = all_commands()
    for span in INLINE.findall(prose):
        span = span.strip()
        if is_path(span):
            if not path_exists(span):
                broken.append(f"path `{span}`")
            continue
        name = span.removesuffix("()")
        if DOTTED.match(name):
            broken += check_name(name, "name")
    for module, names in IMPORT.findall(blocks):
        if not DOTTED.match(module):
            continue
        for imported in re.split(r"[\s,()]+", names):
            if imported:
                broken += check_name(f"{module}.{imported}", "import")
    for command in COMMAND.findall(prose + "\n" + blocks):
        if command not in commands:
            broken.append(f"command `manage.py {command}`")
    for target in LINK.findall(prose):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"link `{target}`")
        elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
            broken.append(f"anchor `{target}`")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_doc_mentions__exists(doc: Path) -> None:
    _, prose, blocks = next(t for t in doc_texts() if t[0] == doc)
    broken = broken_mentions(doc, prose, blocks)
    assert not broken, "mentioned but missing:\n" + "\n".join(broken)


def test_every_path_the_settings_comments_mention__exists() -> None:
    settings_py = ROOT / "project" / "settings.py"
    comments = "\n".join(
        line.split("#", 1)[1] for line in settings_py.read_text().splitlines() if "#" in line
    )
    missing = [p for p in COMMENT_PATH.findall(comments) if not path_exists(p)]
    assert not missing, "project/settings.py's comments name missing paths: " + ", ".join(missing)


def test_the_check__fails_on_a_name_that_does_not_exist(tmp_path: Path) -> None:
    doc = tmp_path / "renamed.md"
    prose = (
        "`payments/engine/no_such_module.py`, `payments.engine.no_such_module`, "
        "`payments.engine.recovery.no_such_function`, `manage.py no_such_command`, "
        "[gone](no_such_file.md), [here](#no-such-heading)\n"
    )
    blocks = "from payments.engine.recovery import no_such_name\n"
    doc.write_text(prose)
    assert broken_mentions(doc, prose, blocks) == [
        "path `payments/engine/no_such_module.py`",
        "name `payments.engine.no_such_module`",
        "name `payments.engine.recovery.no_such_function`",
        "import `payments.engine.recovery.no_such_name`",
        "command `manage.py no_such_command`",
        "link `no_such_file.md`",
        "anchor `#no-such-heading`",
    ]
