"""Settings, read from the environment in one place (django-environ).

Every variable is documented in README.md with its default. A `.env` file in
the project root is read when present (the Makefile writes a development one);
production sets real environment variables and has no `.env`.
"""

from __future__ import annotations

from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from payments.conf import PaymentsSettings

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env")

DEBUG = env.bool("DEBUG", default=False)


def _secret(name: str, dev_default: str) -> str:
    """Return a secret; only DEBUG may fall back to an insecure development value."""
    value = env.str(name, default="")
    if value:
        return value
    if DEBUG:
        return dev_default
    raise ImproperlyConfigured(f"{name} must be set when DEBUG is off.")


INSECURE_DEV_SECRET_KEY = "insecure-dev-secret-key-do-not-use-in-production"
INSECURE_DEV_API_TOKEN = "dev-api-token"

SECRET_KEY = _secret("SECRET_KEY", INSECURE_DEV_SECRET_KEY)
API_TOKEN = _secret("API_TOKEN", INSECURE_DEV_API_TOKEN)

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_rq",
    "inbox",
    "payments",
]
# Developer tooling (fake provider, chaos run, bench, local stack): installed only
# with DEBUG on, or when DEVTOOLS=1 says so explicitly. Production never has it.
DEVTOOLS = env.bool("DEVTOOLS", default=DEBUG)
if DEVTOOLS:
    INSTALLED_APPS.append("devtools")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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
DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DB_CONN_MAX_AGE", default=60))
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)

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
STATIC_ROOT = BASE_DIR / "var" / "static"

# --- Redis: the queue lives in its own database; nothing else shares it. -------
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

RQ_QUEUES = {
    "payments": {
        "URL": REDIS_URL,
        "DEFAULT_TIMEOUT": env.int("JOB_TIMEOUT", default=PaymentsSettings.job_timeout),
    },
}
# Enqueue only after the surrounding transaction commits (django-rq's default,
# stated here because the outbox design depends on it).
# The worker class was picked by `make bench` (see payments/worker.py).
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
}
PAYMENTS = {key: read(var) for key, (var, read) in _PAYMENTS_ENV.items() if var in env}

EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
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
        "django.server": {"handlers": [], "level": "INFO"},
        "payments": {"handlers": [], "level": _LOG_LEVEL},
        "payments.alerts": {"handlers": ["mail_admins"], "level": "ERROR"},
        "inbox": {"handlers": [], "level": _LOG_LEVEL},
        "rq.worker": {"handlers": [], "level": "WARNING"},
        # redis-py adds an unfiltered handler of its own unless this logger exists.
        "push_response": {"handlers": [], "level": "INFO"},
    },
}

# --- Observability ---
# Bearer token for /metrics; empty: only staff sessions may read it (docs/observability.md).
METRICS_TOKEN = env.str("METRICS_TOKEN", default="")
