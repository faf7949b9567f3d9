"""Which function runs which kind of operation.

A handler is one function of named steps (see README, "Adding a handler"):

    @handler("checkout", on_failure=mark_order_failed, effects={"charge": ChargeEffect})
    def checkout(run: Run) -> None:
        charge = run.external("charge")
        run.local("invoice", lambda: ...)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from payments.exceptions import ConfigurationError

if TYPE_CHECKING:
    from payments.effects import ExternalEffect
    from payments.models import Operation
    from payments.runtime import Run


@dataclass(frozen=True)
class HandlerSpec:
    """A registered handler, its external effects by step, and its failure hook.

    `on_failure` runs inside the transaction that marks the operation failed.
    `effects` maps each external step to a factory building its effect from the
    operation, so that recovery can settle a step without running the handler.
    """

    kind: str
    func: Callable[[Run], object]
    on_failure: Callable[[Operation], None] | None = None
    effects: dict[str, Callable[[Operation], ExternalEffect]] = field(default_factory=dict)
    #: Runs inside the transaction that resumes a failed operation (the provider
    #: showed its step succeeded): undo what on_failure did to the business rows.
    on_resume: Callable[[Operation], None] | None = None

    def effect(self, step: str, operation: Operation) -> ExternalEffect:
        """Build the effect of `step` for `operation`."""
        try:
            factory = self.effects[step]
        except KeyError:
            raise ConfigurationError(
                f"handler {self.kind!r} declares no external effect for step {step!r}"
            ) from None
        return factory(operation)


_HANDLERS: dict[str, HandlerSpec] = {}


def handler(
    kind: str,
    *,
    on_failure: Callable[[Operation], None] | None = None,
    effects: dict[str, Callable[[Operation], ExternalEffect]] | None = None,
    on_resume: Callable[[Operation], None] | None = None,
) -> Callable[[Callable[[Run], object]], Callable[[Run], object]]:
    """Register the decorated function as the handler of operations of `kind`."""

    def register(func: Callable[[Run], object]) -> Callable[[Run], object]:
        existing = _HANDLERS.get(kind)
        if existing is not None and existing.func is not func:
            raise ConfigurationError(f"a handler for {kind!r} is already registered")
        _HANDLERS[kind] = HandlerSpec(
            kind=kind,
            func=func,
            on_failure=on_failure,
            effects=dict(effects or {}),
            on_resume=on_resume,
        )
        return func

    return register


def get_handler(kind: str) -> HandlerSpec:
    """Return the handler of `kind`, or raise ConfigurationError."""
    try:
        return _HANDLERS[kind]
    except KeyError:
        raise ConfigurationError(f"no handler registered for operation kind {kind!r}") from None
