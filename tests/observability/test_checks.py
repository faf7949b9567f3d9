"""System checks: each fires on a bad configuration and stays quiet on the default one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import cast
from urllib.parse import urlsplit

import pytest
from django.conf import settings as django_settings
from django.core.checks import registry
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from redis import Redis
from redis.exceptions import ResponseError

from payments import checks
from payments.conf import PaymentsSettings, payments_settings
from tests.support.config import TEST_REDIS_URL

REAL_SECRETS = {"SECRET_KEY": "k" * 20 + uuid.uuid4().hex * 2, "API_TOKEN": uuid.uuid4().hex}
REDIS_CACHE = "django.core.cache.backends.redis.RedisCache"


def ids(messages) -> list[str]:
    return sorted(m.id for m in messages)


# --- E001-E005: database and the timeout chain ------------------------------------


def test_e001__fires_on_a_database_other_than_postgresql(monkeypatch):
    assert checks.check_database_is_postgresql() == []
    monkeypatch.setattr(connections["default"], "vendor", "sqlite")
    assert ids(checks.check_database_is_postgresql()) == ["payments.E001"]


def test_timeout_chain__quiet_on_the_default_settings():
    assert checks.check_timeout_chain() == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"PROVIDER_CONNECT_TIMEOUT": 10.0, "PROVIDER_READ_TIMEOUT": 25.0}, "payments.E002"),
        ({"CLAIM_LEASE": 20}, "payments.E003"),
        ({"JOB_TIMEOUT": 90, "CLAIM_LEASE": 120}, "payments.E004"),
    ],
)
def test_timeout_chain__names_the_values_when_broken(settings, changes, expected):
    settings.PAYMENTS = {**settings.PAYMENTS, **changes}
    settings.RQ_QUEUES = {
        name: {**config, "DEFAULT_TIMEOUT": payments_settings().job_timeout}
        for name, config in settings.RQ_QUEUES.items()
    }
    messages = [m for m in checks.check_timeout_chain() if m.id == expected]
    assert len(messages) == 1
    for name in ("PROVIDER_CONNECT_TIMEOUT", "JOB_TIMEOUT"):
        assert name in messages[0].msg


def test_e005__fires_when_the_queue_timeout_differs(settings):
    settings.RQ_QUEUES = {"payments": {**settings.RQ_QUEUES["payments"], "DEFAULT_TIMEOUT": 59}}
    assert ids(checks.check_timeout_chain()) == ["payments.E005"]


# --- E006/E007: development secrets with DEBUG off --------------------------------


def test_dev_secrets__registered_as_deploy_security_checks():
    deploy = registry.registry.get_checks(include_deployment_checks=True)
    normal = registry.registry.get_checks(include_deployment_checks=False)
    assert checks.check_no_development_secrets in deploy
    assert checks.check_no_development_secrets not in normal
    assert "security" in checks.check_no_development_secrets.tags


def test_dev_secrets__fire_with_debug_off(settings):
    settings.DEBUG = False
    settings.SECRET_KEY = django_settings.INSECURE_DEV_SECRET_KEY
    settings.API_TOKEN = django_settings.INSECURE_DEV_API_TOKEN
    assert ids(checks.check_no_development_secrets()) == ["payments.E006", "payments.E007"]


def test_dev_secrets__values_from_env_example_count_as_development_values(settings, tmp_path):
    (tmp_path / ".env.example").write_text("# dev\nSECRET_KEY=from-the-example-file\n")
    settings.BASE_DIR = tmp_path
    settings.DEBUG = False
    settings.SECRET_KEY = "from-the-example-file"
    settings.API_TOKEN = REAL_SECRETS["API_TOKEN"]
    assert ids(checks.check_no_development_secrets()) == ["payments.E006"]


def test_dev_secrets__quiet_with_real_secrets_or_in_development(settings):
    settings.DEBUG = False
    settings.SECRET_KEY, settings.API_TOKEN = REAL_SECRETS["SECRET_KEY"], REAL_SECRETS["API_TOKEN"]
    assert checks.check_no_development_secrets() == []
    settings.DEBUG = True
    settings.SECRET_KEY = django_settings.INSECURE_DEV_SECRET_KEY
    assert checks.check_no_development_secrets() == []


# --- W001-W003: the queue Redis must not evict ------------------------------------


@pytest.fixture
def eviction_policy(redis_conn: Redis) -> Iterator[Redis]:
    """Yield the test Redis; put its maxmemory-policy back afterwards.

    CONFIG SET is server-wide, so only a local test Redis is touched, and only
    for the few milliseconds the check takes.
    """
    if urlsplit(TEST_REDIS_URL).hostname not in {"127.0.0.1", "localhost", "::1"}:
        pytest.skip("CONFIG SET is only done on a local test Redis")
    try:
        # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
        config = cast("dict[str, str]", redis_conn.config_get("maxmemory-policy"))
        original = config["maxmemory-policy"]
    except ResponseError:
        pytest.skip("this Redis refuses CONFIG GET")
    try:
        yield redis_conn
    finally:
        redis_conn.config_set("maxmemory-policy", original)


def test_w001__quiet_when_the_queue_redis_does_not_evict(eviction_policy):
    eviction_policy.config_set("maxmemory-policy", "noeviction")
    assert checks.check_queue_redis_does_not_evict() == []


def test_w001__fires_when_the_queue_redis_evicts(eviction_policy):
    eviction_policy.config_set("maxmemory-policy", "allkeys-lru")
    messages = checks.check_queue_redis_does_not_evict()
    eviction_policy.config_set("maxmemory-policy", "noeviction")
    assert ids(messages) == ["payments.W001"]
    assert "allkeys-lru" in messages[0].msg


def test_w002__config_get_refused_is_a_warning_not_a_failure(redis_conn, settings):
    user, password = f"obs-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    # A real refusal: an ACL user that may do anything but CONFIG.
    redis_conn.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-config"
    )
    try:
        url = TEST_REDIS_URL.replace("redis://", f"redis://{user}:{password}@", 1)
        settings.RQ_QUEUES = {"payments": {**settings.RQ_QUEUES["payments"], "URL": url}}
        messages = checks.check_queue_redis_does_not_evict()
    finally:
        redis_conn.execute_command("ACL", "DELUSER", user)
    assert ids(messages) == ["payments.W002"]
    assert password not in messages[0].msg


def test_w003__unreachable_redis_is_said_so(settings, closed_port):
    settings.RQ_QUEUES = {"payments": {"URL": f"redis://127.0.0.1:{closed_port}/0"}}
    messages = checks.check_queue_redis_does_not_evict()
    assert ids(messages) == ["payments.W003"]
    assert "unreachable" in messages[0].msg


def test_redis_checks__registered_as_deploy_checks():
    deploy = registry.registry.get_checks(include_deployment_checks=True)
    normal = registry.registry.get_checks(include_deployment_checks=False)
    assert checks.check_queue_redis_does_not_evict in deploy
    assert checks.check_queue_redis_does_not_evict not in normal
    assert checks.check_redis_roles_do_not_share_keys in normal


# --- W004: cache, sessions and queue key spaces -----------------------------------


def redis_cache(url: str, prefix: str = "") -> dict:
    return {"BACKEND": REDIS_CACHE, "LOCATION": url, "KEY_PREFIX": prefix}


def test_w004__quiet_on_the_default_settings():
    assert checks.check_redis_roles_do_not_share_keys() == []


def test_w004__quiet_when_cache_and_queue_use_separate_databases(settings):
    settings.RQ_QUEUES = {"payments": {"URL": "redis://127.0.0.1:6379/0"}}
    settings.CACHES = {"default": redis_cache("redis://127.0.0.1:6379/1", "c")}
    settings.SESSION_ENGINE = "django.contrib.sessions.backends.cache"
    assert checks.check_redis_roles_do_not_share_keys() == []


def test_w004__fires_when_the_cache_shares_the_queue_database(settings):
    settings.RQ_QUEUES = {"payments": {"URL": "redis://127.0.0.1:6379/0"}}
    settings.CACHES = {"default": redis_cache("redis://127.0.0.1:6379", "shop")}
    messages = checks.check_redis_roles_do_not_share_keys()
    assert ids(messages) == ["payments.W004"]
    assert "cache 'default'" in messages[0].msg and "queue 'payments'" in messages[0].msg


def test_w004__fires_when_sessions_share_the_queue_database(settings):
    settings.RQ_QUEUES = {"payments": {"HOST": "127.0.0.1", "PORT": 6379, "DB": 2}}
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "sessions": redis_cache("redis://127.0.0.1:6379/2"),
    }
    settings.SESSION_ENGINE = "django.contrib.sessions.backends.cached_db"
    settings.SESSION_CACHE_ALIAS = "sessions"
    messages = checks.check_redis_roles_do_not_share_keys()
    assert ids(messages) == ["payments.W004"]
    assert "sessions" in messages[0].msg


def test_w004__two_caches_in_one_database_need_distinct_prefixes(settings):
    settings.RQ_QUEUES = {"payments": {"URL": "redis://127.0.0.1:6379/0"}}
    settings.CACHES = {
        "default": redis_cache("redis://127.0.0.1:6379/3", "shop"),
        "pages": redis_cache("redis://127.0.0.1:6379/3", "shop"),
    }
    assert ids(checks.check_redis_roles_do_not_share_keys()) == ["payments.W004"]
    settings.CACHES = {**settings.CACHES, "pages": redis_cache("redis://127.0.0.1:6379/3", "pg")}
    assert checks.check_redis_roles_do_not_share_keys() == []


# --- E009: the PAYMENTS settings themselves --------------------------------------


def test_payments_settings__defaults_live_in_one_place(settings):
    settings.PAYMENTS = {}
    assert payments_settings() == PaymentsSettings()
    assert checks.check_payments_settings() == []


@pytest.mark.parametrize(
    "bad",
    [
        {"JOB_TIMEOUT": "30"},
        {"MAX_ATTEMPTS": 0},
        {"RETRY_BACKOFF": []},
        {"CLAIM_RETENTION": 86400},  # removed: claims are kept for good
        {"PROVIDER_URL": ""},
    ],
)
def test_payments_settings__a_bad_value_is_error_e009_naming_it(settings, bad):
    settings.PAYMENTS = {**settings.PAYMENTS, **bad}
    with pytest.raises(ImproperlyConfigured, match=next(iter(bad))):
        payments_settings()
    messages = checks.check_payments_settings()
    assert ids(messages) == ["payments.E009"]
    assert next(iter(bad)) in messages[0].msg
    assert checks.check_timeout_chain() == []  # E009 speaks for it


# --- E011: the documented processes fit in PostgreSQL's connections -----------------


def test_e011__registered_as_a_deploy_database_check():
    deploy = registry.registry.get_checks(include_deployment_checks=True)
    normal = registry.registry.get_checks(include_deployment_checks=False)
    assert checks.check_connection_budget in deploy
    assert checks.check_connection_budget not in normal
    assert "database" in checks.check_connection_budget.tags


@pytest.mark.django_db
def test_e011__quiet_on_the_defaults_and_the_production_example(settings):
    assert checks.check_connection_budget(databases=["default"]) == []
    settings.DEPLOY_PROCESSES = {
        "WEB_CONCURRENCY": 4,
        "GUNICORN_THREADS": 2,
        "RQ_WORKERS": 4,
        "RECOVERY_PROCESSES": 1,
        "DB_RESERVED_CONNECTIONS": 5,
    }
    assert checks.check_connection_budget(databases=["default"]) == []
    assert checks.check_connection_budget() == []  # without --database: not asked


@pytest.mark.django_db
def test_e011__fires_when_workers_times_threads_exceed_max_connections(settings):
    with connections["default"].cursor() as cursor:
        cursor.execute("SHOW max_connections")
        max_connections = int(cursor.fetchone()[0])
    settings.DEPLOY_PROCESSES = {
        "WEB_CONCURRENCY": max_connections // 4 + 1,
        "GUNICORN_THREADS": 4,
        "RQ_WORKERS": 1,
        "RECOVERY_PROCESSES": 1,
        "DB_RESERVED_CONNECTIONS": 0,
    }
    messages = checks.check_connection_budget(databases=["default"])
    assert ids(messages) == ["payments.E011"]
    assert f"max_connections {max_connections}" in messages[0].msg


def test_e011__a_forking_worker_counts_twice():
    processes = {"WEB_CONCURRENCY": 2, "GUNICORN_THREADS": 3, "RQ_WORKERS": 4}
    simple = checks.connections_needed(processes, "payments.engine.worker.FenceWorker")
    forking = checks.connections_needed(processes, "rq.worker.Worker")
    assert simple["gunicorn"] == 6 and simple["rqworker"] == 4
    assert forking["rqworker"] == 8


def test_payments_settings__read_once_per_dict__a_new_dict_is_read_at_once(settings):
    first = payments_settings()
    assert payments_settings() is first  # the same dict: not validated again

    settings.PAYMENTS = {**settings.PAYMENTS, "MAX_ATTEMPTS": 9}
    assert payments_settings().max_attempts == 9

    settings.PAYMENTS = {**settings.PAYMENTS, "MAX_ATTEMPTS": 0}
    with pytest.raises(ImproperlyConfigured, match="MAX_ATTEMPTS"):
        payments_settings()


# --- E014, W008: the fence's queue, its queue class and its worker class -----------


def test_w008__quiet_on_this_projects_rq_settings():
    assert checks.check_rq_classes() == []


def test_w008__fires_on_rq_defaults_a_new_project_would_keep(settings):
    """No RQ dict: django-rq's DjangoRQ queue and forking Worker (what a newcomer got)."""
    settings.RQ = {}
    found = checks.check_rq_classes()
    assert ids(found) == ["payments.W008", "payments.W008"]
    assert "MessageQueue" in found[0].hint and "FenceWorker" in found[1].hint


def test_e014__fires_when_the_fences_queue_is_not_configured(settings):
    settings.RQ_QUEUES = {"default": {"URL": TEST_REDIS_URL}}
    assert ids(checks.check_rq_classes()) == ["payments.E014"]


# --- E015: entity models of one name -----------------------------------------------------


def test_e015__quiet_on_this_projects_handlers():
    assert checks.check_entity_names_are_unique() == []


def test_e015__fires_when_two_apps_entity_models_share_a_name(monkeypatch):
    """Two `order` models (the shop's and another app's): an operation's entity_type
    "order" could be either, and the desk would take one for the other."""
    from django.db import models

    from payments.engine import handlers

    class Order(models.Model):  # noqa: DJ008
        class Meta:
            app_label = "inbox"  # another installed app's
            managed = False

    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    handlers.handler("inbox-order", entity=Order)(lambda run: None)

    found = checks.check_entity_names_are_unique()

    assert ids(found) == ["payments.E015"]
    assert "inbox.Order, shop.Order" in found[0].msg


def test_e014__a_project_without_rq_queues__reported_not_a_traceback(settings):
    """Every registered check runs on a project with no RQ_QUEUES at all (a newcomer's
    first `manage.py check`: it died with AttributeError); the fence's queue is E014."""
    del settings.RQ_QUEUES

    found = registry.run_checks(include_deployment_checks=True)

    assert "payments.E014" in ids(found)
