"""Errors of the payments app. Each carries the operation key and step it concerns."""

from __future__ import annotations

from datetime import datetime

from payments.engine.outcomes import Outcome


class PaymentsError(Exception):
    """Base class of every error raised by the payments app."""


class ConfigurationError(PaymentsError):
    """A handler or setting is missing or wrong."""


class OperationConflict(PaymentsError):
    """The key exists with other parameters: a new intent must use a new key."""

    def __init__(self, key: str, *, existing_kind: str, existing_entity: str) -> None:
        self.key = key
        self.existing_kind = existing_kind
        self.existing_entity = existing_entity
        super().__init__(
            f"operation key {key!r} is already used by {existing_kind} of {existing_entity} "
            "with other parameters; use a new key for a new intent"
        )


class MalformedJob(PaymentsError):
    """A job's arguments do not name an operation; it is failed at once, never retried."""


class StepError(PaymentsError):
    """A step did not complete; `outcome` says how the fence reacts."""

    outcome: Outcome = Outcome.UNCERTAIN

    def __init__(
        self, message: str, *, operation_key: str, step: str, provider_code: str = ""
    ) -> None:
        self.operation_key = operation_key
        self.step = step
        self.provider_code = provider_code
        super().__init__(f"{operation_key}/{step}: {message}")


class StepRefused(StepError):
    """The effect was refused for good (decline, invalid request): the operation fails."""

    outcome = Outcome.PERMANENT


class StepTransient(StepError):
    """Nothing executed; retry the same step with the same key later.

    `in_flight` says another request with the same key may still be running
    (so giving up must not settle the step as failed).
    """

    outcome = Outcome.TRANSIENT
    in_flight = False


class StepUncertain(StepError):
    """The effect may have happened; the claim waits for reconciliation."""

    outcome = Outcome.UNCERTAIN


class StepConflict(StepError):
    """The provider saw our idempotency key with other parameters: a bug, needs review."""

    outcome = Outcome.CONFLICT


class StepNeedsReview(StepError):
    """The outcome stayed unknown past the grace period: a person must decide."""

    outcome = Outcome.UNCERTAIN


class StepBusy(PaymentsError):
    """Another worker holds a live claim on the step; check again after its lease."""

    def __init__(self, *, operation_key: str, step: str, until: datetime | None) -> None:
        self.operation_key = operation_key
        self.step = step
        self.until = until
        super().__init__(f"{operation_key}/{step}: claimed by another worker until {until}")


class StepDoneMeanwhile(StepBusy):
    """Another run of the operation did this step (or took its claim over) while this one
    ran it.

    This run's writes since its last claim rolled back; the operation runs
    again at once (no attempt counted) and replays the step. Comes from a
    worker whose lease ran out and was taken over while it still ran.
    """

    def __init__(self, *, operation_key: str, step: str) -> None:
        super().__init__(operation_key=operation_key, step=step, until=None)
        self.args = (f"{operation_key}/{step}: done meanwhile by another run; running again",)


class OutcomeRefused(StepDoneMeanwhile):
    """An outcome sent ahead of its answer (queued in a run's open transaction) changed
    nothing: the claim was no longer this run's to settle (taken over from a run that
    stalled past its leases, or settled by someone else). Nothing queued behind it ran,
    the COMMIT included; the run's writes since its last claim rolled back. The
    operation is looked at again, no attempt counted: the claim's new owner settles it.
    """

    def __init__(self, *, operation_key: str, step: str, detail: str) -> None:
        super().__init__(operation_key=operation_key, step=step)
        self.args = (detail,)


class RetryLater(PaymentsError):
    """Raised to RQ so that its Retry runs the job again after the backoff."""

    def __init__(self, operation_key: str, attempt: int, cause: str) -> None:
        self.operation_key = operation_key
        self.attempt = attempt
        super().__init__(f"{operation_key}: attempt {attempt} failed transiently ({cause})")


class RetriesExhausted(PaymentsError):
    """Every attempt failed transiently; the job goes to RQ's failed registry."""

    def __init__(self, operation_key: str, attempts: int, cause: str) -> None:
        self.operation_key = operation_key
        self.attempts = attempts
        super().__init__(f"{operation_key}: gave up after {attempts} attempts ({cause})")


class InvalidTransition(PaymentsError):
    """An operator or service asked for a state change the current state forbids."""


class IllegalTransition(InvalidTransition):
    """The transition table (payments.engine.transitions) forbids this state change."""

    def __init__(self, *, what: str, name: str, from_state: str, to_state: str) -> None:
        self.what, self.name = what, name
        self.from_state, self.to_state = from_state, to_state
        super().__init__(f"{what} {name}: {from_state} -> {to_state} is not allowed")


class NotClaimOwner(InvalidTransition):
    """A claim was to be settled or released by someone who does not hold it; nothing changed."""

    def __init__(self, *, name: str, owner: str, actor: str) -> None:
        self.name, self.owner, self.actor = name, owner, actor
        super().__init__(f"claim {name} is held by {owner or 'nobody'}, not {actor}")


class UnseenOperation(InvalidTransition):
    """An operation of the entity was asked after the page the request came from was shown.

    Raised under the entity's lock, so of two pages posted at the same instant
    the second sees the first's operation; nothing was written.
    """

    def __init__(self, *, operation_key: str, operation_id: int) -> None:
        self.operation_key = operation_key
        self.operation_id = operation_id
        super().__init__(f"operation {operation_key} was asked after this page was shown")
