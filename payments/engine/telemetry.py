"""One structured record when a step attempt starts and one when it ends.

The runtime and the step protocol are wrapped with `traced(...)`, a decorator
built on the `step_attempt` context manager, so their bodies stay as they are.
Both records go to the `payments.engine.telemetry` logger with these fields (see
docs/observability.md):

    event            step.start | step.end
    message_type     the operation's kind (which handler runs it)
    operation_key, step, step_kind (external | local | side_effect),
    entity_type, entity_id, attempt (the operation's run attempt), worker_id
    started_at, ended_at (ISO 8601, UTC), duration_ms       (end only)
    transaction      commit | rollback | none               (end only)
    outcome          success | permanent | transient | uncertain | conflict
                     | skipped | busy                       (end only)
    provider_reference, error (an exception class name)     (end only)

An attempt nested in another one for the same (operation, step), e.g.
`call_effect` inside `run_external_step`, logs nothing of its own: the outer
attempt reports once. Every attempt that wraps a provider call (`call=True`)
counts that call, by its own outcome, in `payments_provider_calls_total`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from payments.engine.outcomes import Outcome
from payments.engine.signals import provider_call_finished
from payments.exceptions import StepBusy, StepDoneMeanwhile, StepError
from payments.models import Operation

logger = logging.getLogger("payments.engine.telemetry")

F = TypeVar("F", bound=Callable[..., Any])

SKIPPED = "skipped"
BUSY = "busy"
PERMANENT = Outcome.PERMANENT.value
COMMIT, ROLLBACK, NONE = "commit", "rollback", "none"
#: Every outcome class a step.end record can carry.
OUTCOMES = (*(o.value for o in Outcome), SKIPPED, BUSY)


@dataclass
class StepAttempt:
    """What is known of one attempt; the step's code may fill in more with `note()`."""

    operation: Operation
    step: str
    step_kind: str
    worker_id: str
    call: bool = False
    #: The outermost attempt at the same step (itself when not nested): it does the logging.
    root: StepAttempt | None = None
    outcome: str | None = None
    transaction: str | None = None
    reference: str = ""
    error: str = ""
    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    _clock: float = field(default_factory=time.monotonic)

    def fields(self) -> dict[str, Any]:
        op = self.operation
        return {
            "message_type": op.kind,
            "operation_key": op.key,
            "step": self.step,
            "step_kind": self.step_kind,
            "entity_type": op.entity_type,
            "entity_id": str(op.entity_id),
            "attempt": op.attempts + 1,
            "worker_id": self.worker_id,
            "started_at": self.started.isoformat(),
        }


_current: ContextVar[StepAttempt | None] = ContextVar("payments_step_attempt", default=None)


def note(
    *, outcome: str | None = None, transaction: str | None = None, reference: str | None = None
) -> None:
    """Tell the running attempt what its result alone does not show (a skip, a reference)."""
    attempt = _current.get()
    if attempt is None:
        return
    for target in {id(attempt): attempt, id(attempt.root): attempt.root}.values():
        if target is None:
            continue
        if outcome is not None:
            target.outcome = outcome
        if transaction is not None:
            target.transaction = transaction
        if reference:
            target.reference = reference


@contextmanager
def step_attempt(
    operation: Operation, step: str, *, step_kind: str, worker_id: str, call: bool = False
) -> Iterator[StepAttempt]:
    """Log the start and the end of one attempt at `step`; yield the attempt to fill in."""
    outer = _current.get()
    nested = outer is not None and outer.operation.pk == operation.pk and outer.step == step
    attempt = StepAttempt(operation, step, step_kind, worker_id, call=call)
    attempt.root = outer.root if nested and outer is not None else attempt
    if not nested and logger.isEnabledFor(logging.INFO):
        logger.info(
            "step %s/%s started",
            operation.key,
            step,
            extra={"event": "step.start", **attempt.fields()},
        )
    token = _current.set(attempt)
    try:
        yield attempt
    except BaseException as exc:
        _settle_from_exception(attempt, exc)
        raise
    else:
        attempt.outcome = attempt.outcome or Outcome.SUCCESS.value
        attempt.transaction = attempt.transaction or COMMIT
    finally:
        _current.reset(token)
        if call:
            provider_call_finished.send(
                sender=None,
                outcome=attempt.outcome or Outcome.UNCERTAIN.value,
                kind=attempt.operation.kind,
                step=attempt.step,
            )
        if attempt.root is attempt:
            _log_end(attempt)
        elif attempt.root is not None:
            attempt.root.reference = attempt.root.reference or attempt.reference


def _settle_from_exception(attempt: StepAttempt, exc: BaseException) -> None:
    """Classify a step's exception unless the step already said what happened."""
    attempt.error = type(exc).__name__
    if attempt.outcome is None:
        if isinstance(exc, StepBusy):
            attempt.outcome = BUSY
        else:
            # An unclassified error is retried as transient by the runtime.
            attempt.outcome = str(getattr(exc, "outcome", Outcome.TRANSIENT))
    if attempt.transaction is None:
        if isinstance(exc, StepDoneMeanwhile):
            attempt.transaction = ROLLBACK  # taken over meanwhile: this run's unit rolled back
        elif isinstance(exc, StepBusy):
            attempt.transaction = NONE
        elif isinstance(exc, StepError) and attempt.step_kind != "local":
            attempt.transaction = COMMIT  # the fence recorded the claim's new state
        else:
            attempt.transaction = ROLLBACK


def _log_end(attempt: StepAttempt) -> None:
    level = logging.INFO
    if attempt.outcome in (Outcome.UNCERTAIN, Outcome.CONFLICT):
        level = logging.WARNING
    if not logger.isEnabledFor(level):
        return
    ended = datetime.now(UTC)
    logger.log(
        level,
        "step %s/%s ended: %s",
        attempt.operation.key,
        attempt.step,
        attempt.outcome,
        extra={
            "event": "step.end",
            **attempt.fields(),
            "ended_at": ended.isoformat(),
            "duration_ms": round((time.monotonic() - attempt._clock) * 1000, 3),
            "transaction": attempt.transaction,
            "outcome": attempt.outcome,
            "provider_reference": attempt.reference or None,
            "error": attempt.error or None,
        },
    )


def traced(step_kind: str, *, call: bool = False) -> Callable[[F], F]:
    """Wrap a step function in `step_attempt`, finding its operation, step and worker.

    The wrapped function names them by its parameters: a `Run` method (`self`
    with `.operation` and `.worker_id`) or `operation` with `step`, or a
    `claim`; the worker is `owner` or `actor`. A dict result's `reference` is
    the provider reference.
    """

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        # The parameters an argument may be passed to by position, to name each call's
        # arguments as Signature.bind would, at a fraction of its cost.
        positional = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                if len(args) > len(positional):
                    raise TypeError("too many positional arguments")
                bound = {**dict(zip(positional, args, strict=False)), **kwargs}
                operation, step, worker = _locate(bound)
            except (TypeError, KeyError):
                signature.bind(*args, **kwargs)  # a wrong call: its TypeError, nothing logged
                raise
            with step_attempt(
                operation, step, step_kind=step_kind, worker_id=worker, call=call
            ) as attempt:
                result = func(*args, **kwargs)
                if isinstance(result, dict) and isinstance(result.get("reference"), str):
                    attempt.reference = attempt.reference or result["reference"]
                return result

        return wrapper  # type: ignore[return-value]

    return decorate


def _locate(bound: dict[str, Any]) -> tuple[Operation, str, str]:
    if "claim" in bound:
        claim = bound["claim"]
        operation, step = claim.operation, claim.step
    elif "self" in bound:
        operation, step = bound["self"].operation, bound["step"]
    else:
        operation, step = bound["operation"], bound["step"]
    worker = bound.get("owner") or bound.get("actor")
    if worker is None and "self" in bound:
        worker = bound["self"].worker_id
    return operation, step, str(worker or "")
