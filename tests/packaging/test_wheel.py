"""`pip wheel .` builds the fence and the inbox, and nothing else (pyproject.toml).

Built from a copy of what the wheel is made of (the build writes build/ and
*.egg-info beside its sources), with pip and build isolation, as a project
installing the repository would.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.packaging.conftest import APPS, ROOT


def sources(app: str) -> set[str]:
    """Every file of an app the wheel must carry: code, SQL, templates."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / app).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel(wheel_path: Path) -> zipfile.ZipFile:
    return zipfile.ZipFile(wheel_path)


def test_the_wheel_carries_every_file_of_the_fence_and_the_inbox(wheel):
    names = set(wheel.namelist())
    for app in APPS:
        missing = sources(app) - names
        assert not missing, sorted(missing)[:10]
    assert "payments/engine/sql/queries.sql" in names
    assert "payments/templates/admin/payments/operation/change_form.html" in names


def test_the_wheel_carries_nothing_of_the_tools_the_tests_or_this_project(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == set(APPS)


def test_the_wheel_names_its_runtime_dependencies_and_not_the_tools(wheel):
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    requires = [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    for needed in ("Django", "django-rq", "rq", "psycopg", "djangorestframework"):
        assert any(r.startswith(needed) for r in requires), requires
    # The test kit's runner comes only with the `testing` extra, the tools never.
    runtime = [r for r in requires if "extra ==" not in r]
    for tool in ("pytest", "dbos", "stripe", "playwright"):
        assert not any(r.lower().startswith(tool) for r in runtime), requires
    testing = [r.split(";")[0].strip() for r in requires if 'extra == "testing"' in r]
    assert {r.split(">")[0] for r in testing} == {"pytest", "pytest-django"}, requires
