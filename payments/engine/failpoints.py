"""Named crash points for fault-injection tests: a worker can be killed exactly there.

Honoured only with DEBUG on and FENCE_FAILPOINTS naming the point (a comma
list). FENCE_FAILPOINT_MARKER names a file created atomically on the first
hit, so each point kills once and the redelivered job runs through.
In production both variables are unset and `failpoint` returns at once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.conf import settings

AFTER_CLAIM_COMMIT = "after_claim_commit"
AFTER_PROVIDER_ACCEPT = "after_provider_accept"
BEFORE_RECORD_COMMIT = "before_record_commit"
AFTER_RECORD_COMMIT = "after_record_commit"
#: The fence's points, in protocol order (each is covered by a crash test).
POINTS = (AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, BEFORE_RECORD_COMMIT, AFTER_RECORD_COMMIT)
#: A follow-up message whose handler and inbox row committed, before the job is acked.
AFTER_INBOX_COMMIT = "after_inbox_commit"
#: The last transient attempt released its claim and is about to give up (under the op's lock).
BEFORE_GIVE_UP = "before_give_up"

#: In-process hooks by point name, for tests that drive a race deterministically
#: (a callback runs where a crash test would kill). Production registers none.
_HOOKS: dict[str, Callable[[], None]] = {}


def point_at(name: str, qualifier: str) -> str:
    """A point at one step (or one operation kind) only: `after_provider_accept@charge`."""
    return f"{name}@{qualifier}"


@contextmanager
def hooked(name: str, callback: Callable[[], None]) -> Iterator[None]:
    """Run `callback` whenever this process reaches the point `name` (every step's), or
    `point_at(name, step)` (that step's only), inside the block."""
    _HOOKS[name] = callback
    try:
        yield
    finally:
        _HOOKS.pop(name, None)


def failpoint(name: str, step: str = "") -> None:
    """Run a test's hook at the named point, or SIGKILL this process when a test asked for it.

    A test names the point (`after_provider_accept`), or the point at one step only
    (`after_provider_accept@capture`) when an operation has several external steps.
    """
    hook = _HOOKS.get(point_at(name, step)) or _HOOKS.get(name)
    if hook is not None:
        hook()
    wanted = os.environ.get("FENCE_FAILPOINTS")
    if not wanted or not settings.DEBUG:
        return
    asked = wanted.split(",")
    token = name if name in asked else point_at(name, step) if point_at(name, step) in asked else ""
    if not token:
        return
    marker = os.environ.get("FENCE_FAILPOINT_MARKER")
    if marker:
        try:
            os.close(os.open(f"{marker}.{token}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # fired once already
    os.kill(os.getpid(), signal.SIGKILL)
