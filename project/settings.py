"""Settings, read from the environment in one place (django-environ).

Every variable is documented in docs/deployment.md with its default. A `.env` file in
the project root is read when present (the Makefile writes a development one);
production sets real environment variables and has no `.env`.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured
from redis.connection import parse_url as parse_redis_url

from payments.conf import PaymentsSettings

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
# DJANGO_ENV_FILE names another file to read (e.g. .env.production.example in its
# test); an empty value reads none. Variables already in the environment win.
_ENV_FILE = os.environ.get("DJANGO_ENV_FILE", str(BASE_DIR / ".env"))
if _ENV_FILE:
    environ.Env.read_env(_ENV_FILE)
#: Said beside a refusal when the env file is missing (a fresh checkout before `make env`).
_NO_ENV_FILE = (
    f" There is no env file at {_ENV_FILE}: for development, `make env` writes one"
    " (DEBUG on, development values); a deploy sets these in its environment."
    if _ENV_FILE and not Path(_ENV_FILE).exists()
    else ""
)

DEBUG = env.bool("DEBUG", default=False)


def _secret(name: str, dev_default: str) -> str:
    """Return a secret; only DEBUG may fall back to an insecure development value."""
    value = env.str(name, default="")
    if value:
        return value
    if DEBUG:
        return dev_default
    raise ImproperlyConfigured(f"{name} must be set when DEBUG is off.{_NO_ENV_FILE}")


INSECURE_DEV_SECRET_KEY = "insecure-dev-secret-key-do-not-use-in-production"
INSECURE_DEV_API_TOKEN = "dev-api-token"

SECRET_KEY = _secret("SECRET_KEY", INSECURE_DEV_SECRET_KEY)
API_TOKEN = _secret("API_TOKEN", INSECURE_DEV_API_TOKEN)

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])

INSTALLED_APPS = [
    # django.contrib.admin, with the desk's AdminSite subclass as `admin.site`.
    "payments.apps.DeskAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_rq",
    "rest_framework",
    "rest_framework_api_key",
    "drf_spectacular",
    "inbox",
    "payments",
    # The shop (example): orders, invoices, credit notes, the sales ledger; and its
    # operations, examples of fenced business: each app's handler.py is found at
    # start-up; a project using the fence leaves out those it does not run.
    "payments.shop",
    "payments.checkout",
    "payments.captures",
    "payments.refunds",
    "payments.invoices",
    # Adyen as a second payment system: its notifications table and endpoint.
    "payments.adyen",
    # Creates the payments.manage_queues permission after migrate (no models).
    "payments.desk.rq_access.QueueAccessConfig",
    # Admin login lockout (settings below).
    "axes",
]
# Developer tooling (fake provider, chaos run, bench, local stack): installed only
# with DEBUG on, or when DEVTOOLS=1 says so explicitly. Production never has it.
DEVTOOLS = env.bool("DEVTOOLS", default=DEBUG)
if DEVTOOLS:
    INSTALLED_APPS.append("devtools")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # The admin's static files with DEBUG off (gunicorn serves no files itself).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: turns a locked-out login into its 429 answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

# PostgreSQL only: the fence relies on its unique-constraint and locking semantics.
DATABASES = {
    "default": env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/fence"),
}
# Django's stock PostgreSQL backend. DATABASE_BEGIN_WITH_FIRST_STATEMENT=1 opts in to
# project.postgresql instead: a transaction's BEGIN goes in the round trip of its first
# statement (a few percent of a checkout's round trips). It overrides private methods
# of Django's backend, so it refuses to start on Django or psycopg versions other than
# the ones it was tested with (project/postgresql/base.py, TESTED_VERSIONS).
DATABASE_BEGIN_WITH_FIRST_STATEMENT = env.bool("DATABASE_BEGIN_WITH_FIRST_STATEMENT", default=False)
if DATABASE_BEGIN_WITH_FIRST_STATEMENT:
    if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured(
            "DATABASE_BEGIN_WITH_FIRST_STATEMENT=1 needs a PostgreSQL DATABASE_URL."
        )
    DATABASES["default"]["ENGINE"] = "project.postgresql"
# CONN_MAX_AGE keeps one connection per thread of each process open between
# requests (gunicorn: workers x threads; see docs/deployment.md, "Production", for the sum that
# must stay below PostgreSQL's max_connections, checked by payments.E011). The
# development server starts a thread per request and would keep one connection per
# thread it ever started: it always closes them (0), whatever DB_CONN_MAX_AGE says.
_RUNSERVER = sys.argv[1:2] == ["runserver"]
DATABASES["default"].setdefault(
    "CONN_MAX_AGE", 0 if _RUNSERVER else env.int("DB_CONN_MAX_AGE", default=0 if DEBUG else 60)
)
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)

# Behind PgBouncer in transaction pooling (DATABASE_POOLING=transaction;
# docs/deployment.md, "Topology") each transaction may run on another PostgreSQL session, so nothing
# may live in a session from one transaction to the next: no server-side cursors
# (QuerySet.iterator() would declare a WITH HOLD cursor) and no prepared statements
# (Django keeps psycopg's off: prepare_threshold None, pinned here). CONN_MAX_AGE
# keeps its meaning: a kept connection is a client slot of PgBouncer, not a
# PostgreSQL backend, and CONN_HEALTH_CHECKS replaces one a PgBouncer restart broke.
# payments.W006 warns when any of these is undone. Empty: a direct connection (or a
# pooler in session mode), nothing changes.
DATABASE_POOLING = env.str("DATABASE_POOLING", default="")
if DATABASE_POOLING not in ("", "transaction"):
    raise ImproperlyConfigured(
        f"DATABASE_POOLING={DATABASE_POOLING!r}: empty (direct connections, or a pooler in "
        "session mode) or 'transaction' (PgBouncer's pool_mode = transaction)."
    )
if DATABASE_POOLING == "transaction":
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = None

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=BASE_DIR / "var" / "static")
# With DEBUG off, whitenoise serves what `collectstatic` wrote (hashed names,
# compressed, cached for good); a deploy runs `make collectstatic` first.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}
# With DEBUG (runserver, the tests) whitenoise finds files in the apps and rechecks them.
WHITENOISE_USE_FINDERS = DEBUG
WHITENOISE_AUTOREFRESH = DEBUG

# --- Redis: the queue lives in its own database; nothing else shares it. -------
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

RQ_QUEUES = {
    "payments": {
        "URL": REDIS_URL,
        "DEFAULT_TIMEOUT": env.int("JOB_TIMEOUT", default=PaymentsSettings.job_timeout),
    },
}


def _sentinel_address(item: str) -> tuple[str, int]:
    host, _, port = item.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ImproperlyConfigured(f"REDIS_SENTINELS: {item!r} is not host:port.")
    return (host, int(port))


# Redis Sentinel (docs/deployment.md, "Topology"): with REDIS_SENTINELS ("host:port,host:port")
# every process asks the sentinels for the master of REDIS_SENTINEL_MASTER, and
# again after a failover; REDIS_URL then gives only the database number and the
# credentials. django-rq (rqworker, the RQ pages) and payments.engine.queues read
# the same entry, so workers, the API's enqueue, the sweeper and metrics all follow.
REDIS_SENTINELS = [_sentinel_address(item) for item in env.list("REDIS_SENTINELS", default=[])]
REDIS_SENTINEL_MASTER = env.str("REDIS_SENTINEL_MASTER", default="mymaster")
#: Seconds to wait for a sentinel's answer: a dead sentinel is skipped, never waited for.
REDIS_SENTINEL_TIMEOUT = env.float("REDIS_SENTINEL_TIMEOUT", default=1.0)
if REDIS_SENTINELS:
    _redis_url = parse_redis_url(REDIS_URL)
    _queue = RQ_QUEUES["payments"]
    del _queue["URL"]  # django-rq prefers a URL to SENTINELS
    _queue.update(
        SENTINELS=REDIS_SENTINELS,
        MASTER_NAME=REDIS_SENTINEL_MASTER,
        DB=int(_redis_url.get("db", 0) or 0),
        USERNAME=_redis_url.get("username"),
        PASSWORD=_redis_url.get("password"),
        SENTINEL_KWARGS={
            "socket_connect_timeout": REDIS_SENTINEL_TIMEOUT,
            "socket_timeout": REDIS_SENTINEL_TIMEOUT,
        },
    )
# Enqueue only after the surrounding transaction commits (django-rq's default,
# stated here because the outbox design depends on it).
# The worker class runs jobs in the worker process (payments/engine/worker.py says why;
# `make bench` compares it with RQ's forking Worker).
# django-rq's pages are served only under /admin/rq/, behind payments.desk.rq_access;
# its admin integration would serve the same views again at /admin/django_rq/
# with nothing but the staff check.
RQ_SHOW_ADMIN_LINK = False
RQ = {
    "COMMIT_MODE": "on_db_commit",
    "QUEUE_CLASS": "inbox.queues.MessageQueue",
    "WORKER_CLASS": env.str("RQ_WORKER_CLASS", default="payments.engine.worker.FenceWorker"),
}

# --- Inbox: consumer-side dedup; rows must outlive every redelivery. ----------
# Failed jobs are kept (and can be requeued) for REDELIVERY_HORIZON; every job
# enqueued through MessageQueue gets it as its failure_ttl, and inbox rows are
# kept longer than that (checked by inbox.W001).
INBOX = {
    "RETENTION": {"default": env.int("INBOX_RETENTION", default=7 * 24 * 3600)},
    "REDELIVERY_HORIZON": env.int("RQ_FAILURE_TTL", default=6 * 24 * 3600),
    "PURGE_CHANCE": env.float("INBOX_PURGE_CHANCE", default=0.001),
    "STRICT_MESSAGE_ID": env.bool("INBOX_STRICT_MESSAGE_ID", default=False),
}

# --- Payments: provider and the timeout chain -------------------------------
# HTTP connect + read timeout < JOB_TIMEOUT <= CLAIM_LEASE (checked at start-up).
# Only the variables that are set reach PAYMENTS; the defaults live in one place,
# payments/conf.py (PaymentsSettings), which validates the result.
_PAYMENTS_ENV = {
    "PROVIDER_URL": ("PAYMENT_PROVIDER_URL", env.str),
    "PROVIDER_API_KEY": ("PAYMENT_PROVIDER_API_KEY", env.str),
    "PROVIDER_CONNECT_TIMEOUT": ("PROVIDER_CONNECT_TIMEOUT", env.float),
    "PROVIDER_READ_TIMEOUT": ("PROVIDER_READ_TIMEOUT", env.float),
    "PROVIDER_KEY_RETENTION": ("PROVIDER_KEY_RETENTION", env.int),
    "JOB_TIMEOUT": ("JOB_TIMEOUT", env.int),
    "CLAIM_LEASE": ("CLAIM_LEASE", env.int),
    "MAX_ATTEMPTS": ("MAX_ATTEMPTS", env.int),
    "RETRY_BACKOFF": ("RETRY_BACKOFF", lambda name: env.list(name, cast=int)),
    "RECONCILE_GRACE": ("RECONCILE_GRACE", env.int),
    "PROVIDER_DASHBOARD_URL": ("PAYMENT_PROVIDER_DASHBOARD_URL", env.str),
    # Comma-separated: during a rotation the old and the new signing secret are both accepted.
    "PROVIDER_WEBHOOK_SECRETS": ("PAYMENT_PROVIDER_WEBHOOK_SECRET", env.str),
    "PROVIDER_WEBHOOK_TOLERANCE": ("PAYMENT_PROVIDER_WEBHOOK_TOLERANCE", env.int),
    "RETENTION_DAYS": ("PAYMENTS_RETENTION_DAYS", env.int),
    "PURGE_BATCH_SIZE": ("PAYMENTS_PURGE_BATCH_SIZE", env.int),
    "INLINE_FOLLOW_UPS": ("PAYMENTS_INLINE_FOLLOW_UPS", env.bool),
    "GENERIC_PLANS": ("PAYMENTS_GENERIC_PLANS", env.bool),
}
PAYMENTS = {key: read(var) for key, (var, read) in _PAYMENTS_ENV.items() if var in env}
# The external systems besides the payment provider, one entry each (docs/handlers.md,
# "Adding an external system"). The accounting system of the invoice export
# (payments/invoices): paid orders are exported only where ACCOUNTING_EXPORT is on.
PAYMENTS["SYSTEMS"] = {
    "accounting": {
        "URL": env.str("ACCOUNTING_URL", default="http://127.0.0.1:8767"),
        "API_KEY": env.str("ACCOUNTING_API_KEY", default="acct_test_fake"),
        "KEY_RETENTION": env.int("ACCOUNTING_KEY_RETENTION", default=24 * 3600),
        "OPTIONS": {"EXPORT_PAID_ORDERS": env.bool("ACCOUNTING_EXPORT", default=False)},
    },
}
# Adyen (payments/adyen, docs/adyen.md), for the shops whose payment_system is "adyen":
# configured where ADYEN_URL is set (the Checkout API's base URL, its version included).
if env.str("ADYEN_URL", default=""):
    PAYMENTS["SYSTEMS"]["adyen"] = {
        "URL": env.str("ADYEN_URL"),
        "API_KEY": env.str("ADYEN_API_KEY"),
        "OPTIONS": {
            "MERCHANT_ACCOUNT": env.str("ADYEN_MERCHANT_ACCOUNT"),
            "HMAC_KEY": env.str("ADYEN_HMAC_KEY"),
        },
    }

# The console backend (DEBUG's default) prints customers' addresses into the logs;
# without DEBUG it is refused at start-up, and the default is SMTP (EMAIL_HOST...).
EMAIL_BACKEND = env.str(
    "EMAIL_BACKEND",
    default="django.core.mail.backends.console.EmailBackend"
    if DEBUG
    else "django.core.mail.backends.smtp.EmailBackend",
)
EMAIL_HOST = env.str("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env.str("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env.str("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="shop@example.com")
ADMINS = [tuple(a.split(":", 1)) for a in env.list("ADMINS", default=[])]

# Every handler, root included, carries the redaction filter (project/logging.py):
# no e-mail address, card number, API key or payload leaves the process in a log.
# LOG_FORMAT=plain gives human-readable lines for local work; JSON is the default.
_LOG_LEVEL = env.str("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"redact": {"()": "project.logging.RedactFilter"}},
    "formatters": {
        "json": {"()": "project.logging.JsonFormatter"},
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain" if env.str("LOG_FORMAT", default="json") == "plain" else "json",
            "filters": ["redact"],
        },
        "mail_admins": {
            "class": "project.logging.RedactingAdminEmailHandler",
            "level": "ERROR",
            "filters": ["redact"],
        },
    },
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        # Replaces Django's default handlers (unfiltered) with ours; records reach root.
        "django": {"handlers": ["mail_admins"], "level": "INFO"},
        # runserver's access lines: Django's defaults make this logger not propagate,
        # so without "propagate" they bypassed the filter (printed raw by logging's
        # last-resort handler). gunicorn's go through gunicorn.conf.py's filter.
        "django.server": {"handlers": [], "level": "INFO", "propagate": True},
        "payments": {"handlers": [], "level": _LOG_LEVEL},
        "payments.alerts": {"handlers": ["mail_admins"], "level": "ERROR"},
        "inbox": {"handlers": [], "level": _LOG_LEVEL},
        "rq.worker": {"handlers": [], "level": "WARNING"},
        # redis-py adds an unfiltered handler of its own unless this logger exists.
        "push_response": {"handlers": [], "level": "INFO"},
    },
}

# Bearer token for the RQ pages' stats.json and metrics/ without a session
# (docs/deployment.md, "Production"); empty: none is accepted.
RQ_API_TOKEN = env.str("RQ_API_TOKEN", default="")

# --- Observability ---
# Bearer token for /metrics; empty: only staff sessions may read it (docs/observability.md).
METRICS_TOKEN = env.str("METRICS_TOKEN", default="")

# --- The JSON API (Django REST framework; see payments/api/base.py) ---------------
# Per-client keys (hashed, with a visible prefix: djangorestframework-api-key);
# API_TOKEN is a bootstrap client for development and the local tools.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["payments.api.base.ClientKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["payments.api.base.IsApiClient"],
    "DEFAULT_PARSER_CLASSES": ["payments.api.base.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_THROTTLE_CLASSES": ["payments.api.base.ClientRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {
        "client": env.str("API_RATE_PER_CLIENT", default="600/min"),
        "failed_auth": env.str("API_RATE_FAILED_AUTH", default="20/min"),
    },
    "EXCEPTION_HANDLER": "payments.api.base.api_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Payments fence API",
    "DESCRIPTION": "Orders, checkouts and refunds: each POST that starts an operation needs an "
    "Idempotency-Key; a worker does the provider call.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "payments.api.schema.refuse_unknown_fields",
    ],
}
# The API's throttles count in the cache: a shared Redis cache in production
# (REDIS_CACHE_URL, its own database: payments.W004), per process otherwise.
CACHES = (
    {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": env.str("REDIS_CACHE_URL"),
            "KEY_PREFIX": "cache",
        }
    }
    if env.str("REDIS_CACHE_URL", default="")
    else {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
)
#: The largest request body the API reads (413 above it).
API_MAX_BODY_BYTES = env.int("API_MAX_BODY_BYTES", default=64 * 1024)
# The API's limits count in Redis, atomically (payments/api/limits.py), in the cache's
# database: every web process shares them. Empty: in each process's own cache.
API_RATE_REDIS_URL = env.str("REDIS_CACHE_URL", default="")
# How many proxies in front of the web processes append to X-Forwarded-For
# (docs/deployment.md, "Deploying"). 0: the wrong-key limit counts the peer address (REMOTE_ADDR) and
# ignores the header, which any client can write.
API_TRUSTED_PROXIES = env.int("API_TRUSTED_PROXIES", default=0)
if API_TRUSTED_PROXIES < 0:
    raise ImproperlyConfigured(
        f"API_TRUSTED_PROXIES={API_TRUSTED_PROXIES}: the number of proxies in front, 0 or more."
    )


# --- Production: HTTPS, cookies, the proxy, login lockout, process counts ---------
# From the environment; the defaults suit DEBUG (plain HTTP on localhost) and are
# strict without it. .env.production.example is a documented deploy with which
# `manage.py check --deploy` reports nothing (tests/hardening test it).
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=not DEBUG)
# The load balancer's health probe speaks plain HTTP inside the network.
SECURE_REDIRECT_EXEMPT = env.list("SECURE_REDIRECT_EXEMPT", default=[r"^healthz$"])
# HSTS is a promise browsers keep for this many seconds: opt in per deploy.
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=False)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=not DEBUG)
# "HTTP_X_FORWARDED_PROTO,https", only behind a proxy that sets (and strips) the header.
_PROXY_SSL_HEADER = env.list("SECURE_PROXY_SSL_HEADER", default=[])
if _PROXY_SSL_HEADER and len(_PROXY_SSL_HEADER) != 2:
    raise ImproperlyConfigured(
        "SECURE_PROXY_SSL_HEADER is 'HEADER,value', e.g. HTTP_X_FORWARDED_PROTO,https."
    )
SECURE_PROXY_SSL_HEADER = (
    (_PROXY_SSL_HEADER[0], _PROXY_SSL_HEADER[1]) if _PROXY_SSL_HEADER else None
)
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

# Admin login lockout (django-axes, counted in the database): after
# AXES_FAILURE_LIMIT wrong passwords for one username from one address, that pair
# is refused (429), the right password too, for AXES_COOLOFF_MINUTES.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_ENABLED = env.bool("AXES_ENABLED", default=True)
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("AXES_COOLOFF_MINUTES", default=15))
# "username+ip_address" locks the pair; "ip_address,username" locks either alone.
AXES_LOCKOUT_PARAMETERS = [
    item.split("+") if "+" in item else item
    for item in env.list("AXES_LOCKOUT_PARAMETERS", default=["username+ip_address"])
]
AXES_RESET_ON_SUCCESS = True

# The processes of a deploy and their PostgreSQL connections (docs/deployment.md, "Production"):
# gunicorn workers x threads + RQ workers (x2 when they fork) + recovery loops
# + DB_RESERVED_CONNECTIONS (migrate, shell, cron) must stay below max_connections
# less PostgreSQL's superuser reserve: payments.E011 (`check --deploy --database
# default`) compares. gunicorn.conf.py reads the same WEB_CONCURRENCY and
# GUNICORN_THREADS.
DEPLOY_PROCESSES = {
    "WEB_CONCURRENCY": env.int("WEB_CONCURRENCY", default=2),
    "GUNICORN_THREADS": env.int("GUNICORN_THREADS", default=1),
    "RQ_WORKERS": env.int("RQ_WORKERS", default=1),
    "RECOVERY_PROCESSES": env.int("RECOVERY_PROCESSES", default=1),
    "DB_RESERVED_CONNECTIONS": env.int("DB_RESERVED_CONNECTIONS", default=5),
}

# Refused at start-up without DEBUG: a deploy must never run on the fake
# provider's URL and key, a guessable API token, or a backend that prints or
# files customers' e-mails.
MIN_API_TOKEN_LENGTH = 32
CONSOLE_EMAIL_BACKENDS = frozenset(
    {
        "django.core.mail.backends.console.EmailBackend",
        "django.core.mail.backends.filebased.EmailBackend",
    }
)
if not DEBUG:
    _refused = [
        f"{name} must be set when DEBUG is off (the defaults are the fake provider's)."
        for name in ("PAYMENT_PROVIDER_URL", "PAYMENT_PROVIDER_API_KEY")
        if not env.str(name, default="")
    ] + [
        f"{name} must be set when DEBUG is off and ACCOUNTING_EXPORT is on."
        for name in ("ACCOUNTING_URL", "ACCOUNTING_API_KEY")
        if env.bool("ACCOUNTING_EXPORT", default=False) and not env.str(name, default="")
    ]
    if API_TOKEN and len(API_TOKEN) < MIN_API_TOKEN_LENGTH:
        _refused.append(
            f"API_TOKEN is {len(API_TOKEN)} characters; at least {MIN_API_TOKEN_LENGTH} "
            "random ones are needed when DEBUG is off."
        )
    if EMAIL_BACKEND in CONSOLE_EMAIL_BACKENDS:
        _refused.append(
            f"EMAIL_BACKEND={EMAIL_BACKEND} writes customers' e-mails into logs or files; "
            "set an SMTP (or provider) backend when DEBUG is off."
        )
    if _refused:
        raise ImproperlyConfigured(" ".join(_refused))
