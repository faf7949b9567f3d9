"""Follow-ups declared by the package that runs them, not listed where they are written.

A business event (a paid order) is written by one package (the checkout's
`mark_paid`, the capture's `record`); what follows it is declared by each package
that has something to do then: the checkout's ledger line and sales counter, the
invoice export where the deployment turns it on, an e-mail provider's
confirmation. The writer asks `kinds_following(event)` and writes one operation
per kind, in its own transaction; a package that adds a follow-up edits no other.

A follow-up may replace a built-in effect of the writer (the checkout's own
confirmation e-mail, when an e-mail provider sends it instead). That is decided
once, where the effect would be made: the writer asks `replaced_by(event,
effect)`, skips its own and records which kind makes it instead; when it writes
the event's follow-ups it names that record (`made_by`), and a replacing kind is
written only where a record names it. So the customer gets the effect once even
if `when` (read from settings each time) changes between the two steps, or a
writer that never makes the effect (a capture sends no confirmation) writes
the event. One follow-up at most may replace a given effect of an event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from payments.exceptions import ConfigurationError


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Follows:
    """What an operation follows (`@operation(..., follows=Follows(ORDER_PAID))`).

    - `event`: the business event's name (payments.shop.entities.ORDER_PAID).
    - `when()`: whether this deployment runs the follow-up (read from settings, each time).
    - `replaces`: a built-in effect of the event's writer this follow-up makes instead
      (payments.shop.entities.ORDER_CONFIRMATION: the checkout's own confirmation e-mail).
    """

    event: str
    when: Callable[[], bool] = _always
    replaces: str | None = None


@dataclass(frozen=True)
class FollowUp:
    """One declaration: operations of `kind` follow `follows.event`."""

    kind: str
    follows: Follows


_FOLLOW_UPS: list[FollowUp] = []


def declare_follow_up(kind: str, follows: Follows) -> None:
    """Declare that operations of `kind` follow `follows.event` (through `@operation` and
    `@message`, which check first that workers discover the declaring module)."""
    for known in _FOLLOW_UPS:
        if known.kind == kind and known.follows.event == follows.event:
            if known.follows == follows:
                return  # the same declaration again
            raise ConfigurationError(
                f"{kind!r} is already declared a follow-up of {follows.event!r}"
            )
        if follows.replaces is not None and (known.follows.event, known.follows.replaces) == (
            follows.event,
            follows.replaces,
        ):
            raise ConfigurationError(
                f"{kind!r} and {known.kind!r} both replace {follows.replaces!r} of "
                f"{follows.event!r}: the effect would be made twice; keep one"
            )
    _FOLLOW_UPS.append(FollowUp(kind, follows))


def kinds_following(event: str, *, made_by: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The kinds to write with `event`, in the order they were declared: those that
    replace nothing, where `when()` holds; and the replacing kinds the writer recorded
    as making one of its effects instead (`made_by`, from `replaced_by`), whatever
    `when()` says now."""
    return tuple(
        f.kind
        for f in _FOLLOW_UPS
        if f.follows.event == event
        and (f.kind in made_by if f.follows.replaces is not None else f.follows.when())
    )


def replaced_by(event: str, effect: str) -> str | None:
    """The follow-up kind of `event` that makes the writer's `effect` instead, or None."""
    for f in _FOLLOW_UPS:
        if (f.follows.event, f.follows.replaces) == (event, effect) and f.follows.when():
            return f.kind
    return None


#: Set while a fenced handler's local step runs its function: the step's claim, in the
#: same transaction, makes whatever it writes happen once (payments.engine.handlers.Run).
_IN_LOCAL_STEP: ContextVar[bool] = ContextVar("in_local_step", default=False)


@contextmanager
def local_step_running() -> Iterator[None]:
    """Mark the code inside as a local step's function (its writes commit once, with its claim)."""
    token = _IN_LOCAL_STEP.set(True)
    try:
        yield
    finally:
        _IN_LOCAL_STEP.reset(token)


def written_once() -> bool:
    """Tell whether the caller is a local step's function: what it writes commits once."""
    return _IN_LOCAL_STEP.get()
