"""System checks of the payments app (run at start-up and by `manage.py check`)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.db import connections

from payments.conf import payments_setting

#: RQ redelivers an abandoned job 60-90 s after its worker died; an orphaned
#: work horse must be dead by then, so a job may not run longer than this.
MAX_JOB_TIMEOUT = 60


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
def check_timeout_chain(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """HTTP connect+read timeout < job timeout <= claim lease, and job timeout <= 60 s."""
    connect = float(payments_setting("PROVIDER_CONNECT_TIMEOUT"))
    read = float(payments_setting("PROVIDER_READ_TIMEOUT"))
    job = int(payments_setting("JOB_TIMEOUT"))
    lease = int(payments_setting("CLAIM_LEASE"))
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
                "still be running when RQ redelivers its job.",
                hint=f"Keep JOB_TIMEOUT <= {MAX_JOB_TIMEOUT}.",
                id="payments.E004",
            )
        )
    queue = settings.RQ_QUEUES.get(payments_setting("QUEUE"), {})
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
