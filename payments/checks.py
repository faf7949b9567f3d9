"""System checks of the payments app (run at start-up and by `manage.py check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, register
from django.core.checks import Warning as CheckWarning
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections
from django.utils.module_loading import import_string
from redis import Redis
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.worker import SimpleWorker

from inbox.conf import inbox_settings
from payments.conf import payments_settings
from payments.engine import systems
from payments.engine.handlers import entity_models, registered_handlers, unknown_recorded_names
from payments.engine.queues import PROBE_TIMEOUT, redis_client
from payments.exceptions import ConfigurationError

#: RQ redelivers an abandoned job 60-90 s after its worker died; an orphaned
#: work horse must be dead by then, so a job may not run longer than this.
MAX_JOB_TIMEOUT = 60


def _rq_queues() -> dict[str, Any]:
    """django-rq's RQ_QUEUES, or none: a project without it gets payments.E014, not a
    traceback from every check that reads it."""
    return getattr(settings, "RQ_QUEUES", None) or {}


@register(Tags.database)
def check_database_is_postgresql(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """The fence relies on PostgreSQL's unique-constraint and row-locking semantics."""
    vendor = connections["default"].vendor
    if vendor != "postgresql":
        return [
            Error(
                f"The default database is {vendor}; the payment fence needs PostgreSQL.",
                hint="Set DATABASE_URL to a postgres:// URL.",
                id="payments.E001",
            )
        ]
    return []


@register()
def check_payments_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """PAYMENTS has only known keys, each of the right type and range."""
    try:
        payments_settings()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), hint="docs/settings.md documents every key.", id="payments.E009")]
    return []


@register()
def check_timeout_chain(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """HTTP connect+read timeout < job timeout <= claim lease, and job timeout <= 60 s."""
    try:
        conf = payments_settings()
    except ImproperlyConfigured:
        return []  # payments.E009 reports it
    connect = conf.provider_connect_timeout
    read = conf.provider_read_timeout
    job = conf.job_timeout
    lease = conf.claim_lease
    values = (
        f"PROVIDER_CONNECT_TIMEOUT={connect:g}s, PROVIDER_READ_TIMEOUT={read:g}s, "
        f"JOB_TIMEOUT={job}s, CLAIM_LEASE={lease}s"
    )
    errors = []
    if not connect + read < job:
        errors.append(
            Error(
                f"The provider call can outlive its job: connect+read {connect + read:g}s "
                f">= job timeout {job}s ({values}).",
                hint="Lower the HTTP timeouts or raise JOB_TIMEOUT.",
                id="payments.E002",
            )
        )
    if not job <= lease:
        errors.append(
            Error(
                f"A claim's lease ends before its job's timeout ({values}): another worker "
                "could take over a claim whose call is still running.",
                hint="Set CLAIM_LEASE >= JOB_TIMEOUT.",
                id="payments.E003",
            )
        )
    if job > MAX_JOB_TIMEOUT:
        errors.append(
            Error(
                f"JOB_TIMEOUT={job}s exceeds {MAX_JOB_TIMEOUT}s: an orphaned work horse could "
                f"still be running when RQ redelivers its job ({values}).",
                hint=f"Keep JOB_TIMEOUT <= {MAX_JOB_TIMEOUT}.",
                id="payments.E004",
            )
        )
    queue = _rq_queues().get(conf.queue, {})
    if queue.get("DEFAULT_TIMEOUT") not in (None, job):
        errors.append(
            Error(
                f"RQ_QUEUES default timeout {queue.get('DEFAULT_TIMEOUT')}s differs from "
                f"JOB_TIMEOUT={job}s.",
                hint="Derive both from JOB_TIMEOUT.",
                id="payments.E005",
            )
        )
    return errors


@register()
def check_retention(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The fence keeps a finished operation's history past every horizon that reads it."""
    try:
        conf = payments_settings()
    except ImproperlyConfigured:
        return []  # payments.E009 reports it
    kept = conf.retention_days * 86400
    found: list[CheckMessage] = []
    if kept <= conf.provider_key_retention + conf.reconcile_grace:
        found.append(
            Error(
                f"RETENTION_DAYS={conf.retention_days} does not outlast the provider's "
                f"idempotency keys ({conf.provider_key_retention}s) and the reconcile grace "
                f"({conf.reconcile_grace}s): a purged claim's key could still be replayed.",
                hint="Keep RETENTION_DAYS well past PROVIDER_KEY_RETENTION (default 400).",
                id="payments.E012",
            )
        )
    # RQ keeps a failed job (which can be requeued by hand) for the inbox's redelivery
    # horizon (RQ_FAILURE_TTL; RQ's own default is a year).
    try:
        horizon = inbox_settings().redelivery_horizon.total_seconds()
    except ImproperlyConfigured:
        horizon = 0  # inbox.E001 reports it
    if kept <= horizon:
        found.append(
            CheckWarning(
                f"RETENTION_DAYS={conf.retention_days} is within RQ's failed-job retention "
                f"({horizon / 86400:g} days): a failed job requeued by hand may find its "
                "operation's claims and audit rows purged (it does nothing: the operation "
                "is final), and the operator cannot read why it failed.",
                hint="Keep RETENTION_DAYS above RQ_FAILURE_TTL (default 400 days).",
                id="payments.W007",
            )
        )
    return found


# --- deployment: secrets, Redis, retention ---------------------------------------

#: The variables whose development value must never reach production, with their check ids.
DEPLOY_SECRETS = {"SECRET_KEY": "payments.E006", "API_TOKEN": "payments.E007"}


def _example_values(name: str) -> set[str]:
    """Return the values `.env.example` gives `name`: development values, never secrets."""
    path = Path(getattr(settings, "BASE_DIR", ".")) / ".env.example"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return set()
    values = set()
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.strip() == name and value.strip():
            values.add(value.strip().strip("'\""))
    return values


@register(Tags.security, deploy=True)
def check_no_development_secrets(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """With DEBUG off, SECRET_KEY and API_TOKEN must not be the development values."""
    if settings.DEBUG:
        return []
    errors: list[CheckMessage] = []
    for name, check_id in DEPLOY_SECRETS.items():
        known = {getattr(settings, f"INSECURE_DEV_{name}", None), *_example_values(name)}
        known.discard(None)
        if getattr(settings, name, None) in known:
            errors.append(
                Error(
                    f"{name} is a development default while DEBUG is off.",
                    hint=f"Set a long random {name} in the environment of this deployment.",
                    obj=f"settings.{name}",
                    id=check_id,
                )
            )
    return errors


def _redis_endpoints() -> dict[str, Redis]:
    """Return one client per distinct queue Redis (by its connection settings)."""
    seen: dict[str, Redis] = {}
    for name, config in _rq_queues().items():
        where = _location_of_queue(config)
        label = f"{where[0]}:{where[1]}/{where[2]}" if where else name
        if label not in seen:
            seen[label] = redis_client(name, timeout=PROBE_TIMEOUT)
    return seen


@register("payments", deploy=True)
def check_queue_redis_does_not_evict(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The queue's Redis must run `maxmemory-policy noeviction`, or jobs can vanish."""
    messages: list[CheckMessage] = []
    for label, client in _redis_endpoints().items():
        try:
            # A sync client: redis-py's annotations also allow the asyncio client's Awaitable.
            config = cast("dict[str, Any]", client.config_get("maxmemory-policy"))
            policy = config.get("maxmemory-policy")
        except (RedisConnectionError, RedisTimeoutError) as exc:
            messages.append(
                CheckWarning(
                    f"The queue Redis at {label} is unreachable ({type(exc).__name__}); its "
                    "maxmemory-policy could not be checked.",
                    hint="Run the check where Redis is reachable, or check the policy by hand.",
                    id="payments.W003",
                )
            )
            continue
        except ResponseError as exc:  # CONFIG is often renamed or refused on managed Redis
            messages.append(
                CheckWarning(
                    f"The queue Redis at {label} refused CONFIG GET maxmemory-policy "
                    f"({str(exc)[:100]}); its eviction policy could not be checked.",
                    hint="Confirm with your Redis provider that the policy is noeviction.",
                    id="payments.W002",
                )
            )
            continue
        finally:
            client.close()
        if policy != "noeviction":
            messages.append(
                CheckWarning(
                    f"The queue Redis at {label} has maxmemory-policy {policy!r}: under memory "
                    "pressure it can evict queued jobs and their registries.",
                    hint="Set maxmemory-policy noeviction on the queue's Redis "
                    "(CONFIG SET or redis.conf).",
                    id="payments.W001",
                )
            )
    return messages


def _location(url: str, db: Any = None) -> tuple[str, Any, int] | None:
    """Return (host or socket, port, db) of a Redis URL, or None when it is not one."""
    try:
        kwargs = parse_url(url)
    except ValueError:
        return None
    where = kwargs.get("path") or kwargs.get("host") or "localhost"
    number = db if db is not None else kwargs.get("db", 0)
    return (str(where), kwargs.get("port", 6379), int(number or 0))


def _location_of_queue(config: dict[str, Any]) -> tuple[str, Any, int] | None:
    if "URL" in config:
        return _location(config["URL"], config.get("DB"))
    if "USE_REDIS_CACHE" in config:
        return _location_of_cache(config["USE_REDIS_CACHE"])
    if "HOST" in config or "UNIX_SOCKET_PATH" in config:
        where = config.get("UNIX_SOCKET_PATH") or config.get("HOST")
        return (str(where), config.get("PORT", 6379), int(config.get("DB", 0) or 0))
    return None


def _location_of_cache(alias: str) -> tuple[str, Any, int] | None:
    cache = settings.CACHES.get(alias, {})
    if "redis" not in str(cache.get("BACKEND", "")).lower():
        return None
    location = cache.get("LOCATION")
    if isinstance(location, list | tuple):
        location = location[0] if location else None
    if isinstance(location, str):
        location = location.split(",")[0].strip()  # the first server is the one written to
    return _location(location) if location else None


@register("payments")
def check_redis_roles_do_not_share_keys(
    app_configs: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Cache, sessions and the queue must not share a Redis database's key space.

    Two caches in one database need distinct KEY_PREFIXes. A cache beside the
    queue is never safe: `cache.clear()` runs FLUSHDB, which ignores prefixes,
    and a cache's eviction policy would evict jobs.
    """
    roles: list[tuple[str, tuple[str, Any, int], str | None]] = []  # (role, where, prefix)
    cache_aliases = {alias: f"cache {alias!r}" for alias in settings.CACHES}
    engine = getattr(settings, "SESSION_ENGINE", "")
    if engine.endswith((".cache", ".cached_db")):
        alias = getattr(settings, "SESSION_CACHE_ALIAS", "default")
        if alias in cache_aliases:
            cache_aliases[alias] += " (also sessions)"
    for alias, role in cache_aliases.items():
        where = _location_of_cache(alias)
        if where is not None:
            roles.append((role, where, str(settings.CACHES[alias].get("KEY_PREFIX", ""))))
    for name, config in _rq_queues().items():
        where = _location_of_queue(config)
        if where is not None:
            roles.append((f"queue {name!r}", where, None))  # None: RQ's fixed "rq:" prefix

    messages: list[CheckMessage] = []
    for i, (role_a, where_a, prefix_a) in enumerate(roles):
        for role_b, where_b, prefix_b in roles[i + 1 :]:
            if where_a != where_b:
                continue
            if prefix_a is None and prefix_b is None:
                continue  # two queues in one database are one RQ key space by design
            if prefix_a is not None and prefix_b is not None and prefix_a != prefix_b:
                continue
            messages.append(
                CheckWarning(
                    f"{role_a} and {role_b} share Redis database {where_a[0]}:{where_a[1]}/"
                    f"{where_a[2]} without distinct key prefixes.",
                    hint="Give the queue its own Redis database (or server); give caches "
                    "distinct KEY_PREFIXes. A cache's clear() flushes the whole database.",
                    id="payments.W004",
                )
            )
    return messages


@register(Tags.database)
def check_recorded_names_are_registered(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Kinds and step names on unfinished operations must be known to the registered handlers."""
    if not databases:
        return []
    try:
        problems = unknown_recorded_names()
    except DatabaseError:  # no table yet (before migrate): nothing is in flight
        return []
    return [
        Error(
            f"{problem}, but no registered handler declares it.",
            hint="Its handler was not found at start-up (its app is not in INSTALLED_APPS, "
            "or the handler is not in the app's handler.py nor in a module of "
            "PAYMENTS['HANDLER_MODULES']), or it was renamed: a renamed kind or step derives "
            "new idempotency keys for steps that already ran, so deploy a rename only once no "
            "operation that recorded the old name is unfinished, or keep the old name.",
            id="payments.E010",
        )
        for problem in problems
    ]


@register()
def check_rq_classes(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The fence's queue is an inbox MessageQueue and its workers are FenceWorkers."""
    from django_rq.queues import get_queue_class
    from django_rq.workers import get_worker_class

    try:
        name = payments_settings().queue
    except ImproperlyConfigured:
        return []  # payments.E009 reports it
    config = _rq_queues().get(name)
    if config is None:
        return [
            Error(
                f"RQ_QUEUES has no {name!r} queue, the one the fence's jobs go through "
                "(PAYMENTS['QUEUE']).",
                hint=f"Add RQ_QUEUES[{name!r}] = {{'URL': 'redis://...', 'DEFAULT_TIMEOUT': 30}}.",
                id="payments.E014",
            )
        ]
    from inbox.queues import MessageQueue
    from payments.engine.worker import FenceWorker

    found: list[CheckMessage] = []
    try:
        queue_class = get_queue_class(config)
        worker_class = get_worker_class()
    except Exception as exc:  # a class path that does not import
        return [Error(f"RQ's queue or worker class cannot be loaded: {exc}", id="payments.E014")]
    if not issubclass(queue_class, MessageQueue):
        found.append(
            CheckWarning(
                f"The {name!r} queue's class is {queue_class.__module__}."
                f"{queue_class.__name__}, not inbox.queues.MessageQueue: jobs carry no message "
                "id, and the inbox cannot tell a redelivered follow-up from a new one.",
                hint="Set RQ['QUEUE_CLASS'] = 'inbox.queues.MessageQueue' (docs/install.md).",
                id="payments.W008",
            )
        )
    if not issubclass(worker_class, FenceWorker):
        found.append(
            CheckWarning(
                f"RQ's worker class is {worker_class.__module__}.{worker_class.__name__}, not "
                "payments.engine.worker.FenceWorker: `rqworker` starts workers that skip the "
                "fence's start-up refusals (migrations not applied, unknown operation kinds) "
                "and its database health checks.",
                hint="Set RQ['WORKER_CLASS'] = 'payments.engine.worker.FenceWorker' "
                "(docs/install.md); a worker started with --worker-class is not concerned.",
                id="payments.W008",
            )
        )
    return found


@register()
def check_external_systems(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Each configured system is declared, and each declared one an effect calls is configured."""
    try:
        conf = payments_settings()
    except ImproperlyConfigured:
        return []  # payments.E009 reports it
    declared = {system.name for system in systems.declared()}
    found: list[CheckMessage] = []
    for name, _ in conf.systems:
        if name not in declared:
            found.append(
                Error(
                    f"PAYMENTS['SYSTEMS'][{name!r}] configures a system no installed package "
                    f"declares (declared: {', '.join(sorted(declared)) or 'none'}).",
                    hint="Check the name against the package's declare_system(...), or remove "
                    "the entry.",
                    id="payments.E013",
                )
            )
    used: dict[str, str] = {}
    for kind, spec in sorted(registered_handlers().items()):
        for step, effect in spec.effects.items():
            try:
                system = systems.system_of(effect)
            except ConfigurationError as exc:
                found.append(Error(f"{kind}/{step}: {exc}", id="payments.E013"))
                continue
            used.setdefault(system.name, f"{kind}/{step}")
    for name, where in sorted(used.items()):
        if name != systems.DEFAULT_SYSTEM and conf.system(name) is None:
            found.append(
                Error(
                    f"{where} calls the external system {name!r}, which PAYMENTS['SYSTEMS'] "
                    "does not configure.",
                    hint=f"Add PAYMENTS['SYSTEMS'][{name!r}] with its URL and API_KEY "
                    "(docs/handlers.md, 'An external system in your own project').",
                    id="payments.E013",
                )
            )
    return found


# --- deployment: PostgreSQL connections of the documented process counts ------------


def connections_needed(processes: dict[str, int], worker_class: str) -> dict[str, int]:
    """Return each process kind's most simultaneous PostgreSQL connections.

    Django holds at most one connection per thread: a gunicorn worker has
    GUNICORN_THREADS of them; an RQ worker one, two when it forks a work horse
    per job (the horse opens its own); the recovery loop one. The reserve is
    for migrate, shell and cron commands run beside them.
    """
    try:
        forks = not issubclass(import_string(worker_class), SimpleWorker)
    except ImportError:
        forks = True  # count the larger
    return {
        "gunicorn": processes.get("WEB_CONCURRENCY", 0) * processes.get("GUNICORN_THREADS", 1),
        "rqworker": processes.get("RQ_WORKERS", 0) * (2 if forks else 1),
        "run_recovery": processes.get("RECOVERY_PROCESSES", 0),
        "reserve": processes.get("DB_RESERVED_CONNECTIONS", 0),
    }


@register(Tags.database, deploy=True)
def check_connection_budget(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The documented process counts must fit in PostgreSQL's max_connections.

    Runs with `check --deploy --database default` (it asks the server).
    """
    processes = getattr(settings, "DEPLOY_PROCESSES", None)
    if not databases or "default" not in databases or not processes:
        return []
    if getattr(settings, "DATABASE_POOLING", "") == "transaction":
        # The processes' connections end at PgBouncer (its max_client_conn); PostgreSQL
        # sees PgBouncer's pools (default_pool_size per database and user): docs/deployment.md, Topology.
        return []
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('max_connections')::int, "
                "current_setting('superuser_reserved_connections')::int"
            )
            max_connections, superuser_reserved = cursor.fetchone()
    except DatabaseError as exc:
        return [
            CheckWarning(
                f"Could not read PostgreSQL's max_connections ({type(exc).__name__}).",
                id="payments.W005",
            )
        ]
    worker_class = str(getattr(settings, "RQ", {}).get("WORKER_CLASS", "rq.worker.Worker"))
    needed = connections_needed(processes, worker_class)
    available = max_connections - superuser_reserved
    if sum(needed.values()) <= available:
        return []
    sums = " + ".join(f"{kind} {count}" for kind, count in needed.items())
    return [
        Error(
            f"The deploy's processes may open {sum(needed.values())} PostgreSQL connections "
            f"({sums}), more than the {available} the server allows (max_connections "
            f"{max_connections} - superuser_reserved_connections {superuser_reserved}).",
            hint="Lower WEB_CONCURRENCY, GUNICORN_THREADS or RQ_WORKERS, or raise "
            "max_connections; see docs/deployment.md, Production.",
            obj="settings.DEPLOY_PROCESSES",
            id="payments.E011",
        )
    ]


# --- PgBouncer in transaction pooling: nothing may live in a session -----------------


def transaction_pooling_hazards(database: dict[str, Any]) -> list[str]:
    """Return what in one DATABASES entry breaks under transaction pooling (empty: safe).

    Each transaction may run on another PostgreSQL session: a WITH HOLD cursor
    (QuerySet.iterator() with server-side cursors on) or a prepared statement
    left in one session is missing, or someone else's, in the next. A kept
    connection (CONN_MAX_AGE) must be health-checked, or every one of them fails
    its first query after a PgBouncer restart.
    """
    hazards = []
    if not database.get("DISABLE_SERVER_SIDE_CURSORS"):
        hazards.append(
            "DISABLE_SERVER_SIDE_CURSORS is off (QuerySet.iterator() keeps a cursor in the session)"
        )
    threshold = database.get("OPTIONS", {}).get("prepare_threshold")
    if threshold is not None:
        hazards.append(
            f"OPTIONS['prepare_threshold'] is {threshold!r} (psycopg prepares statements in "
            "the session; None keeps them off)"
        )
    if database.get("CONN_MAX_AGE", 0) != 0 and not database.get("CONN_HEALTH_CHECKS"):
        hazards.append(
            f"CONN_MAX_AGE is {database.get('CONN_MAX_AGE')!r} without CONN_HEALTH_CHECKS (a "
            "kept connection fails its first query after a PgBouncer restart)"
        )
    return hazards


@register("payments")
def check_transaction_pooling(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """With DATABASE_POOLING=transaction, no PostgreSQL database may keep session state."""
    if getattr(settings, "DATABASE_POOLING", "") != "transaction":
        return []
    messages: list[CheckMessage] = []
    for alias, database in settings.DATABASES.items():
        if "postgresql" not in str(database.get("ENGINE", "")):
            continue
        hazards = transaction_pooling_hazards(database)
        if hazards:
            messages.append(
                CheckWarning(
                    f"DATABASE_POOLING=transaction, but database {alias!r} is unsafe behind a "
                    f"transaction pooler: {'; '.join(hazards)}.",
                    hint="Set DISABLE_SERVER_SIDE_CURSORS = True, OPTIONS['prepare_threshold'] "
                    "= None and CONN_HEALTH_CHECKS = True (project/settings.py does when "
                    "DATABASE_POOLING=transaction); see docs/deployment.md, Topology.",
                    obj=f"settings.DATABASES[{alias!r}]",
                    id="payments.W006",
                )
            )
    return messages


@register()
def check_entity_names_are_unique(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """An operation names its entity by the model's name (`entity_type`): two declared
    entity models of one name in two apps would be taken for each other by the desk (its
    search, its links, the refund's permission and hooks)."""
    by_name: dict[str, set[str]] = {}
    for model in entity_models():
        by_name.setdefault(model._meta.model_name or "", set()).add(model._meta.label)
    return [
        Error(
            f"the entity models {', '.join(sorted(labels))} share the name {name!r}: an "
            "operation's entity_type could be either",
            hint="Declare one of them under another model name (a proxy or a rename), so "
            "that every entity model the handlers declare has a name of its own.",
            id="payments.E015",
        )
        for name, labels in sorted(by_name.items())
        if len(labels) > 1
    ]
