"""Shared fixtures: real PostgreSQL (pytest-django's test database), real Redis, a real
HTTP fake provider (from its plugin, devtools/fake_provider/pytest_plugin.py). Redis
tests use their own database, flushed around each test.

Helpers (builders, flows, workers, users...) live in tests/support/; fixtures live in
the conftest.py of the folder that needs them, here when more than one folder does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, cast

import django_rq
import pytest
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.test import Client
from redis import Redis
from rq.queue import Queue

from inbox.queues import MessageQueue
from tests.support.api import API_TOKEN, api_client
from tests.support.config import TEST_REDIS_URL
from tests.support.inbox_jobs import EFFECT_TABLE, QUEUE_NAME, SEEN_KEY, Effects

# Import helpers from tests.support; this name stays only for modules not yet moved over.
from tests.support.workers import run_worker  # noqa: F401  (tests/engine/test_fence_edges.py)

# The fake provider's fixtures, `fake_provider` and `provider`: see the plugin's docstring.
pytest_plugins = ["devtools.fake_provider.pytest_plugin"]

# Most tests drive the follow-ups' queued path (each its own operation, delivered behind
# the inbox), the path a follow-up takes when it cannot run inline; the inline path (the
# default: the checkout's ledger line and sales counter in mark_paid's transaction) is
# driven by tests/checkout/test_inline_follow_ups.py and the chaos run. Worker processes
# inherit the variable.
os.environ["PAYMENTS_INLINE_FOLLOW_UPS"] = "false"
settings.PAYMENTS = {**settings.PAYMENTS, "INLINE_FOLLOW_UPS": False}

# Point every queue at the test Redis database before anything creates a queue.
for _config in settings.RQ_QUEUES.values():
    _config["URL"] = TEST_REDIS_URL

# Production's password hasher costs most of a second per user on a busy 2-core machine, and
# the desk's tests create several users each; no test is about the hasher.
settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# --- Tiers (Makefile: `make test-fast` runs the tests none of these marks) ---------------

TESTS = Path(__file__).resolve().parent

#: The tier mark of the test modules a pattern (fnmatch, relative to tests/) matches: a test
#: added to one of these folders, or a new bench module, joins its tier. The marks are
#: registered in pyproject.toml; a module no pattern matches is in the fast tier.
TIERS = {
    "browser/*": "browser",  # headless Chromium
    "topology/*": "topology",  # PgBouncer, Redis Sentinel, a PostgreSQL cluster of its own
    "crash/*": "crash",  # real workers SIGKILLed, the chaos run
    "*/test_*_crash.py": "crash",  # a system's own kills (adyen/, invoices/, captures/)
    "devtools/test_bench_*": "bench",  # make bench's figures; valgrind's instruction count
    "api/test_fuzz.py": "slow",  # schemathesis: every operation, then 100 stateful chains
    "engine/test_properties.py": "slow",  # a Hypothesis state machine over real workers
    "hardening/test_serving.py": "slow",  # real gunicorn and runserver processes
    "packaging/*": "slow",  # pip builds the wheel; a fresh project installs it
}


def tier_of(path: Path) -> str | None:
    """Return the tier mark of a test module of tests/, or None (the fast tier)."""
    module = path.relative_to(TESTS).as_posix()
    return next((tier for pattern, tier in TIERS.items() if fnmatch(module, pattern)), None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)


@pytest.fixture
def redis_conn() -> Iterator[Redis]:
    conn = Redis.from_url(TEST_REDIS_URL)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture
def queue(redis_conn: Redis) -> Queue:
    """The payments queue (tests/inbox/ overrides it with the inbox test queue)."""
    return django_rq.get_queue("payments")


# --- The database backend ---------------------------------------------------------------

#: The backends a round-trip count is asserted on: Django's own (the default) and the
#: opt-in project.postgresql (DATABASE_BEGIN_WITH_FIRST_STATEMENT=1).
STOCK, BEGIN_WITH_FIRST_STATEMENT = "stock", "begin_with_first_statement"


#: Each backend's ENGINE.
ENGINES = {
    STOCK: "django.db.backends.postgresql",
    BEGIN_WITH_FIRST_STATEMENT: "project.postgresql",
}


def _on_backend(name: str) -> Iterator[Any]:
    """This thread's default connection on backend `name` until the generator ends (the
    settings' own connection when they chose that backend already)."""
    from django.db.utils import load_backend

    current = connections[DEFAULT_DB_ALIAS]
    engine = ENGINES[name]
    if current.settings_dict["ENGINE"] == engine:
        yield current
        return
    swapped = load_backend(engine).DatabaseWrapper(
        {**current.settings_dict, "ENGINE": engine}, DEFAULT_DB_ALIAS
    )
    connections[DEFAULT_DB_ALIAS] = swapped
    try:
        yield swapped
    finally:
        swapped.close()
        connections[DEFAULT_DB_ALIAS] = current


@pytest.fixture
def begin_with_first_statement() -> Iterator[Any]:
    """This thread's connection on the opt-in backend (project.postgresql) for one test.

    Settings choose the backend once, at start-up: Django's stock one unless
    DATABASE_BEGIN_WITH_FIRST_STATEMENT=1. This swaps this thread's default
    connection for the opt-in backend's (same database), and back after the
    test; other threads keep the settings' one. For `transaction=True` tests (a
    test in a transaction would leave it).
    """
    yield from _on_backend(BEGIN_WITH_FIRST_STATEMENT)


@pytest.fixture(params=[STOCK, BEGIN_WITH_FIRST_STATEMENT])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on each backend, whichever the settings chose; its name."""
    for _ in _on_backend(request.param):
        yield request.param


@pytest.fixture
def api(settings) -> Client:
    """A client of the JSON API, authenticated by settings.API_TOKEN (set for the test)."""
    settings.API_TOKEN = API_TOKEN
    return api_client()


# --- The inbox test queue (tests/inbox/ and tests/crash/) -------------------------------


@pytest.fixture
def inbox_queue(redis_conn: Redis, settings) -> MessageQueue:
    """Return the inbox test queue, built by django-rq from settings like production queues.

    Commit mode "auto": under ``django_db`` the test runs in a transaction
    that never commits, so on_commit enqueues would never happen.
    """
    settings.RQ_QUEUES = {
        **settings.RQ_QUEUES,
        QUEUE_NAME: {"URL": TEST_REDIS_URL, "DEFAULT_TIMEOUT": 30},
    }
    q = django_rq.get_queue(QUEUE_NAME, connection=redis_conn, commit_mode="auto")
    assert isinstance(q, MessageQueue)
    return q


@pytest.fixture
def effects() -> Iterator[Effects]:
    """Create the side table (raw SQL: the inbox app has no test models), drop it after."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {EFFECT_TABLE} "
            "(id bigserial PRIMARY KEY, message_id text, tag text NOT NULL)"
        )
    yield Effects()
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {EFFECT_TABLE}")


@pytest.fixture
def seen(redis_conn: Redis) -> Callable[[], list[dict[str, str]]]:
    """Return a function listing every delivery the handlers noted, in order."""

    def deliveries() -> list[dict[str, str]]:
        # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
        noted = cast("list[bytes]", redis_conn.lrange(SEEN_KEY, 0, -1))
        return [json.loads(item) for item in noted]

    return deliveries


@pytest.fixture(autouse=True)
def _fresh_api_throttles() -> Iterator[None]:
    """The API's rate limits count in the cache: every test starts with none used."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()
