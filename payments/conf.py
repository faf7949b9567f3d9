"""The payments app's settings: one optional dict, `settings.PAYMENTS`, read and validated here.

Every key, its default and its meaning: docs/settings.md (a test checks that each key
of `PaymentsSettings` has its section there). `payments.E009` reports a bad value at
start-up; the timeout chain between them is checked by `payments.E002`-`E005`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class SystemSettings:
    """One external system's entry in PAYMENTS["SYSTEMS"] (durations in seconds; the
    timeouts are the provider's where the entry sets none)."""

    url: str
    api_key: str
    connect_timeout: float
    read_timeout: float
    key_retention: int | None = None
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


def _systems(
    value: Any, connect_timeout: float, read_timeout: float
) -> tuple[tuple[str, SystemSettings], ...]:
    """Validate PAYMENTS["SYSTEMS"]: an entry per system name, each with its known keys;
    `connect_timeout` and `read_timeout` (the provider's) for an entry that sets none."""
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
                    connect_timeout=_optional(entry, name, "CONNECT_TIMEOUT", False, 0.01)
                    or connect_timeout,
                    read_timeout=_optional(entry, name, "READ_TIMEOUT", False, 0.01)
                    or read_timeout,
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
    connect_timeout = _number(
        "PROVIDER_CONNECT_TIMEOUT", get("provider_connect_timeout"), integer=False, minimum=0.01
    )
    read_timeout = _number(
        "PROVIDER_READ_TIMEOUT", get("provider_read_timeout"), integer=False, minimum=0.01
    )
    return PaymentsSettings(
        provider_url=_text("PROVIDER_URL", get("provider_url")),
        provider_api_key=_text("PROVIDER_API_KEY", get("provider_api_key")),
        provider_connect_timeout=connect_timeout,
        provider_read_timeout=read_timeout,
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
        systems=_systems(raw.get("SYSTEMS", {}), connect_timeout, read_timeout),
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
