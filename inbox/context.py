"""Know whether the current code runs inside an inbox-protected handler.

A leaf module (no models) so :mod:`inbox.queues` can import it while
django-rq resolves the queue class before the app registry is ready.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class HandledMessage:
    """The message whose handler is running in this context."""

    consumer: str
    message_id: str


# A ContextVar, not a thread-local: it follows the handler into nested calls
# and is reset by token, so nested guards restore the outer message.
_current: ContextVar[HandledMessage | None] = ContextVar("inbox_current_message", default=None)


def current_message() -> HandledMessage | None:
    """Return the message being handled here, or None outside any inbox guard."""
    return _current.get()


@contextmanager
def handling(consumer: str, message_id: str) -> Iterator[None]:
    """Mark the enclosed code as running inside the handler of this message."""
    token = _current.set(HandledMessage(consumer=consumer, message_id=message_id))
    try:
        yield
    finally:
        _current.reset(token)
