"""The web process as deployed and as developed: access lines redacted, admin static files
served with DEBUG off, HTTPS enforced behind the proxy.

Issue 14: runserver's access lines bypassed the redaction filter (`?token=...`
printed raw). Real processes: `manage.py runserver` and gunicorn with
gunicorn.conf.py, on free ports, against the test database and test Redis.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.hardening.support import (
    PRODUCTION_EXAMPLE,
    ROOT,
    VENV_BIN,
    free_port,
    manage,
    process_env,
    stop,
    wait_for_port,
)
from tests.support.workers import database_url

pytestmark = pytest.mark.django_db

HOST = "payments.example.com"  # ALLOWED_HOSTS of the production example


def get(port: int, path: str, **headers: str) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", path, headers=headers)
    response = connection.getresponse()
    response.body = response.read()  # type: ignore[attr-defined]
    connection.close()
    return response


def canary() -> str:
    return f"canary{uuid.uuid4().hex}"


def test_runserver__access_lines_go_through_the_redaction_filter():
    port = free_port()
    env = process_env(
        "",  # no env file: a developer's environment, DEBUG on
        DEBUG="1",
        DATABASE_URL=database_url(),
        SECRET_KEY="dev-secret-for-the-runserver-test",
        API_TOKEN="dev-api-token",
        LOG_FORMAT="json",
    )
    token, password = canary(), canary()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_port(port, server)
        assert get(port, f"/nothere?token={token}").status == 404
        get(port, f"/healthz?password={password}&to=someone@example.com")
        time.sleep(1)  # the server writes an access line after the response has gone
    finally:
        output = stop(server)

    assert token not in output and password not in output and "someone@example.com" not in output
    lines = [line for line in output.splitlines() if '"logger": "django.server"' in line]
    assert any("/nothere?token=[secret]" in line for line in lines), output
    # The 200s and 503s too, not only the 4xx that logging's last resort printed.
    assert any("/healthz?password=[secret]" in line for line in lines), output


@pytest.fixture(scope="module")
def static_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("static")


def test_gunicorn__serves_admin_static_files_with_debug_off_and_redacts_access_lines(
    static_root,
):
    env = process_env(
        PRODUCTION_EXAMPLE,
        DATABASE_URL=database_url(),
        STATIC_ROOT=str(static_root),
        WEB_CONCURRENCY="1",
        GUNICORN_THREADS="2",
    )
    collected = manage("collectstatic", "--noinput", env=env, timeout=300)
    assert collected.returncode == 0, collected.stderr
    assert (static_root / "staticfiles.json").exists()  # hashed names, for good caching

    port = free_port()
    server = subprocess.Popen(
        [str(VENV_BIN / "gunicorn"), "-c", "gunicorn.conf.py", "--bind", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    token = canary()
    behind_proxy = {"Host": HOST, "X-Forwarded-Proto": "https"}
    try:
        wait_for_port(port, server)
        css = get(port, "/static/admin/css/base.css", **behind_proxy)
        assert css.status == 200
        assert b"{" in css.body
        assert get(port, f"/nothere?token={token}", **behind_proxy).status == 404
        # Plain HTTP is sent to HTTPS (the proxy's health probe excepted), with HSTS on HTTPS.
        plain = get(port, "/admin/login/", Host=HOST)
        assert plain.status == 301
        assert plain.getheader("Location", "").startswith(f"https://{HOST}/admin/login/")
        login = get(port, "/admin/login/", **behind_proxy)
        assert login.status == 200
        assert "max-age=31536000" in login.getheader("Strict-Transport-Security", "")
        assert get(port, "/healthz", Host=HOST).status != 301
        time.sleep(1)  # the server writes an access line after the response has gone
    finally:
        output = stop(server)

    assert token not in output
    access = [line for line in output.splitlines() if '"logger": "gunicorn.access"' in line]
    assert any("/nothere?token=[secret]" in line for line in access), output
    assert any("/static/admin/css/base.css" in line for line in access)
