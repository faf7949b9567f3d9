"""gunicorn, the production web process: `gunicorn -c gunicorn.conf.py` (docs/deployment.md).

Everything comes from the environment (or the file DJANGO_ENV_FILE names, as
in project/settings.py):

- GUNICORN_BIND: address(es) to listen on, comma-separated (default 127.0.0.1:8000;
  0.0.0.0:8000 in a container behind its proxy);
- WEB_CONCURRENCY: worker processes (default 2); GUNICORN_THREADS: threads per
  worker (default 1; above 1 the gthread worker). workers x threads is the
  web's share of PostgreSQL's connections (payments.E011 checks the sum);
- GUNICORN_TIMEOUT: seconds before a silent worker is killed and replaced
  (default 30: a request only writes rows and enqueues; no provider call);
- FORWARDED_ALLOW_IPS: proxies trusted for X-Forwarded-* (default 127.0.0.1).

Access and error lines go through the same redaction filter as Django's logs
(project.logging.RedactFilter): `?token=...`, e-mail addresses and card-like
numbers in a request line never reach the log raw.
"""

from __future__ import annotations

import os
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent
env = environ.Env()
_ENV_FILE = os.environ.get("DJANGO_ENV_FILE", str(BASE_DIR / ".env"))
if _ENV_FILE:
    environ.Env.read_env(_ENV_FILE)

wsgi_app = "project.wsgi:application"
chdir = str(BASE_DIR)
bind = env.list("GUNICORN_BIND", default=["127.0.0.1:8000"])
workers = env.int("WEB_CONCURRENCY", default=2)
threads = env.int("GUNICORN_THREADS", default=1)
worker_class = "gthread" if threads > 1 else "sync"
timeout = env.int("GUNICORN_TIMEOUT", default=30)
graceful_timeout = 30
keepalive = 5
# Recycle workers now and then (a slow leak never grows for good); jitter keeps
# them from restarting together.
max_requests = env.int("GUNICORN_MAX_REQUESTS", default=2000)
max_requests_jitter = 200
forwarded_allow_ips = env.str("FORWARDED_ALLOW_IPS", default="127.0.0.1")

accesslog = "-"
errorlog = "-"
_FORMATTER = "plain" if env.str("LOG_FORMAT", default="json") == "plain" else "json"
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"redact": {"()": "project.logging.RedactFilter"}},
    "formatters": {
        "json": {"()": "project.logging.JsonFormatter"},
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {
        "stdout": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stdout",
            "formatter": _FORMATTER,
            "filters": ["redact"],
        },
        "stderr": {
            "class": "logging.StreamHandler",
            "stream": "ext://sys.stderr",
            "formatter": _FORMATTER,
            "filters": ["redact"],
        },
    },
    "root": {"level": "WARNING", "handlers": ["stderr"]},
    "loggers": {
        "gunicorn.access": {"level": "INFO", "handlers": ["stdout"], "propagate": False},
        "gunicorn.error": {"level": "INFO", "handlers": ["stderr"], "propagate": False},
    },
}
