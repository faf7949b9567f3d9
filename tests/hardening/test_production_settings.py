"""Production settings come from the environment: `check --deploy` is clean with the
documented example, and a deploy on development values refuses to start.

Each runs `manage.py` in a process of its own with a clean environment and the
settings read from a copy of `.env.production.example` (DJANGO_ENV_FILE), as a
deploy would; Redis is the test Redis (the deploy check asks its eviction policy).
"""

from __future__ import annotations

import pytest

from tests.hardening.support import PRODUCTION_EXAMPLE, manage, process_env, production_file

CONSOLE = "django.core.mail.backends.console.EmailBackend"
FILES = "django.core.mail.backends.filebased.EmailBackend"


def test_check_deploy__the_production_example_reports_nothing():
    result = manage(
        "check", "--deploy", "--fail-level", "WARNING", env=process_env(PRODUCTION_EXAMPLE)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout
    assert result.stderr == ""


def test_production_example__documents_every_security_setting():
    text = PRODUCTION_EXAMPLE.read_text()
    for name in (
        "DEBUG=0",
        "SECURE_HSTS_SECONDS=",
        "SECURE_SSL_REDIRECT=1",
        "SESSION_COOKIE_SECURE=1",
        "CSRF_COOKIE_SECURE=1",
        "SECURE_PROXY_SSL_HEADER=",
        "CSRF_TRUSTED_ORIGINS=https://",
        "WEB_CONCURRENCY=",
        "STATIC_ROOT=",
    ):
        assert name in text


def test_check_deploy__without_the_https_settings_names_each_warning(tmp_path):
    env_file = production_file(
        tmp_path,
        drop=(
            "SECURE_HSTS_SECONDS",
            "SECURE_HSTS_INCLUDE_SUBDOMAINS",
            "SECURE_HSTS_PRELOAD",
            "SECURE_SSL_REDIRECT",
            "SESSION_COOKIE_SECURE",
            "CSRF_COOKIE_SECURE",
        ),
    )
    result = manage("check", "--deploy", env=process_env(env_file))
    # Secure by default without DEBUG: only HSTS, an explicit opt-in, is missing.
    assert "security.W004" in result.stderr + result.stdout
    for check in ("security.W008", "security.W012", "security.W016"):
        assert check not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": ("PAYMENT_PROVIDER_URL",)}, "PAYMENT_PROVIDER_URL must be set"),
        ({"drop": ("PAYMENT_PROVIDER_API_KEY",)}, "PAYMENT_PROVIDER_API_KEY must be set"),
        ({"API_TOKEN": "a"}, "API_TOKEN is 1 characters"),
        ({"API_TOKEN": "x" * 31}, "API_TOKEN is 31 characters"),
        ({"EMAIL_BACKEND": CONSOLE}, "writes customers' e-mails"),
        ({"EMAIL_BACKEND": FILES}, "writes customers' e-mails"),
    ],
    ids=["no-provider-url", "no-provider-key", "token-1", "token-31", "console-mail", "file-mail"],
)
def test_start_up__refused_without_debug(tmp_path, change, message):
    env_file = production_file(tmp_path, **change)
    result = manage("check", env=process_env(env_file))
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert message in result.stderr


def test_start_up__no_env_file__the_refusal_says_make_env_writes_one(tmp_path):
    """A newcomer's catch: a fresh checkout has no .env, and pytest on one file stopped
    at "SECRET_KEY must be set when DEBUG is off" without saying where it comes from."""
    result = manage("check", env=process_env(tmp_path / ".env"))
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is off" in result.stderr
    assert f"no env file at {tmp_path / '.env'}" in result.stderr
    assert "`make env` writes one" in result.stderr


def test_start_up__the_same_gaps_are_fine_with_debug_on(tmp_path):
    env_file = production_file(
        tmp_path,
        drop=("PAYMENT_PROVIDER_URL", "PAYMENT_PROVIDER_API_KEY", "EMAIL_BACKEND"),
        DEBUG="1",
        API_TOKEN="dev",
    )
    result = manage("check", env=process_env(env_file))
    assert result.returncode == 0, result.stderr


def test_start_up__smtp_is_the_default_backend_without_debug(tmp_path):
    env_file = production_file(tmp_path, drop=("EMAIL_BACKEND",))
    result = manage(
        "shell",
        "-c",
        "from django.conf import settings; print(settings.EMAIL_BACKEND)",
        env=process_env(env_file),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("django.core.mail.backends.smtp.EmailBackend")
