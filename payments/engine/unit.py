"""A fenced handler's open transaction: its writes commit with the next claim or at its end.

Between two calls to the outside world (a provider call, an e-mail) nothing
is gained by committing each write apart: a crash loses the same thing either
way, the writes since the last call, and they run again on the next attempt.
So a handler's writes between two calls go in one transaction, the unit:

    lease                                    its own statement        (commit 1)
    claim the charge                         its own statement        (commit 2)  -> call
    charge's outcome                         its own statement        (commit 3)
    invoice, the e-mail's claim              the unit                 (commit 4)  -> send
    e-mail's outcome, mark_paid, release     the unit                 (commit 5)

Rules (the runtime and `Run` keep them; a handler never sees the unit):

- The claim that fences a call commits before the call, with the unit
  (`commit()`): the guarantee "claimed before called" is unchanged.
- An outcome already known outside (an e-mail sent) is written in the unit
  with `record()`; if the unit then rolls back, the outcome is written again
  on its own, so a later step's failure never loses it.
- A local step whose function raises rolls the unit back (`roll_back()`):
  its partial writes go, and with them the local steps done since the last
  commit, claims included, so they run again on the next attempt exactly as
  after a crash at that point.
- The runtime ends the unit with the operation's release when the handler
  returns, and commits it before it handles a step's failure.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError, connection, transaction
from psycopg import pq

logger = logging.getLogger("payments.engine.unit")

T = TypeVar("T")


class UnitRolledBack(DatabaseError):
    """The open transaction could not commit: it was rolled back, recorded outcomes rewritten."""


def _aborted() -> bool:
    """Tell whether this connection's transaction was aborted by an error (only ROLLBACK is left)."""
    raw = connection.connection
    return connection.needs_rollback or (
        raw is not None and raw.info.transaction_status == pq.TransactionStatus.INERROR
    )


class WorkUnit:
    """The open transaction of one handler run (see the module's docstring)."""

    def __init__(self) -> None:
        self._atomic: Any = None
        self._redo: list[Callable[[], object]] = []

    @property
    def is_open(self) -> bool:
        return self._atomic is not None

    def join(self) -> None:
        """Open the unit's transaction unless it is open (BEGIN goes with its first statement)."""
        if self._atomic is None:
            self._atomic = transaction.atomic()
            self._atomic.__enter__()

    def record(self, write: Callable[[], T]) -> T:
        """Write an outcome already known outside, in the unit; again on its own if it rolls back."""
        self.join()
        result = write()
        self._redo.append(write)
        return result

    def commit(self) -> None:
        """Commit what the unit holds (nothing to do when it is not open).

        A transaction a database error aborted is not committed (PostgreSQL
        would turn the COMMIT into a silent ROLLBACK): it is rolled back, the
        recorded outcomes are written again on their own, and
        UnitRolledBack says so. A commit that fails does the same.
        """
        atomic = self._atomic
        if atomic is None:
            return
        if _aborted():
            self.roll_back()
            raise UnitRolledBack("a database error aborted the handler's open transaction")
        self._atomic = None
        try:
            atomic.__exit__(None, None, None)
        except BaseException:
            self._rewrite()
            raise
        self._redo = []

    def roll_back(self) -> None:
        """Roll the unit back (a local step's function raised); rewrite the recorded outcomes."""
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            return
        exc_type, exc, tb = sys.exc_info()
        if exc is None:
            exc_type, exc, tb = RuntimeError, RuntimeError("unit rolled back"), None
        atomic.__exit__(exc_type, exc, tb)
        self._rewrite()

    def _rewrite(self) -> None:
        redo, self._redo = self._redo, []
        for write in redo:
            try:
                write()
            except Exception:  # the next attempt or the reconciler settles it
                logger.exception("an outcome could not be written again after a rollback")
