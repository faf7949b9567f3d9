"""The topology settings: DATABASE_POOLING, REDIS_SENTINELS, and what payments.W006 warns of."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from redis.sentinel import SentinelConnectionPool

from payments.checks import check_connection_budget, check_transaction_pooling
from payments.engine.queues import redis_client
from tests.support.workers import ROOT, worker_env

SHOW = """
import json
from django.conf import settings
db = settings.DATABASES["default"]
print(json.dumps({
    "cursors_off": db.get("DISABLE_SERVER_SIDE_CURSORS", False),
    "options": db.get("OPTIONS", {}),
    "conn_max_age": db["CONN_MAX_AGE"],
    "health_checks": db["CONN_HEALTH_CHECKS"],
    "queue": {k: v for k, v in settings.RQ_QUEUES["payments"].items() if k != "PASSWORD"},
}))
"""


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=worker_env("http://127.0.0.1:9", **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_transaction_pooling__settings_from_the_environment_and_no_warning():
    shown = manage(
        "shell", "-c", SHOW, DATABASE_POOLING="transaction", DB_CONN_MAX_AGE="60"
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    database = json.loads(shown.stdout.strip().splitlines()[-1])
    del database["queue"]
    assert database == {
        "cursors_off": True,
        "options": {"prepare_threshold": None},
        "conn_max_age": 60,  # kept: a client slot of PgBouncer, health-checked
        "health_checks": True,
    }
    checked = manage("check", DATABASE_POOLING="transaction", DB_CONN_MAX_AGE="60")
    assert checked.returncode == 0, checked.stderr
    assert "payments.W006" not in checked.stdout + checked.stderr


def test_unknown_pooling_mode__refused_at_start_up():
    refused = manage("check", DATABASE_POOLING="statement")
    assert refused.returncode != 0
    assert "DATABASE_POOLING='statement'" in refused.stderr


def test_sentinels__the_queue_entry_names_them_and_no_url():
    shown = manage(
        "shell",
        "-c",
        SHOW,
        REDIS_SENTINELS="10.0.0.1:26379, 10.0.0.2:26380",
        REDIS_SENTINEL_MASTER="queue",
        REDIS_URL="redis://:secret@ignored:6379/4",
    )
    assert shown.returncode == 0, shown.stderr
    queue = json.loads(shown.stdout.strip().splitlines()[-1])["queue"]
    assert "URL" not in queue  # django-rq would prefer it to the sentinels
    assert queue["SENTINELS"] == [["10.0.0.1", 26379], ["10.0.0.2", 26380]]
    assert (queue["MASTER_NAME"], queue["DB"]) == ("queue", 4)
    refused = manage("check", REDIS_SENTINELS="10.0.0.1")
    assert refused.returncode != 0
    assert "is not host:port" in refused.stderr


def test_sentinel_queue__the_app_client_asks_the_sentinels(settings):
    settings.RQ_QUEUES = {
        "payments": {
            "SENTINELS": [("127.0.0.1", 1)],
            "MASTER_NAME": "queue",
            "DB": 3,
            "DEFAULT_TIMEOUT": 3,
        }
    }
    client = redis_client()
    assert isinstance(client.connection_pool, SentinelConnectionPool)
    assert client.connection_pool.service_name == "queue"
    assert client.connection_pool.connection_kwargs["db"] == 3


# Each test replaces DATABASES with entries the check only reads (no connection is made).
overrides_databases = pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")

SAFE = {
    "ENGINE": "django.db.backends.postgresql",
    "DISABLE_SERVER_SIDE_CURSORS": True,
    "OPTIONS": {"prepare_threshold": None},
    "CONN_MAX_AGE": 60,
    "CONN_HEALTH_CHECKS": True,
}


@overrides_databases
def test_w006__silent_without_transaction_pooling_or_with_safe_settings(settings):
    unsafe = {**SAFE, "DISABLE_SERVER_SIDE_CURSORS": False}
    settings.DATABASE_POOLING = ""
    settings.DATABASES = {"default": unsafe}
    assert check_transaction_pooling() == []
    settings.DATABASE_POOLING = "transaction"
    settings.DATABASES = {"default": SAFE, "sqlite": {"ENGINE": "django.db.backends.sqlite3"}}
    assert check_transaction_pooling() == []


@overrides_databases
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"DISABLE_SERVER_SIDE_CURSORS": False}, "DISABLE_SERVER_SIDE_CURSORS is off"),
        ({"OPTIONS": {"prepare_threshold": 5}}, "OPTIONS['prepare_threshold'] is 5"),
        ({"CONN_HEALTH_CHECKS": False}, "CONN_MAX_AGE is 60 without CONN_HEALTH_CHECKS"),
    ],
)
def test_w006__each_unsafe_setting_is_named(settings, change, named):
    settings.DATABASE_POOLING = "transaction"
    settings.DATABASES = {"default": {**SAFE, **change}}
    (warning,) = check_transaction_pooling()
    assert warning.id == "payments.W006"
    assert named in warning.msg


@pytest.mark.django_db
def test_connection_budget__left_to_pgbouncer_under_transaction_pooling(settings):
    """PostgreSQL sees PgBouncer's pool, not the processes' connections: E011 does not apply."""
    settings.DEPLOY_PROCESSES = {"WEB_CONCURRENCY": 1000, "GUNICORN_THREADS": 1}
    settings.DATABASE_POOLING = ""
    assert [m.id for m in check_connection_budget(databases=["default"])] == ["payments.E011"]
    settings.DATABASE_POOLING = "transaction"
    assert check_connection_budget(databases=["default"]) == []


ENGINE = "from django.db import connections; print(type(connections['default']).__module__)"


def test_database_backend__djangos_own_by_default():
    shown = manage("shell", "-c", ENGINE)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().splitlines()[-1] == "django.db.backends.postgresql.base"


def test_database_backend__begin_with_first_statement__only_when_asked_for():
    shown = manage("shell", "-c", ENGINE, DATABASE_BEGIN_WITH_FIRST_STATEMENT="1")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().splitlines()[-1] == "project.postgresql.base"
