"""Read the inbox app's settings in one place, with defaults.

All keys live in one optional dict, ``settings.INBOX``:

``RETENTION`` (default ``{"default": 604800}``, i.e. 7 days)
    How long an :class:`~inbox.models.InboxEntry` is kept, in seconds (an
    ``int``/``float`` or a ``timedelta``), per consumer. ``"default"`` applies
    to every consumer without its own key. A row purged before RQ can hand the
    message back lets that message run twice; ``inbox.W001`` warns about it.
    The given dict is merged over the default, so ``{"emails": 3600}`` keeps
    the 7-day default for everyone else.
``PURGE_CHANCE`` (default ``0.001``)
    Chance, between 0 and 1, that a successful record triggers one bounded
    purge batch for its consumer after the handler's transaction commits.
    ``0`` turns the opportunistic purge off (run ``purge_inbox`` from cron).
``PURGE_BATCH_SIZE`` (default ``20000``)
    The most rows one purge batch deletes; each batch is its own short
    transaction. The cap bounds a slow batch: one that meets a checkpoint or a
    busy neighbour takes about twice its usual time, so the cap, not the
    adaptive size, decides the longest lock hold (`make bench` reports it).
    Batches start at 1000 rows (or this, if smaller) and adapt to
    ``PURGE_BATCH_SECONDS``; the opportunistic purge runs one first batch.
``PURGE_BATCH_SECONDS`` (default ``0.02``)
    The time each purge batch aims to hold its row locks, from its ``DELETE``
    to its ``COMMIT``: the next batch is sized from the last one's rate.
    ``0`` turns the adaptation off (every batch is ``PURGE_BATCH_SIZE``).
``STRICT_MESSAGE_ID`` (default ``False``)
    When a job carries no message id (enqueued by another tool), an inbox
    handler logs a WARNING and runs unprotected. ``True`` makes it raise
    :class:`~inbox.exceptions.MissingMessageId` instead, so the job fails
    visibly in the failed registry; it is never dropped silently.
``REDELIVERY_HORIZON`` (default ``None``: rq's ``DEFAULT_FAILURE_TTL``, 1 year)
    The longest time, in seconds or as a ``timedelta``, after which RQ can
    still hand a message back: failed jobs can be requeued for as long as the
    failed registry keeps them. State the deployment's real window here when
    it keeps failed jobs shorter (``failure_ttl``); ``inbox.W001`` compares
    every retention with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from rq.defaults import DEFAULT_FAILURE_TTL

DEFAULT_RETENTION = timedelta(days=7)
DEFAULT_PURGE_CHANCE = 0.001
DEFAULT_PURGE_BATCH_SIZE = 20_000
DEFAULT_PURGE_BATCH_SECONDS = 0.02
DEFAULT_CONSUMER_KEY = "default"

KNOWN_KEYS = frozenset(
    {
        "RETENTION",
        "PURGE_CHANCE",
        "PURGE_BATCH_SIZE",
        "PURGE_BATCH_SECONDS",
        "STRICT_MESSAGE_ID",
        "REDELIVERY_HORIZON",
    }
)


@dataclass(frozen=True)
class InboxSettings:
    """The validated INBOX settings; durations are timedeltas."""

    retention: dict[str, timedelta]
    purge_chance: float
    purge_batch_size: int
    purge_batch_seconds: float
    strict_message_id: bool
    redelivery_horizon: timedelta

    def retention_for(self, consumer: str) -> timedelta:
        """Return how long rows of ``consumer`` are kept."""
        return self.retention.get(consumer, self.default_retention)

    @property
    def default_retention(self) -> timedelta:
        """Return the retention of consumers without a key of their own."""
        return self.retention[DEFAULT_CONSUMER_KEY]

    @property
    def named_consumers(self) -> list[str]:
        """Return the consumers with a retention of their own (not ``default``)."""
        return sorted(name for name in self.retention if name != DEFAULT_CONSUMER_KEY)


def _duration(label: str, value: Any) -> timedelta:
    """Turn seconds or a timedelta into a positive timedelta, or refuse it."""
    if isinstance(value, timedelta):
        duration = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        duration = timedelta(seconds=value)
    else:
        raise ImproperlyConfigured(
            f"{label} must be a number of seconds or a timedelta, not {type(value).__name__}."
        )
    if duration <= timedelta(0):
        raise ImproperlyConfigured(f"{label} must be positive.")
    return duration


#: The last ``settings.INBOX`` read and what it gave (see inbox_settings).
_read: tuple[object, InboxSettings] | None = None


def inbox_settings() -> InboxSettings:
    """Read ``settings.INBOX``, apply defaults and validate it.

    Read again whenever ``settings.INBOX`` is another object than at the last
    read (``override_settings`` and the tests' ``settings`` fixture assign a
    new dict), else the last result: every delivered message asks, and reading
    it costs more than the lookup. A change made inside the same dict at run
    time is not seen (Django's settings are not to be changed at run time;
    assign a new dict). Raise ``ImproperlyConfigured`` on a bad value;
    ``inbox.E001`` reports it at start-up.
    """
    global _read
    raw = getattr(settings, "INBOX", None)
    if _read is not None and _read[0] is raw:
        return _read[1]
    conf = _read_inbox_settings(raw or {})
    _read = (raw, conf)
    return conf


def _read_inbox_settings(raw: object) -> InboxSettings:
    if not isinstance(raw, dict):
        raise ImproperlyConfigured("INBOX must be a dict.")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise ImproperlyConfigured(f"Unknown INBOX keys: {', '.join(unknown)}.")

    retention_raw = raw.get("RETENTION", {})
    if not isinstance(retention_raw, dict):
        raise ImproperlyConfigured("INBOX['RETENTION'] must be a dict of consumer -> seconds.")
    retention = {DEFAULT_CONSUMER_KEY: DEFAULT_RETENTION}
    for consumer, value in retention_raw.items():
        retention[str(consumer)] = _duration(f"INBOX['RETENTION'][{consumer!r}]", value)

    chance = raw.get("PURGE_CHANCE", DEFAULT_PURGE_CHANCE)
    if isinstance(chance, bool) or not isinstance(chance, int | float) or not 0 <= chance <= 1:
        raise ImproperlyConfigured("INBOX['PURGE_CHANCE'] must be a number between 0 and 1.")

    batch_size = raw.get("PURGE_BATCH_SIZE", DEFAULT_PURGE_BATCH_SIZE)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ImproperlyConfigured("INBOX['PURGE_BATCH_SIZE'] must be a positive integer.")

    batch_seconds = raw.get("PURGE_BATCH_SECONDS", DEFAULT_PURGE_BATCH_SECONDS)
    if (
        isinstance(batch_seconds, bool)
        or not isinstance(batch_seconds, int | float)
        or not 0 <= batch_seconds <= 1
    ):
        raise ImproperlyConfigured(
            "INBOX['PURGE_BATCH_SECONDS'] must be a number of seconds between 0 and 1."
        )

    strict = raw.get("STRICT_MESSAGE_ID", False)
    if not isinstance(strict, bool):
        raise ImproperlyConfigured("INBOX['STRICT_MESSAGE_ID'] must be True or False.")

    horizon_raw = raw.get("REDELIVERY_HORIZON")
    horizon = (
        timedelta(seconds=DEFAULT_FAILURE_TTL)
        if horizon_raw is None
        else _duration("INBOX['REDELIVERY_HORIZON']", horizon_raw)
    )

    return InboxSettings(
        retention=retention,
        purge_chance=float(chance),
        purge_batch_size=batch_size,
        purge_batch_seconds=float(batch_seconds),
        strict_message_id=strict,
        redelivery_horizon=horizon,
    )
