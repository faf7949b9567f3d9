"""Processes of a deploy, started as production starts them: a clean environment, the
settings read from an env file (DJANGO_ENV_FILE), the test database and test Redis."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.config import TEST_CACHE_REDIS_URL, TEST_REDIS_URL

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION_EXAMPLE = ROOT / ".env.production.example"
VENV_BIN = Path(sys.executable).parent


def production_file(tmp_path: Path, *, drop: tuple[str, ...] = (), **values: str) -> Path:
    """A copy of the production example with lines dropped (unset) or values changed."""
    lines = []
    for line in PRODUCTION_EXAMPLE.read_text().splitlines():
        name = line.partition("=")[0].strip()
        if name in drop or name in values:
            continue
        lines.append(line)
    lines += [f"{name}={value}" for name, value in values.items()]
    path = tmp_path / "production.env"
    path.write_text("\n".join(lines) + "\n")
    return path


def process_env(env_file: Path | str, **extra: str) -> dict[str, str]:
    """A clean environment (no developer .env): only PATH, HOME and what the test gives."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DJANGO_ENV_FILE": str(env_file),
        "REDIS_URL": TEST_REDIS_URL,
        "REDIS_CACHE_URL": TEST_CACHE_REDIS_URL,
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


def manage(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout}s")


def stop(process: subprocess.Popen) -> str:
    """Stop a server started with stdout and stderr piped together; return its output."""
    process.terminate()
    try:
        output, _ = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    return output
