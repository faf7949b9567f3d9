"""What a system's event says, as facts the fence understands, and how a system reads them.

An event is a notification, not evidence: it carries a snapshot of one
object of the system as it was, and a leaked signing secret can make one up.
A system that pushes events declares an `EventSource` (its declaration's
`events`, payments.engine.systems): it turns a stored event into `Fact`s and
retrieves each fact's object by id (`current`), whose state then decides. The
webhooks plumbing (payments.webhooks) stores, deduplicates and settles through
that contract, naming no system.

A fact's `found` is an `EffectResult` shaped like the one the step's own
lookup (`effect.find`) would return, so a claim settled from an event carries
the same result as one settled by the reconciler. A snapshot still in progress
(a pending refund) is no fact yet (`found` is None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from payments.engine.effects import EffectResult


class SystemUnavailable(Exception):
    """The system could not be asked now (down, timed out, refused): try again later."""


@dataclass(frozen=True)
class Fact:
    """One object out of an event: what it is, and what it settles (None: nothing yet)."""

    #: The system's word for the object ("payment_intent", "refund", "invoice").
    object_type: str
    object_id: str
    found: EffectResult | None
    metadata: Mapping[str, str] = field(hash=False)
    amount: int
    currency: str
    #: The object this one belongs to (a refund's payment); its own id for a first object,
    #: which later steps of the operation may act on (a capture names its payment).
    parent: str = ""
    #: The system has no such object (retrieved by id): the event moves nothing.
    missing: bool = False
    #: The event's type: only the steps whose effect declares it (`EVENTS`) may be settled.
    event_type: str = ""
    #: The object as retrieved from the system (`current`); the claim's effect reads it.
    obj: Any = field(default=None, hash=False, compare=False)
    #: What an alert calls the money it moved ("charge", "refund"; "" : it moves none).
    noun: str = ""
    #: Items a claim's stored request must equal, where it carries them, for the fact to be
    #: that request's (a refund's request names the payment it refunds).
    names: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def first_object(self) -> bool:
        """Tell whether the object is an operation's first (later steps may act on it)."""
        return self.parent == self.object_id


class EventSource(Protocol):
    """How a system's stored events are read: the contract the webhooks plumbing calls."""

    def facts(self, event: Mapping[str, Any]) -> list[Fact]:
        """The facts a stored event (as received) carries; ValueError when malformed."""
        ...

    def current(self, fact: Fact) -> Fact:
        """The fact as the system shows it now (its object retrieved by id), `missing` when
        it has no such object; SystemUnavailable when it cannot be asked now."""
        ...
