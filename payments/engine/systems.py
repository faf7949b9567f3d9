"""External systems, declared once: what the fence must know of each system it calls.

The protocol never depended on one provider; what differs per system is its
idempotency contract (the key's header, scope and retention, whether a reused
key with other parameters is refused), the reads it offers to settle a lost
answer, whether it moves money, how its references look and how the desk words
it. A package that adds a system declares it (`declare`) and names it on its
effects (`SYSTEM`); a deployment configures it under `PAYMENTS["SYSTEMS"]`
(`payments.conf`: URL, credentials, timeouts, and the key retention its contract
documents). The engine and the desk read the declaration, never a system's name.

**The uncertainty clock.** A same-key replay is safe only while the system keeps
the key: `replay_deadline` is the key's first use plus the system's retention,
less a margin (an hour, or a quarter of a short retention). The clock counts from
the first request, not the last: a replay does not extend a key's life at the
systems we know (the key is stored when first used). Past the deadline the engine
never replays (the system could execute the request again); what the system's
reads cannot settle goes to review with its evidence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from payments.exceptions import ConfigurationError

#: The system an effect talks to when it names none: the payment provider of the
#: PROVIDER_* settings.
DEFAULT_SYSTEM = "provider"
#: The most margin kept under a system's key retention before a replay is refused.
MOST_MARGIN = timedelta(hours=1)


class NotAtSystem(LookupError):
    """The system does not know the reference (a `describe` that found nothing)."""


@dataclass(frozen=True)
class Described:
    """What a system's object says of where it came from: its metadata and its status."""

    metadata: Mapping[str, str]
    status: str
    amount: int | None = None
    currency: str = ""


@dataclass(frozen=True)
class LedgerEntry:
    """One object a system's consistent list shows, as the fence audit reads it."""

    id: str
    #: Whether it moved what it was made for (taken, refunded): the audit counts these.
    succeeded: bool
    metadata: Mapping[str, str]
    #: What it moved, in minor units (a payment: what was received, else what was asked).
    amount: int
    #: When the system made it (Unix seconds, its clock).
    created: int
    #: The object it belongs to (a refund's payment); "" for a payment.
    parent: str = ""


@dataclass(frozen=True)
class Ledger:
    """A system's payments and refunds made in a window, from its consistent lists."""

    payments: list[LedgerEntry]
    refunds: list[LedgerEntry]


class Read(StrEnum):
    """A consistent read a system offers to settle a lost answer."""

    RETRIEVE = "retrieve"  # one object by the system's own id
    LIST_BY_REFERENCE = "list_by_reference"  # objects carrying a reference the fence sent
    LIST_BY_CREATED = "list_by_created"  # objects created in a time window


@dataclass(frozen=True)
class ExternalSystem:
    """One external system's contract, as the fence needs it."""

    #: Its entry in PAYMENTS["SYSTEMS"] (the payment provider: "provider", PROVIDER_*).
    name: str
    #: How the desk names it: "the payment provider", "the accounting system".
    label: str
    #: Its idempotency contract.
    key_header: str = "Idempotency-Key"
    key_scope: str = "account"
    #: How long it keeps a key, in seconds, as its documentation states (the settings
    #: entry's KEY_RETENTION overrides it for a deployment).
    key_retention: int = 24 * 3600
    #: Whether a reused key with other parameters is refused (else: a second object).
    compares_parameters: bool = True
    #: The reads that can settle a lost answer, strongest first; none: only a replay
    #: within retention, an event, or a person with a report.
    reads: tuple[Read, ...] = ()
    #: Whether its steps move money (the desk's money at stake, the audit's totals).
    moves_money: bool = True
    #: Regular expressions its references match (desk search, links).
    reference_patterns: tuple[str, ...] = ()
    #: What it calls the objects it makes, for the desk ("payment", "invoice").
    object_noun: str = "object"
    #: Retrieve one object by a reference (desk search follows its metadata to the
    #: operation): None for a reference of a kind it does not retrieve; raises
    #: NotAtSystem when the system has no such object, anything else when it cannot be
    #: asked. None: the system offers no retrieve. It runs on a lookup thread of the
    #: desk's (payments.desk.views.search), a few seconds waited for: it asks the system
    #: and reads no database.
    describe: Callable[[str], Described | None] | None = field(default=None, compare=False)
    #: How its pushed events are read (payments.engine.facts.EventSource); None: it
    #: pushes none the fence reads.
    events: Any = field(default=None, compare=False)
    #: Its payments and refunds created in a window of Unix seconds [from, to], for the
    #: fence audit (a Ledger); None: it offers no such list (the audit says so).
    ledger: Callable[[int, int], Ledger] | None = field(default=None, compare=False)
    _compiled: tuple[re.Pattern[str], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ConfigurationError(
                f"an external system's name is an identifier, not {self.name!r}"
            )
        if self.key_retention < 60:
            raise ConfigurationError(f"system {self.name}: key_retention under a minute")
        compiled = tuple(re.compile(p) for p in self.reference_patterns)
        object.__setattr__(self, "_compiled", compiled)

    def names_reference(self, term: str) -> bool:
        """Tell whether `term` looks like one of this system's references."""
        return any(p.fullmatch(term) for p in self._compiled)


_declared: dict[str, ExternalSystem] = {}


def declare(system: ExternalSystem) -> ExternalSystem:
    """Declare a system (once; the same declaration again is a no-op)."""
    known = _declared.get(system.name)
    if known is not None and known != system:
        raise ConfigurationError(f"external system {system.name!r} is declared twice, differently")
    _declared[system.name] = system
    return system


def declared() -> list[ExternalSystem]:
    """Every declared system, by name."""
    return [_declared[name] for name in sorted(_declared)]


def system_named(name: str) -> ExternalSystem:
    """The declaration of `name`; ConfigurationError naming the declared ones otherwise."""
    try:
        return _declared[name]
    except KeyError:
        known = ", ".join(sorted(_declared)) or "none"
        raise ConfigurationError(
            f"no external system {name!r} is declared (declared: {known}); a package declares "
            "its system with payments.fence.declare_system, which runs when its module is "
            "imported: import the declaration where the effect is defined "
            "(SYSTEM = declared.name)"
        ) from None


def system_of(effect: Any) -> ExternalSystem:
    """The system an effect (class or instance) talks to: its SYSTEM, else the provider."""
    return system_named(str(getattr(effect, "SYSTEM", "") or DEFAULT_SYSTEM))


def key_retention(system: ExternalSystem) -> timedelta:
    """How long the system keeps a key in this deployment (its settings entry, else its
    declaration)."""
    from payments.conf import payments_settings

    configured = payments_settings().key_retention_of(system.name)
    return timedelta(seconds=configured or system.key_retention)


def replay_margin(retention: timedelta) -> timedelta:
    """The margin kept under a key's retention: an hour, or a quarter of a short one."""
    return min(MOST_MARGIN, retention / 4)


def replay_deadline(system: ExternalSystem, first_request_at: datetime) -> datetime:
    """The last moment a same-key replay to `system` is safe for a key first used then."""
    retention = key_retention(system)
    return first_request_at + retention - replay_margin(retention)


def reference_system(term: str) -> ExternalSystem | None:
    """The declared system whose references `term` looks like, or None."""
    return next((s for s in declared() if s.names_reference(term)), None)
