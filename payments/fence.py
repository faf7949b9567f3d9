"""The handler API: what a business package imports to add an operation, and nothing else.

    @operation(CAPTURE, entity=Order, steps={AUTHORIZE: Authorization, CAPTURE_STEP: Capture,
               RECORD: None}, on_give_up=release_hold, desk=Desk(lock_entity=..., describe=...))
    def capture_order(run: Run) -> None:
        run.external(AUTHORIZE)                      # claimed, committed, then called
        captured = run.external(CAPTURE_STEP)        # Capture reads run.result(AUTHORIZE)
        run.local(RECORD, lambda: record(run.entity, captured))   # writes + claim, once

- `operation`: register a fenced handler. `steps` is its one declaration of
  steps, in run order: an external step maps to its ProviderEffect subclass,
  a local or side-effect step to None. A step it does not declare is refused
  when run.
- `message`: register a local-only operation delivered behind the inbox.
- `Run`: what a handler gets: `external`, `local`, `side_effect`, `result`,
  `entity`, `params`, `operation`.
- `ProviderEffect`: the base class of an external step (payments.provider.effect);
  each system's package adds its reads (the provider's `PaymentIntentEffect`, in
  payments.provider.effect, the retrieve and the created-window list of intents).
- `Desk`: what the operators' desk asks of the handler (lock, describe, new attempt).
- `start_operation`: answer an API request that starts an operation (202, replays).
- `create_operation_in_tx`: write an operation in the caller's transaction and
  deliver it once that commits (the service an API view and the desk both call).
  Its `tenant` (default "") is the namespace of its key, which the project supplies
  (its own customer's, "hotel:42"; the JSON API's client N is "client:N"): two
  tenants' equal keys are two operations with two provider idempotency keys. The
  same tenant's key with other parameters raises `OperationConflict`.
- `create_follow_ups_in_tx`: write an operation's follow-ups (derived keys) likewise.
- `Follows`, `kinds_following`, `replaced_by`: an operation declares the business event it
  follows (`@operation(..., follows=Follows(ORDER_PAID))`, `@message` too); the event's
  writer asks which kinds follow it, and whether a follow-up replaces an effect of its own.
- `money_steps`: the (kind, step) pairs whose effects take money (an order's charges).
- `DeliveryPolicy`: at most once or at least once, for a side effect without a lookup.
- `EffectResult`, `ClaimView`: a settled answer, and a claim as an effect sees it.
- `declare_system`, `ExternalSystem`, `Read`: declare the external system an effect
  calls (its key retention, reads, words, references) and name it in the effect's
  `SYSTEM`; its settings entry is PAYMENTS["SYSTEMS"][name] (payments.conf).
- `note_request`: what a system's client calls once per request it sends (method, path,
  status, key): the fence keeps it on the row it writes, for the desk's evidence.
- `system_settings(name)`: the system's PAYMENTS["SYSTEMS"][name] entry (`url`,
  `api_key`, timeouts, `option(name)`), or ImproperlyConfigured naming the missing entry.
- The errors an effect raises, each carrying the outcome the fence acts on (docs/handlers.md,
  "The errors an effect raises"), any system's: `TransientError` (nothing happened:
  retried under the same key), `UncertainError` (it may have happened: replayed or looked
  up, never failed), `PermanentError` (refused for good: the step fails),
  `NotFoundError` (a retrieve's 404: nothing there yet; from a send, refused),
  `ConflictError` (the key was used with other parameters: needs review), their base
  `EffectError`. The Stripe-compatible provider's are subclasses of those with its own
  fields: `TransientProviderError`, `UncertainProviderError`, `InvalidRequest` and
  `CardDeclined`, `ResourceMissing` (a retrieve's 404, an `InvalidRequest`),
  `IdempotencyConflict`, their base `ProviderError`. `classify_request_failure(exc,
  context=...)` turns a `requests` failure into the right neutral one (before the request
  was sent: `TransientError`; after: `UncertainError`); `classify_exception` does the same
  with the provider's classes, for a Stripe-shaped client. Any other exception from `send`
  counts as uncertain.

Handlers live in `<app>/handler.py` of an installed app (the shop's examples:
`payments/checkout/handler.py`, the app `payments.checkout`), in a module named in
PAYMENTS["HANDLER_MODULES"], or in modules those import: web and worker processes
import exactly those at start-up, and refuse a handler registered later.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db.models import Model

from payments.api.base import start_operation
from payments.conf import SystemSettings, payments_settings
from payments.engine import fence as _fence
from payments.engine.dispatch import create_and_dispatch_in_tx as create_operation_in_tx
from payments.engine.dispatch import create_follow_ups_in_tx as create_follow_ups
from payments.engine.effects import ClaimView, DeliveryPolicy, EffectResult
from payments.engine.exchanges import sent as note_request
from payments.engine.follow_ups import Follows, kinds_following, replaced_by
from payments.engine.handlers import DeskHooks as Desk
from payments.engine.handlers import EntityHook, ReversalHook, Run, handler, registered_handlers
from payments.engine.handlers import message_handler as message
from payments.engine.outcomes import (
    ConflictError,
    EffectError,
    NotFoundError,
    PermanentError,
    TransientError,
    UncertainError,
)
from payments.engine.systems import ExternalSystem, Read
from payments.engine.systems import declare as declare_system
from payments.exceptions import OperationConflict
from payments.models import KeyScope
from payments.provider.effect import ProviderEffect
from payments.provider.errors import (
    CardDeclined,
    IdempotencyConflict,
    InvalidRequest,
    ProviderError,
    ResourceMissing,
    TransientProviderError,
    UncertainProviderError,
    classify_exception,
    classify_request_failure,
)

__all__ = [
    "CardDeclined",
    "ClaimView",
    "ConflictError",
    "Desk",
    "DeliveryPolicy",
    "EffectError",
    "EffectResult",
    "ExternalSystem",
    "Follows",
    "IdempotencyConflict",
    "InvalidRequest",
    "NotFoundError",
    "OperationConflict",
    "PermanentError",
    "ProviderEffect",
    "ProviderError",
    "Read",
    "ResourceMissing",
    "Run",
    "SystemSettings",
    "TransientError",
    "TransientProviderError",
    "UncertainError",
    "UncertainProviderError",
    "classify_exception",
    "classify_request_failure",
    "create_follow_ups_in_tx",
    "create_operation_in_tx",
    "declare_system",
    "kinds_following",
    "message",
    "money_steps",
    "note_request",
    "operation",
    "replaced_by",
    "start_operation",
    "system_settings",
]


def system_settings(name: str) -> SystemSettings:
    """The settings entry of external system `name`: PAYMENTS["SYSTEMS"][name], validated
    (`url`, `api_key`, `connect_timeout`, `read_timeout`, `option(name)`; the timeouts
    default to the provider's). ImproperlyConfigured names an entry that is missing."""
    entry = payments_settings().system(name)
    if entry is None:
        raise ImproperlyConfigured(
            f"PAYMENTS['SYSTEMS'][{name!r}] is not configured: add its URL and API_KEY "
            f"(docs/handlers.md, 'The settings entry')."
        )
    return entry


def operation(
    kind: str,
    *,
    steps: Mapping[str, type[ProviderEffect] | None],
    entity: type[Model] | None = None,
    desk: Desk | None = None,
    on_failure: EntityHook | None = None,
    on_resume: EntityHook | None = None,
    on_give_up: Callable[[Run], None] | None = None,
    on_reversal: ReversalHook | None = None,
    follows: Follows | None = None,
    opens_with: str | None = None,
) -> Callable[[Callable[[Run], Any]], Callable[[Run], Any]]:
    """Register the decorated function as the fenced handler of operations of `kind`.

    - `steps`: every step in run order; an external one maps to its effect class.
    - `entity`: the model of the operations' entity (`run.entity`; an integer, UUID or
      text key of at most 64 characters).
    - `on_failure(operation)`: business writes when the operation fails (in its tx).
    - `on_resume(operation)`: undo on_failure when a failed operation runs again.
    - `on_give_up(run)`: compensate when the operation gives up after an earlier
      external step succeeded (cancel a held authorisation: a step of its own,
      declared in `steps`); the operation then fails.
    - `on_reversal(operation, found)`: undo a done step's writes the provider reversed.
    - `follows`: the business event its operations follow, `Follows(ORDER_PAID, when=...)`:
      the event's writer writes one of them with each event, while `when()` holds.
    - `opens_with`: the first of `steps`, an external one, that the handler calls first on
      every run, unconditionally: its request is built before the lease and its claim
      commits with the lease, one round trip fewer; a worker killed before the call
      leaves the claim, and the next run sends it. Refused with `on_give_up`. The job's
      meta in Redis then holds the operation's key, params and entity (docs/handlers.md).
    """
    effects = {step: effect for step, effect in steps.items() if effect is not None}
    for step, effect in effects.items():
        if not (isinstance(effect, type) and issubclass(effect, ProviderEffect)):
            raise TypeError(f"step {step!r}: {effect!r} is not a ProviderEffect subclass")
        _refuse_instance_methods(step, effect)
    return handler(
        kind,
        effects=dict(effects),
        steps=frozenset(step for step, effect in steps.items() if effect is None),
        order=tuple(steps),
        entity=entity,
        desk=desk,
        on_failure=on_failure,
        on_resume=on_resume,
        on_give_up=on_give_up,
        on_reversal=on_reversal,
        follows=follows,
        opens_with=opens_with,
    )


#: What the desk and the engine read off an effect's class, with no instance (a done
#: step's recorded result, an operation): each must be a classmethod or staticmethod.
CLASS_HOOKS = ("money", "held", "system_for")


def _refuse_instance_methods(step: str, effect: type[ProviderEffect]) -> None:
    """Refuse, when the handler is declared, a hook of CLASS_HOOKS written as an instance
    method: it would pass every test of the steps and fail the desk's pages."""
    for name in CLASS_HOOKS:
        # As the class defines it (the first in its MRO), before any binding.
        declared = inspect.getattr_static(effect, name, None)
        if declared is not None and not isinstance(declared, classmethod | staticmethod):
            raise TypeError(
                f"step {step!r}: {effect.__name__}.{name} is read off the class (the desk "
                f"has no instance): declare it `@classmethod def {name}(cls, ...)` or "
                "`@staticmethod`"
            )


def create_follow_ups_in_tx(
    parent: Any,
    kinds: tuple[str, ...],
    *,
    entity_type: str,
    entity_id: int,
    params: dict[str, Any],
    actor: str,
) -> None:
    """Write `parent`'s follow-up operations, one per kind, in the caller's transaction.

    Their keys are derived from the parent (never a client's); their inserts go
    in one round trip and their jobs in one Redis pipeline after the commit.
    Kinds declared `@message(..., inline=True)` run here instead, when the caller
    is a local step (payments.engine.dispatch.create_follow_ups_in_tx).
    """
    create_follow_ups(
        parent,
        [
            _fence.NewOperation(
                key=_fence.follow_up_key(parent, kind),
                scope=KeyScope.DERIVED,
                parent=parent,
                kind=kind,
                entity_type=entity_type,
                entity_id=entity_id,
                params=params,
                actor=actor,
            )
            for kind in kinds
        ],
    )


def money_steps() -> list[tuple[str, str]]:
    """Every (kind, step) whose effect takes the customer's money (`AUDITED` is
    "payment": a checkout's charge, a capture), whatever package declares it."""
    return sorted(
        (kind, step)
        for kind, spec in registered_handlers().items()
        for step, effect in spec.effects.items()
        if getattr(effect, "AUDITED", "") == "payment"
    )
