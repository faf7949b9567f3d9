"""The key to the fence's rows: Operation, StepClaim and OperationEvent change only inside it.

Their manager and `save()`/`delete()` refuse to write outside `fence_writes()`
(payments.models.FenceModel), and only `payments.engine.fence` opens it: an
import-linter contract forbids every other production module to import this
one. So the runtime, recovery, the desk and the API change a state only by
calling the fence, which asks the transition table; a stray `.update()` in a
view or a handler fails loudly instead of skipping the table.

Tests that hand-make a state (a lease run out, a timestamp in the past) open
it themselves and say so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

_WRITING: ContextVar[bool] = ContextVar("fence_writes", default=False)

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def fence_writes() -> Iterator[None]:
    """Allow writes to the fence's rows inside the block (this thread or task only)."""
    token = _WRITING.set(True)
    try:
        yield
    finally:
        _WRITING.reset(token)


def fence_writer(func: Callable[P, R]) -> Callable[P, R]:
    """Run `func` with the fence's rows open for writing."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with fence_writes():
            return func(*args, **kwargs)

    return wrapper


def writing() -> bool:
    """Tell whether the fence's rows are open for writing here."""
    return _WRITING.get()
