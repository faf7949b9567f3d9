"""The payments app's settings: one optional dict, `settings.PAYMENTS`, read and validated here.

Every key, its default and its meaning:

``PROVIDER_URL`` (``"http://127.0.0.1:8765"``)
    Base URL of the Stripe-compatible provider.
``PROVIDER_API_KEY`` (``"sk_test_fake"``)
    Sent as ``Authorization: Bearer``.
``PROVIDER_CONNECT_TIMEOUT`` / ``PROVIDER_READ_TIMEOUT`` (``3.0`` / ``10.0`` seconds)
    The HTTP timeouts of one provider call; their sum must stay under ``JOB_TIMEOUT``.
``PROVIDER_KEY_RETENTION`` (``86400`` seconds)
    How long the provider keeps an idempotency key; a same-key replay is only
    tried well inside it.
``JOB_TIMEOUT`` (``30`` seconds, at most 60)
    RQ's job timeout for payments jobs.
``CLAIM_LEASE`` (``45`` seconds, at least ``JOB_TIMEOUT``)
    How long an operation lease and a step claim belong to their worker.
``MAX_ATTEMPTS`` (``3``)
    Attempts of an operation in total, the first included.
``RETRY_BACKOFF`` (``[2, 8]`` seconds)
    Delay before the 2nd, 3rd, ... attempt (the last value repeats).
``RECONCILE_GRACE`` (``900`` seconds)
    How long an outcome may stay unknown before the operation goes to needs_review.
``PROVIDER_DASHBOARD_URL`` (``""``: no links)
    A template for a link to the provider's own page of a reference, with
    ``{reference}`` in it, e.g. ``https://dashboard.stripe.com/payments/{reference}``.
``QUEUE`` (``"payments"``)
    The RQ queue (an ``RQ_QUEUES`` entry) that delivers operations.
``PROVIDER_WEBHOOK_SECRETS`` (``()``: every webhook is refused)
    The provider's webhook signing secrets (``whsec_...``); an event signed with
    any of them is accepted, so during a rotation both the old and the new one
    are listed. A comma-separated string is accepted too.
``PROVIDER_WEBHOOK_TOLERANCE`` (``300`` seconds)
    How far a webhook's signed timestamp may be from now before it is refused
    as a replay (Stripe's own default).
``RETENTION_DAYS`` (``400``)
    How long the history of a finished operation (its claims, audit rows and
    provider events) is kept after its last change; `purge_history` removes
    what is older (the operation row stays, so its key is never taken again).
    Well past the provider's key retention (`payments.E012`), RQ's one-year
    failed-job registry (`payments.W007`) and any `fence_audit` window.
``PURGE_BATCH_SIZE`` (``500``)
    Operations whose history one `purge_history` transaction removes.
``SYSTEMS`` (``{}``)
    The external systems besides the payment provider (whose entry is the
    ``PROVIDER_*`` keys above), one entry per system a package declares
    (`payments.engine.systems`), by its name::

        "SYSTEMS": {"accounting": {"URL": "https://books.example", "API_KEY": "...",
                                   "KEY_RETENTION": 3600, "OPTIONS": {"LEDGER": "eu"}}}

    ``URL`` and ``API_KEY`` are required; ``KEY_RETENTION`` (seconds, at least 60:
    how long the system keeps an idempotency key, as its contract documents;
    default: the declaration's), ``CONNECT_TIMEOUT`` / ``READ_TIMEOUT`` (default:
    the provider's), ``DASHBOARD_URL`` (with ``{reference}``) and ``OPTIONS`` (a
    dict the system's package reads: a merchant account, a ledger) are optional.
    `payments.E013` reports an entry for no declared system, and a declared
    system an effect uses without an entry.

``HANDLER_MODULES`` (``()``)
    Dotted paths of modules that declare handlers, imported at start-up besides
    each installed app's ``handler`` module (``bookings/handler.py``) and the
    ``handler`` module of each package of ``payments``: for handlers kept
    elsewhere, e.g. ``["bookings.deposits.fenced"]``. A path that cannot be
    imported stops start-up with an ImportError naming it.
``INLINE_FOLLOW_UPS`` (``True``)
    Whether a follow-up declared ``@message(..., inline=True)`` runs inside the
    transaction that writes its event (the checkout's ledger line and sales
    counter, in ``mark_paid``'s), instead of as an operation of its own
    delivered through the inbox. ``False`` queues every follow-up: each gets
    its operation row, audit rows and inbox row, and a failing one never
    touches its writer's transaction (not even inside a savepoint).

``GENERIC_PLANS`` (``True``)
    Whether each new connection to the default database is set to
    ``plan_cache_mode = force_generic_plan``, so that the fence's prepared
    statements are planned once per connection instead of at each call (one
    ``SET`` with the connection's set-up; docs/deployment.md). It applies to
    the session's prepared statements only: the ORM's queries are not prepared.
    Never set where the fence does not prepare (OPTIONS ``prepare_threshold``
    None): behind PgBouncer in transaction pooling pin that, or set this
    ``False``, or the SET lands on a server connection other clients share.
    ``False`` if the project prepares statements of its own, or runs PL/pgSQL
    functions on these connections, whose queries need plans made for their
    values.

`payments.E009` reports a bad value at start-up; the timeout chain between
them is checked by `payments.E002`-`E005`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class SystemSettings:
    """One external system's entry in PAYMENTS["SYSTEMS"] (durations in seconds)."""

    url: str
    api_key: str
    key_retention: int | None = None
    connect_timeout: float | None = None
    read_timeout: float | None = None
    dashboard_url: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


SYSTEM_KEYS = frozenset(
    {"URL", "API_KEY", "KEY_RETENTION", "CONNECT_TIMEOUT", "READ_TIMEOUT", "DASHBOARD_URL",
     "OPTIONS"}
)  # fmt: skip


@dataclass(frozen=True)
class PaymentsSettings:
    """The validated PAYMENTS settings (durations in seconds)."""

    provider_url: str = "http://127.0.0.1:8765"
    provider_api_key: str = "sk_test_fake"
    provider_connect_timeout: float = 3.0
    provider_read_timeout: float = 10.0
    provider_key_retention: int = 24 * 3600
    job_timeout: int = 30
    claim_lease: int = 45
    max_attempts: int = 3
    retry_backoff: tuple[int, ...] = (2, 8)
    reconcile_grace: int = 15 * 60
    queue: str = "payments"
    provider_dashboard_url: str = ""
    provider_webhook_secrets: tuple[str, ...] = ()
    provider_webhook_tolerance: int = 300
    retention_days: int = 400
    purge_batch_size: int = 500
    systems: tuple[tuple[str, SystemSettings], ...] = ()
    handler_modules: tuple[str, ...] = ()
    inline_follow_ups: bool = True
    generic_plans: bool = True

    def system(self, name: str) -> SystemSettings | None:
        """The entry of an external system besides the provider, or None when not configured."""
        return dict(self.systems).get(name)

    def key_retention_of(self, name: str) -> int | None:
        """The key retention configured for system `name` (the provider's: PROVIDER_KEY_RETENTION)."""
        if name == "provider":
            return self.provider_key_retention
        entry = self.system(name)
        return entry.key_retention if entry is not None else None

    def backoff_before(self, attempt: int) -> int:
        """Return the delay in seconds before attempt `attempt + 1` (1-based `attempt`)."""
        backoff = self.retry_backoff or (0,)
        return backoff[min(attempt - 1, len(backoff) - 1)]


_DEFAULTS = PaymentsSettings()
KNOWN_KEYS = frozenset(name.upper() for name in PaymentsSettings.__dataclass_fields__)


def _number(name: str, value: Any, *, integer: bool, minimum: float) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise ImproperlyConfigured(
            f"PAYMENTS[{name!r}] must be {kind} >= {minimum}, not {value!r}."
        )
    return int(value) if integer else float(value)


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ImproperlyConfigured(f"PAYMENTS[{name!r}] must be a non-empty string.")
    return value


def _dashboard(name: str, value: Any) -> str:
    if value == "":
        return ""
    if not isinstance(value, str) or "{reference}" not in value:
        raise ImproperlyConfigured(f"PAYMENTS[{name!r}] must be a URL containing {{reference}}.")
    return value


def _optional(entry: dict[str, Any], name: str, key: str, integer: bool, minimum: float) -> Any:
    raw = entry.get(key)
    return None if raw is None else _number(f"{name}.{key}", raw, integer=integer, minimum=minimum)


def _systems(value: Any) -> tuple[tuple[str, SystemSettings], ...]:
    """Validate PAYMENTS["SYSTEMS"]: an entry per system name, each with its known keys."""
    if not isinstance(value, dict):
        raise ImproperlyConfigured("PAYMENTS['SYSTEMS'] must be a dict of system name -> entry.")
    read = []
    for name, entry in sorted(value.items()):
        where = f"PAYMENTS['SYSTEMS'][{name!r}]"
        if not isinstance(name, str) or not name.isidentifier():
            raise ImproperlyConfigured(f"{where}: a system's name is an identifier.")
        if name == "provider":
            raise ImproperlyConfigured(
                f"{where}: the payment provider is configured by the PROVIDER_* keys."
            )
        if not isinstance(entry, dict):
            raise ImproperlyConfigured(f"{where} must be a dict.")
        unknown = sorted(set(entry) - SYSTEM_KEYS)
        if unknown:
            raise ImproperlyConfigured(
                f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(SYSTEM_KEYS))})."
            )
        options = entry.get("OPTIONS", {})
        if not isinstance(options, dict):
            raise ImproperlyConfigured(f"{where}['OPTIONS'] must be a dict.")

        read.append(
            (
                name,
                SystemSettings(
                    url=_text(f"SYSTEMS.{name}.URL", entry.get("URL")),
                    api_key=_text(f"SYSTEMS.{name}.API_KEY", entry.get("API_KEY")),
                    key_retention=_optional(entry, name, "KEY_RETENTION", True, 60),
                    connect_timeout=_optional(entry, name, "CONNECT_TIMEOUT", False, 0.01),
                    read_timeout=_optional(entry, name, "READ_TIMEOUT", False, 0.01),
                    dashboard_url=_dashboard(
                        f"SYSTEMS.{name}.DASHBOARD_URL", entry.get("DASHBOARD_URL", "")
                    ),
                    options=tuple(sorted(options.items())),
                ),
            )
        )
    return tuple(read)


def _secrets(name: str, value: Any) -> tuple[str, ...]:
    """Validate webhook secrets: a list of non-empty strings, or one comma-separated string."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple) or not all(
        isinstance(secret, str)
        and secret
        and "," not in secret
        and not any(c.isspace() for c in secret)
        for secret in value
    ):
        raise ImproperlyConfigured(
            f"PAYMENTS[{name!r}] must be a list of non-empty secrets without spaces or commas."
        )
    return tuple(value)


#: PAYMENTS unset or empty: one dict, so that it is read once too.
_NONE: dict[str, Any] = {}

#: The last PAYMENTS dict read, and what it gave.
_last: tuple[object, PaymentsSettings] | None = None


def payments_settings() -> PaymentsSettings:
    """Read ``settings.PAYMENTS``, apply the defaults and validate it.

    Validated once per dict: a new one (``override_settings``, an assignment)
    is read on the next call; the dict is not to be changed in place.
    Raises ImproperlyConfigured on an unknown key or a bad value.
    """
    global _last
    raw = getattr(settings, "PAYMENTS", None) or _NONE
    last = _last
    if last is not None and last[0] is raw:
        return last[1]
    read = _read(raw)
    _last = (raw, read)
    return read


def _read(raw: object) -> PaymentsSettings:
    """PAYMENTS validated, with the defaults applied."""
    if not isinstance(raw, dict):
        raise ImproperlyConfigured("PAYMENTS must be a dict.")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise ImproperlyConfigured(f"Unknown PAYMENTS keys: {', '.join(unknown)}.")

    def get(name: str) -> Any:
        return raw.get(name.upper(), getattr(_DEFAULTS, name))

    backoff = get("retry_backoff")
    if not isinstance(backoff, list | tuple) or not backoff:
        raise ImproperlyConfigured("PAYMENTS['RETRY_BACKOFF'] must be a non-empty list of seconds.")
    return PaymentsSettings(
        provider_url=_text("PROVIDER_URL", get("provider_url")),
        provider_api_key=_text("PROVIDER_API_KEY", get("provider_api_key")),
        provider_connect_timeout=_number(
            "PROVIDER_CONNECT_TIMEOUT", get("provider_connect_timeout"), integer=False, minimum=0.01
        ),
        provider_read_timeout=_number(
            "PROVIDER_READ_TIMEOUT", get("provider_read_timeout"), integer=False, minimum=0.01
        ),
        provider_key_retention=_number(
            "PROVIDER_KEY_RETENTION", get("provider_key_retention"), integer=True, minimum=3600
        ),
        job_timeout=_number("JOB_TIMEOUT", get("job_timeout"), integer=True, minimum=1),
        claim_lease=_number("CLAIM_LEASE", get("claim_lease"), integer=True, minimum=1),
        max_attempts=_number("MAX_ATTEMPTS", get("max_attempts"), integer=True, minimum=1),
        retry_backoff=tuple(
            _number("RETRY_BACKOFF", seconds, integer=True, minimum=0) for seconds in backoff
        ),
        reconcile_grace=_number("RECONCILE_GRACE", get("reconcile_grace"), integer=True, minimum=1),
        queue=_text("QUEUE", get("queue")),
        provider_dashboard_url=_dashboard("PROVIDER_DASHBOARD_URL", get("provider_dashboard_url")),
        provider_webhook_secrets=_secrets(
            "PROVIDER_WEBHOOK_SECRETS", get("provider_webhook_secrets")
        ),
        provider_webhook_tolerance=_number(
            "PROVIDER_WEBHOOK_TOLERANCE", get("provider_webhook_tolerance"), integer=True, minimum=1
        ),
        retention_days=_number("RETENTION_DAYS", get("retention_days"), integer=True, minimum=1),
        purge_batch_size=_number(
            "PURGE_BATCH_SIZE", get("purge_batch_size"), integer=True, minimum=1
        ),
        systems=_systems(raw.get("SYSTEMS", {})),
        handler_modules=_modules("HANDLER_MODULES", get("handler_modules")),
        inline_follow_ups=_flag("INLINE_FOLLOW_UPS", get("inline_follow_ups")),
        generic_plans=_flag("GENERIC_PLANS", get("generic_plans")),
    )


def _flag(name: str, value: object) -> bool:
    """True or False, nothing else (a string "false" would be true)."""
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"PAYMENTS['{name}'] must be True or False, not {value!r}.")
    return value


def _modules(name: str, value: object) -> tuple[str, ...]:
    """A list of dotted module paths (`bookings.deposits.fenced`)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ImproperlyConfigured(f"PAYMENTS['{name}'] must be a list of dotted module paths.")
    for path in value:
        if not isinstance(path, str) or not all(part.isidentifier() for part in path.split(".")):
            raise ImproperlyConfigured(
                f"PAYMENTS['{name}']: {path!r} is not a dotted module path (e.g. 'bookings.fenced')."
            )
    return tuple(value)


def handler_modules_alone() -> tuple[str, ...]:
    """PAYMENTS["HANDLER_MODULES"], validated alone (another key may be bad: E009 says
    which). Raises ImproperlyConfigured when this one is."""
    raw = getattr(settings, "PAYMENTS", None) or {}
    if not isinstance(raw, dict):
        return ()
    return _modules("HANDLER_MODULES", raw.get("HANDLER_MODULES", ()))
