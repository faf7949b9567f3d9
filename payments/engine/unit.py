"""A fenced handler's open transaction: its writes commit with the next claim or at its end.

Between two calls to the outside world (a provider call, an e-mail) nothing
is gained by committing each write apart: a crash loses the same thing either
way, the writes since the last call, and they run again on the next attempt.
So a handler's writes between two calls go in one transaction, the unit:

    lease, with the charge's claim           one round trip           (commit 1)  -> call
    charge's outcome, invoice, e-mail claim  the unit                 (commit 2)  -> send
    e-mail's outcome, mark_paid, release     the unit                 (commit 3)

(The charge's claim rides the lease because the checkout declares it opens with
it, `opens_with`; a handler that does not claims its first step in a statement of
its own, outside the unit, before the call: docs/design.md.)

Rules (the runtime and `Run` keep them; a handler never sees the unit):

- The claim that fences a call commits before the call, with the unit
  (`commit_with()`: the claim's statement and the COMMIT in one round trip):
  the guarantee "claimed before called" is unchanged.
- An outcome already known outside (a call's answer, an e-mail sent) is
  queued in the unit with `record_outcome()`: it goes in the pipeline of the
  unit's next fence statement or with its COMMIT, in no round trip of its
  own. If the unit then rolls back, the outcome is written again on its own,
  so a later step's failure never loses it. A crash before the unit commits
  loses it, as a crash between the answer and its own commit did: the claim
  stays claimed, and the step is settled from the provider (its lookup, or
  the same-key replay) like any claim whose answer was lost. If it settles
  nothing when sent (the claim was taken over meanwhile), nothing queued
  behind it runs, the COMMIT included (OutcomeRefused), and the unit rolls
  back.
- A local step that had no claim at the lease runs first; its claim, with
  its result, is queued (fence.queue_local_claim_in_tx) and goes in the
  pipeline of the unit's next fence statement or with its COMMIT: it
  commits with the writes, in no round trip of its own. If another run did
  the step meanwhile, that statement fails before anything behind it runs
  (StepDoneMeanwhile) and the unit rolls back.
- A local step whose function raises rolls the unit back (`roll_back()`):
  its partial writes go, and with them the local steps done since the last
  commit, claims included, so they run again on the next attempt exactly as
  after a crash at that point. The rest of the run then refuses to go on
  (UnitRolledBack), even if the handler caught the error.
- A step inside the handler's own `transaction.atomic()` is refused
  (InvalidTransition): the unit must be the outermost transaction, or its
  COMMIT would only release a savepoint.
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

from payments.engine import exchanges, fence, telemetry
from payments.engine.follow_ups import local_step_running
from payments.exceptions import InvalidTransition, StepDoneMeanwhile
from payments.models import ClaimState, Operation, StepClaim

logger = logging.getLogger("payments.engine.unit")
#: A step's own lines (replayed, skipped) keep the logger they had in Run (handlers.py).
step_logger = logging.getLogger("payments.engine.runtime")

T = TypeVar("T")


class UnitRolledBack(DatabaseError):
    """The run's open transaction rolled back: what it held is lost, the operation runs again.

    Raised when an aborted transaction could not commit, and by every later
    step of a run whose open transaction a failing local step rolled back (a
    handler that catches that failure must not carry on as if the steps
    before it were done): the runtime counts a failed attempt and retries.
    """


def _aborted() -> bool:
    """Tell whether an error aborted this connection's transaction (only ROLLBACK is left)."""
    raw = connection.connection
    return connection.needs_rollback or (
        raw is not None and raw.info.transaction_status == pq.TransactionStatus.INERROR
    )


NESTED = (
    "a fenced handler's steps must not run inside its own transaction.atomic(): the run "
    "commits each claim before its call and cannot inside an outer transaction"
)


class WorkUnit:
    """The open transaction of one handler run (see the module's docstring)."""

    def __init__(self) -> None:
        self._atomic: Any = None
        self._redo: list[Callable[[], object]] = []
        self._lost: str | None = None

    @property
    def is_open(self) -> bool:
        return self._atomic is not None

    @property
    def intact(self) -> bool:
        """False once a rollback lost what this run's steps had written."""
        return self._lost is None

    def require_intact(self) -> None:
        """Raise UnitRolledBack if a rollback lost what this run's steps had written."""
        if self._lost is not None:
            raise UnitRolledBack(self._lost)

    def join(self) -> None:
        """Open the unit's transaction unless it is open (BEGIN goes with its first statement).

        Refused (InvalidTransition) inside the handler's own atomic() block,
        and after a rollback lost earlier steps (UnitRolledBack).
        """
        self.require_intact()
        if self._atomic is None:
            if connection.in_atomic_block:
                raise InvalidTransition(NESTED)
            self._atomic = transaction.atomic()
            self._atomic.__enter__()
        elif connection.atomic_blocks[-1] is not self._atomic:
            raise InvalidTransition(NESTED)

    def local_step(
        self,
        operation: Operation,
        step: str,
        func: Callable[[], dict[str, Any] | None],
        *,
        owner: str,
        claim_first: bool,
    ) -> dict[str, Any]:
        """Run a local step in the unit: its `done` claim and its writes commit together, once.

        `claim_first`: insert the claim before `func` runs, so a step done before
        is replayed (its stored result) without running `func` again; a
        concurrent duplicate waits on the claim's unique key and, once the first
        commits, replays the step. Otherwise (a step the lease found unclaimed)
        `func` runs first and its claim, with its result, is queued
        (fence.queue_local_claim_in_tx): it goes in front of the unit's next
        fence statement or with its COMMIT, in no round trip of its own. If
        another run committed the step meanwhile, that later statement raises
        StepDoneMeanwhile; so does this call when `func` failed on the rows the
        other run wrote (a unique invoice number): the operation runs again at
        once, uncounted, and replays the step. If `func` raises, the unit rolls
        back: this step and the local steps since the last claim run again on
        the next attempt.
        """
        self.join()
        if not claim_first:
            return self._run_then_claim(operation, step, func, owner=owner)
        try:
            claim = fence.insert_local_claim_in_tx(operation, step, owner=owner)
        except BaseException as exc:  # a queued claim sent with it was taken meanwhile, ...
            self.roll_back(f"local step {step} could not claim ({type(exc).__name__})")
            raise
        if claim is None:
            existing = StepClaim.objects.get(operation=operation, step=step)
            telemetry.note(outcome=telemetry.SKIPPED, transaction=telemetry.NONE)
            step_logger.info("step %s/%s already done; skipped", operation.key, step)
            return existing.result or {}
        try:
            with local_step_running():
                result = func() or {}
            fence.store_local_result_in_tx(claim, result)
        except BaseException as exc:
            self.roll_back(f"local step {step} failed ({type(exc).__name__})")
            raise
        return result

    def _run_then_claim(
        self,
        operation: Operation,
        step: str,
        func: Callable[[], dict[str, Any] | None],
        *,
        owner: str,
    ) -> dict[str, Any]:
        """`func`, then its claim queued in the unit (see `local_step`)."""
        try:
            with local_step_running():
                result = func() or {}
            fence.queue_local_claim_in_tx(operation, step, owner=owner, result=result)
        except BaseException as exc:
            self.roll_back(f"local step {step} failed ({type(exc).__name__})")
            # An interruption (the job's timeout) stays what it is, whatever else happened.
            if not fence.is_interruption(exc) and _claimed_elsewhere(operation, step):
                raise StepDoneMeanwhile(operation_key=operation.key, step=step) from exc
            raise
        return result

    def record_outcome(self, claim: StepClaim, state: ClaimState, **settled: Any) -> None:
        """Queue a claim's outcome, known outside, in the unit (fence.queue_outcome_in_tx,
        `settled` its arguments); write it alone if the unit rolls back
        (fence.settle_claim_again), with the same provider requests (exchanges.take)."""
        self.join()
        settled.setdefault("requests", exchanges.take())
        fence.queue_outcome_in_tx(claim, state, **settled)
        self._redo.append(lambda: fence.settle_claim_again(claim, state, **settled))

    def commit(self) -> None:
        """Commit what the unit holds (nothing to do when it is not open).

        A transaction a database error aborted is not committed (PostgreSQL
        would turn the COMMIT into a silent ROLLBACK): it is rolled back, the
        recorded outcomes are written again on their own, and
        UnitRolledBack says so. A commit that fails does the same.
        """
        self.require_intact()
        atomic = self._atomic
        if atomic is None:
            return
        if fence.has_queued():
            # Local claims wait for the next fence statement: they go with the COMMIT.
            self.commit_with(fence.send_queued_in_tx)
            return
        if connection.atomic_blocks != [atomic]:
            raise InvalidTransition(NESTED)  # its COMMIT would only release a savepoint
        if _aborted():
            self.roll_back("a database error aborted the handler's open transaction")
            raise UnitRolledBack(self._lost)
        self._atomic = None
        try:
            atomic.__exit__(None, None, None)
        except BaseException:
            self._lost = "the handler's open transaction failed to commit"
            self._rewrite()
            raise
        self._redo = []

    def commit_with(self, statement: Callable[[], T]) -> T:
        """Run one fence statement and commit the unit with it, in one round trip.

        For the statement the unit must commit with (a claim before its call,
        the operation's release). Its COMMIT goes with it
        (fence.commit_with_next_statement) and is not run if it fails; a
        failure of either rolls the unit back as `commit()` would. Without an
        open unit the statement commits on its own.
        """
        self.require_intact()
        atomic = self._atomic
        if atomic is None:
            return statement()
        if connection.atomic_blocks != [atomic]:
            raise InvalidTransition(NESTED)  # its COMMIT would only release a savepoint
        if _aborted():
            self.roll_back("a database error aborted the handler's open transaction")
            raise UnitRolledBack(self._lost)
        try:
            with fence.commit_with_next_statement() as sent:
                result = statement()
        except BaseException:
            if sent.committed:  # the error came after the COMMIT: what the unit held is durable
                self._close_committed(atomic)
            else:
                self.roll_back("the handler's open transaction failed to commit")
            raise
        if sent.committed:
            self._close_committed(atomic)
        else:  # the statement did not go through the fence's cursor: commit as usual
            self.commit()
        return result

    def _close_committed(self, atomic: Any) -> None:
        """End Django's side of a transaction whose COMMIT was sent (psycopg sends nothing)."""
        self._atomic = None
        self._redo = []
        atomic.__exit__(None, None, None)

    def roll_back(self, why: str) -> None:
        """Roll the unit back and rewrite the recorded outcomes; later steps of this run refuse.

        What the unit held (the local steps since the last claim, claims
        included) is gone; they run again on the next attempt.
        """
        atomic, self._atomic = self._atomic, None
        fence.discard_queued()  # the local claims waiting for the next statement go with it
        if atomic is None:
            return
        self._lost = f"{why}; the steps written since the last claim were rolled back"
        exc_type, exc, tb = sys.exc_info()
        if exc is None:
            exc_type, exc, tb = RuntimeError, RuntimeError(why), None
        atomic.__exit__(exc_type, exc, tb)
        self._rewrite()

    def _rewrite(self) -> None:
        redo, self._redo = self._redo, []
        for write in redo:
            try:
                write()
            except Exception:  # the next attempt or the reconciler settles it
                logger.exception("an outcome could not be written again after a rollback")


def _claimed_elsewhere(operation: Operation, step: str) -> bool:
    """Tell whether another run has committed a claim of `step` (after this run's rollback)."""
    try:
        return StepClaim.objects.filter(operation=operation, step=step).exists()
    except DatabaseError:
        return False
