"""The wheel, built once per session by pip from a copy of its sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = ("payments", "inbox")


@pytest.fixture(scope="session")
def wheel_path(tmp_path_factory) -> Path:
    """`pip wheel` of the repository's pyproject.toml, README and apps, copied first:
    the build writes build/ and *.egg-info beside its sources."""
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "src"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for app in APPS:
        shutil.copytree(ROOT / app, tree / app, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "-q", "-w", str(work)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (built,) = work.glob("*.whl")
    return built
