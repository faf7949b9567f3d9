"""What the provider answered to each request of one piece of work, for the row that records it.

The provider client notes every request it sends (`sent`): method, path,
HTTP status, the provider's request id (Stripe's `Request-Id` header),
the idempotency key, whether it was a replay. Nothing is kept outside a
`recording()` block: the engine and the desk open one around each effect
call and lookup, so a page view or a script never leaves requests behind
for another operation's row; `collected()` hands a block's requests to a row
its caller writes after it (an operator's decision, written once the
provider was asked).

Inside the block the fence carries them in the row it writes anyway, in
the same statement: an audit row (`OperationEvent.requests`) takes what
was sent since the last one (`take`); a lookup's provider view copies them
(`peek`), since an audit row may follow it. No table is written per
request, so a checkout's path keeps its round trips.

No database here, and no provider: the client (payments.provider) calls
`sent`, the fence reads. A thread or asyncio task has a record of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

#: The most requests one row carries (a list walked page by page is the long case).
MAX_PER_ROW = 20

_SENT: ContextVar[list[dict[str, Any]] | None] = ContextVar("provider_requests", default=None)

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def recording() -> Iterator[None]:
    """Note the provider requests sent in the block; a block inside another joins it.

    What no row took by the end of the outermost block is dropped.
    """
    if _SENT.get() is not None:
        yield
        return
    token = _SENT.set([])
    try:
        yield
    finally:
        _SENT.reset(token)


@contextmanager
def collected() -> Iterator[list[dict[str, Any]]]:
    """Note the block's requests apart (not joining an outer block); the list yielded holds,
    once the block ends, those no row took in it: for a row its caller writes after."""
    left: list[dict[str, Any]] = []
    token = _SENT.set([])
    try:
        yield left
    finally:
        left.extend(take() or [])
        _SENT.reset(token)


def recorded(func: Callable[P, R]) -> Callable[P, R]:
    """Run `func` inside `recording()`."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with recording():
            return func(*args, **kwargs)

    return wrapper


def sent(
    method: str,
    path: str,
    *,
    status: int | None,
    request_id: str | None,
    idempotency_key: str | None = None,
    replayed: bool = False,
    error: str = "",
) -> None:
    """Note one request and what came back (`status` None: no answer; `error` says why)."""
    record = _SENT.get()
    if record is None:
        return
    exchange: dict[str, Any] = {"method": method, "path": path, "status": status}
    if request_id:
        exchange["request_id"] = request_id[:255]
    if idempotency_key:
        exchange["idempotency_key"] = idempotency_key
    if replayed:
        exchange["replayed"] = True
    if error:
        exchange["error"] = error[:100]
    record.append(exchange)


def take() -> list[dict[str, Any]] | None:
    """Return the requests noted since the last `take` and forget them; None when none."""
    record = _SENT.get()
    if not record:
        return None
    taken = list(record)
    record.clear()
    return taken


def peek() -> list[dict[str, Any]] | None:
    """Return the requests noted since the last `take`, keeping them; None when none."""
    record = _SENT.get()
    return list(record) if record else None


def bounded(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last MAX_PER_ROW of `requests`: what one row keeps."""
    return requests[-MAX_PER_ROW:]
