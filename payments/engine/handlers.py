"""The one registry of handlers, and `Run`, what a fenced handler is given.

Two kinds of handler, one registry (`get_handler` answers for both):

* a **fenced handler** runs an operation's named steps under step claims:

      @handler(CHECKOUT, on_failure=mark_order_failed, effects={CHARGE: PaymentIntentCharge})
      def checkout(run: Run) -> None:
          charge = run.external(CHARGE)
          run.local(INVOICE, lambda: ...)

* a **message handler** (`@message_handler(kind, consumer=...)`) is a
  local-only operation delivered behind the inbox: its writes, its inbox row
  and the operation's `succeeded` commit together, so a redelivery skips it.

Modules that declare handlers must be imported at start-up (in an
AppConfig.ready()); a worker that has not imported one parks its operations
in needs_review.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django.apps import apps
from django.db.models import Exists, Model, OuterRef
from django.utils.module_loading import module_has_submodule

from inbox.handlers import current_message, inbox_guard, inbox_handler
from payments.conf import payments_settings
from payments.engine import fence, telemetry
from payments.engine.effects import DeliveryPolicy, EffectResult, ExternalEffect, reversal_step
from payments.engine.failpoints import AFTER_CLAIM_COMMIT, AFTER_PROVIDER_ACCEPT, failpoint
from payments.engine.follow_ups import Follows, declare_follow_up
from payments.engine.steps import run_external_step
from payments.engine.systems import system_of
from payments.engine.unit import WorkUnit
from payments.exceptions import ConfigurationError, StepBusy, StepTransient
from payments.models import (
    UNFINISHED_OPERATION_STATES,
    ClaimState,
    Operation,
    OperationState,
    StepClaim,
)

logger = logging.getLogger("payments.engine.runtime")

#: Builds a step's effect from the run (its operation, earlier results) and the step's name.
EffectFactory = Callable[[Any, str], ExternalEffect]
EntityHook = Callable[[Operation], None]
#: Undo an effect's business writes after the provider reversed it (a refund failed after it
#: succeeded); gets the operation and what the provider shows now. Runs inside the transaction
#: that records the reversal once.
ReversalHook = Callable[[Operation, EffectResult], None]


@dataclass(frozen=True)
class DeskHooks:
    """What the operators' desk needs from a handler; the desk itself knows no business.

    Each runs inside the desk's transaction, the operation locked.
    - `lock_entity(op)`: lock the business row (serialises with the API's requests).
    - `refuse_rerun(op)`: why a failed operation may not run again now, or None.
    - `new_attempt(op, key, actor, options)`: write the next attempt (a new key, derived,
      `retry_of=op`) through the same service the API uses; (operation, created). None:
      this kind has no new attempt, and the desk says so.
    - `refuse_new_attempt(op)`: why the entity is not open for a new attempt, or None.
    - `describe(op)`: one line naming the money at stake ("€49.99 charge of order 42").
    - `refund(entity_id, key, amount, actor, options)`: write a refund of the handler's
      entity (an order) through the same service the API uses; (operation, created).
      Declared by the handler that owns refunds; it opens its own transaction (it may
      ask the provider first) and takes the entity's lock there. `options["charge"]`
      names a charge other than the one recorded (a duplicate) to give back;
      `options["seen"]` the newest refund of the entity the operator was shown (a newer
      one, read under the entity's lock, refuses with UnseenOperation).
    - `refund_left(entity_id)`: what is left to refund of the entity's own charge,
      refunds in flight counted (minor units).
    - `refuse_refund(entity_id)`: why the entity's own charge cannot be refunded now, or None.
    """

    lock_entity: EntityHook
    describe: Callable[[Operation], str]
    refuse_rerun: Callable[[Operation], str | None] = lambda op: None
    new_attempt: Callable[[Operation, str, str, dict[str, Any]], tuple[Operation, bool]] | None = (
        None
    )
    refuse_new_attempt: Callable[[Operation], str | None] = lambda op: None
    refund: Callable[[int, str, int, str, dict[str, Any]], tuple[Operation, bool]] | None = None
    refund_left: Callable[[int], int] | None = None
    refuse_refund: Callable[[int], str | None] = lambda entity_id: None


@dataclass(frozen=True)
class HandlerSpec:
    """A registered handler: how its operations run and what the engine may call on its behalf.

    `on_failure` runs inside the transaction that marks the operation failed;
    `on_resume` inside the one that runs a failed operation again (the provider
    showed its step succeeded, or an operator resumed it) and undoes what
    on_failure did. `effects` maps each external step to a factory building its
    effect from the operation, so recovery can settle a step without the
    handler. `consumer` is set for message handlers (the inbox consumer name).
    `on_reversal` undoes a done step's business writes when the provider later
    reverses it (payments.engine.recovery records the reversal once).
    """

    kind: str
    func: Callable[..., object]
    on_failure: EntityHook | None = None
    on_resume: EntityHook | None = None
    effects: dict[str, EffectFactory] = field(default_factory=dict)
    steps: frozenset[str] = frozenset()
    consumer: str | None = None
    desk: DeskHooks | None = None
    #: What to undo when the provider reverses a step recorded done (None: a person decides).
    on_reversal: ReversalHook | None = None
    #: The model of the operations' entity (entity_type its model name, entity_id its
    #: integer key), read in the lease's round trip: `Run.entity`.
    entity: type[Model] | None = None
    #: Compensation when the operation gives up after an earlier external step succeeded
    #: (payments.engine.runtime): gets the run; its own steps run under their own claims.
    on_give_up: Callable[[Run], None] | None = None
    #: The steps in the order the handler runs them (the desk lists them so).
    order: tuple[str, ...] = ()
    #: A message handler declared `inline=True`: its writes, to run inside the transaction
    #: that writes the event it follows (payments.engine.follow_ups.deliver_inline_in_tx).
    inline: EntityHook | None = None
    #: The external step the handler calls first on every run (`opens_with`): its claim
    #: is written with the lease (payments.engine.runtime._first_claim), None: after it.
    opens_with: str | None = None

    def effect(self, step: str, on: Operation | Run) -> ExternalEffect:
        """Build the effect of `step` for an operation (recovery, desk) or a handler's run."""
        try:
            factory = self.effects[step]
        except KeyError:
            raise ConfigurationError(
                f"handler {self.kind!r} declares no external effect for step {step!r}"
            ) from None
        run = on if isinstance(on, Run) else Run(on, worker_id="", spec=self)
        return factory(run, step)

    @property
    def step_order(self) -> tuple[str, ...]:
        """Every known step, in run order where the handler declared one."""
        rest = sorted(self.known_steps - set(self.order))
        return tuple(s for s in self.order if s in self.known_steps) + tuple(rest)

    def check_entity(self, operation: Operation) -> None:
        """Raise ConfigurationError if `operation`'s entity is not of this handler's model."""
        if self.entity is not None and operation.entity_type != self.entity._meta.model_name:
            raise ConfigurationError(
                f"operation {operation.key}'s entity is a {operation.entity_type!r}, not a "
                f"{self.entity._meta.model_name!r} (handler {self.kind!r})"
            )

    @property
    def known_steps(self) -> frozenset[str]:
        """Every step name this handler may record (external effects included, and the
        reversal of each when the handler can undo one: `on_reversal`)."""
        reversals = {reversal_step(s) for s in self.effects} if self.on_reversal else set()
        gave_up = {GIVE_UP_STEP} if self.on_give_up else set()
        return self.steps | frozenset(self.effects) | reversals | gave_up


_HANDLERS: dict[str, HandlerSpec] = {}

#: The local step that records, before its first call, that an operation is compensating
#: (`on_give_up`): a redelivered run resumes the compensation, never the forward steps.
GIVE_UP_STEP = ":give_up"


#: The installed apps, once discover_app_handlers has imported their handler modules.
_DISCOVERED: set[str] = set()


def check_discoverable(module: str) -> None:
    """Refuse a handler that worker processes would not know.

    Web and worker processes know the same handlers: those that start-up
    discovery imports (each installed app's `handler` module, each module of
    PAYMENTS["HANDLER_MODULES"], and what those modules import). A handler under
    an installed app that registers after discovery came from a module only this
    process imported (the web, through its URLs), or from a package that is not
    an installed app of its own: workers would park its operations in
    needs_review, so this process refuses it too. Modules outside every
    installed app (tests) may register at any time.
    """
    for root in sorted(_DISCOVERED, key=len, reverse=True):
        if module.startswith(f"{root}."):
            # Under payments, a business package is an app of its own; anywhere else, the
            # installed app the module belongs to has the handler module.
            app = root if root != "payments" else ".".join(module.split(".")[:2])
            where = (
                f"declare it in (or import it from) {app}.handler"
                if app in _DISCOVERED
                else f"add {app!r} to INSTALLED_APPS, its handlers in {app}.handler"
            )
            raise ConfigurationError(
                f"a handler is declared in {module}, which start-up discovery did not import: "
                f"{where}, or name its module in PAYMENTS['HANDLER_MODULES'], so that every "
                "worker registers it too"
            )


def _register(spec: HandlerSpec, module: str, follows: Follows | None = None) -> None:
    check_discoverable(module)
    existing = _HANDLERS.get(spec.kind)
    if existing is not None and existing.func is not spec.func:
        raise ConfigurationError(f"a handler for {spec.kind!r} is already registered")
    if follows is not None:
        declare_follow_up(spec.kind, follows)
    _HANDLERS[spec.kind] = spec


def handler(
    kind: str,
    *,
    on_failure: EntityHook | None = None,
    on_resume: EntityHook | None = None,
    effects: dict[str, EffectFactory] | None = None,
    steps: frozenset[str] | set[str] = frozenset(),
    desk: DeskHooks | None = None,
    entity: type[Model] | None = None,
    on_reversal: ReversalHook | None = None,
    on_give_up: Callable[[Run], None] | None = None,
    order: tuple[str, ...] = (),
    follows: Follows | None = None,
    opens_with: str | None = None,
) -> Callable[[Callable[[Run], object]], Callable[[Run], object]]:
    """Register the decorated function as the fenced handler of operations of `kind`.

    `steps` names its local and side-effect steps (external ones are the keys of
    `effects`): a step name recorded on an unfinished operation that no handler
    declares is reported by the `payments.E010` check, so a rename cannot
    silently derive a new idempotency key for a step that already ran.
    `entity` is the model of the operations' entity (their entity_type is its
    model name, their entity_id its primary key as text: an integer, UUID or text
    key, fence.entity_key_kind): the worker reads the
    row in the lease's round trip, and the handler gets it as `run.entity`
    (read as it was right after the lease; lock it again where a step needs it
    locked). `follows`: the business event its operations follow (payments.engine.follow_ups).
    `opens_with`: an external step the handler calls first on every run, whose effect
    builds its request from the operation alone: its claim is written with the lease
    (docs/design.md, "The first claim rides the lease"). Not with `on_give_up`.
    """
    if opens_with is not None and (
        opens_with not in (effects or {})
        or on_give_up is not None
        or (order and order[0] != opens_with)
    ):
        raise ConfigurationError(
            f"handler {kind!r}: opens_with={opens_with!r} must name its first step, an "
            "external one, and the handler may not declare on_give_up"
        )
    if entity is not None:
        try:
            fence.entity_key_kind(entity)
        except ConfigurationError as exc:
            raise ConfigurationError(f"handler {kind!r}: {exc}") from None

    def register(func: Callable[[Run], object]) -> Callable[[Run], object]:
        _register(
            HandlerSpec(
                kind=kind,
                func=func,
                on_failure=on_failure,
                on_resume=on_resume,
                effects=dict(effects or {}),
                steps=frozenset(steps),
                desk=desk,
                entity=entity,
                on_reversal=on_reversal,
                on_give_up=on_give_up,
                order=order,
                opens_with=opens_with,
            ),
            func.__module__,
            follows,
        )
        return func

    return register


def message_handler(
    kind: str, *, consumer: str, follows: Follows | None = None, inline: bool = False
) -> Callable[[EntityHook], EntityHook]:
    """Register the decorated function as the handler of `kind` messages behind the inbox.

    The function gets the operation, locked, inside the transaction that also
    records the inbox row and marks the operation succeeded; it writes and
    returns. A redelivered message never calls it again.

    `inline=True` (a follow-up only): the function runs inside the transaction
    that writes the event it follows, in a savepoint, and gets the operation
    unsaved (no id; `created_at` the writer's clock). Its writes commit with the
    event, once, and no operation, audit or inbox row is written for it. If it
    raises, the savepoint rolls back and the follow-up is written and delivered
    as if not inline (PAYMENTS["INLINE_FOLLOW_UPS"] = False does that always).
    """
    if inline and follows is None:
        raise ConfigurationError(
            f"{kind!r}: inline=True runs a follow-up in its event's transaction; "
            "declare the event it follows (follows=Follows(...))"
        )

    def register(func: EntityHook) -> EntityHook:
        def handle(op: Operation) -> str:
            if op.kind != kind:  # the job named another kind: roll back, count it, alert
                raise ConfigurationError(f"operation {op.key} is a {op.kind}, not a {kind}")
            func(op)
            return "delivered"

        @inbox_handler(consumer=consumer)
        def deliver_without_message_id(operation_id: int, worker_id: str) -> str:
            # Not sent by the dispatcher (no message id): inbox_handler decides.
            return handle(succeed_message_in_tx(operation_id, worker_id))

        def deliver(operation_id: int, worker_id: str) -> str | None:
            name, message_id = current_message(consumer)
            if name is None or message_id is None:
                return deliver_without_message_id(operation_id, worker_id)
            delivered: list[Operation] = []

            def record() -> bool:
                # The inbox row and the operation's `succeeded` (which locks its row)
                # in one statement, then the writes: all of it commits, or none of it.
                op = fence.deliver_message_in_tx(
                    operation_id,
                    consumer=name,
                    message_id=message_id,
                    actor=worker_id,
                    reason="delivered",
                )
                if op is None:
                    return False
                delivered.append(op)
                return True

            with inbox_guard(name, message_id, record=record) as first:
                return handle(delivered[0]) if first else None

        deliver.__name__ = deliver.__qualname__ = f"deliver_{kind}"
        _register(
            HandlerSpec(
                kind=kind, func=deliver, consumer=consumer, inline=func if inline else None
            ),
            func.__module__,
            follows,
        )
        return func

    return register


def succeed_message_in_tx(operation_id: int, worker_id: str) -> Operation:
    """Mark a delivered message's operation succeeded; return it, locked. In the caller's tx."""
    return fence.succeed_message_in_tx(operation_id, actor=worker_id, reason="delivered")


#: The module an installed app declares its handlers in (`<app>/handler.py`), imported at
#: start-up by discover_app_handlers, as django.contrib.admin imports each app's `admin`.
HANDLER_MODULE = "handler"


def discover_app_handlers(extra: Iterable[str] = ()) -> list[str]:
    """Import every installed app's `handler` module, then each module named in `extra`
    (PAYMENTS["HANDLER_MODULES"]); return the modules imported, in that order.

    Called from the payments app's ready(): an app (`bookings`, or one of the
    shop's examples, `payments.checkout`, listed in INSTALLED_APPS) has its
    handlers in `<app>/handler.py` and every process registers them, nothing to
    remember. From then on each installed app is a discovery root: a handler
    declared later under it (a module only the web's URLs import) is refused,
    since workers would not know it. A module of `extra` that cannot be imported raises ImportError, at
    start-up, with its name.
    """
    found = []
    configs = list(apps.get_app_configs())
    for config in configs:
        if module_has_submodule(config.module, HANDLER_MODULE):
            name = f"{config.name}.{HANDLER_MODULE}"
            importlib.import_module(name)
            found.append(name)
    for name in extra:
        importlib.import_module(name)
        found.append(name)
    _DISCOVERED.update(config.name for config in configs)
    return found


def get_handler(kind: str) -> HandlerSpec:
    """Return the handler of `kind`, or raise ConfigurationError."""
    try:
        return _HANDLERS[kind]
    except KeyError:
        raise ConfigurationError(f"no handler registered for operation kind {kind!r}") from None


def entity_models() -> tuple[type[Model], ...]:
    """The models handlers declare as their entity (`@handler(entity=...)`), each once."""
    found = {spec.entity for spec in _HANDLERS.values() if spec.entity is not None}
    return tuple(sorted(found, key=lambda model: model._meta.label))


def money_moved(
    operation: Operation, done_claims: Iterable[StepClaim] | None = None
) -> tuple[int, str] | None:
    """The money an operation's done external steps moved, by their effects' own reading
    (`money(result)`: a capture's captured amount, not the amount asked for); None when
    none moved any (nothing done yet, or a kind whose effects move no money).

    `done_claims`: the operation's claims when the caller read them already (a list's
    prefetch, one query for its page), else they are read here.
    """
    spec = _HANDLERS.get(operation.kind)
    if spec is None or not spec.effects:
        return None
    if done_claims is None:
        done_claims = operation.claims.filter(
            state=ClaimState.DONE, step__in=list(spec.effects)
        ).only("operation_id", "step", "state", "result")
    total, currency = 0, ""
    for claim in done_claims:
        if claim.state != ClaimState.DONE or claim.step not in spec.effects:
            continue
        money = getattr(spec.effects[claim.step], "money", None)
        moved = money(claim.result or {}) if money is not None else None
        if moved is not None:
            total, currency = total + moved[0], moved[1]
    return (total, currency) if currency else None


def registered_handlers() -> dict[str, HandlerSpec]:
    """Return a copy of the registry: kind -> spec."""
    return dict(_HANDLERS)


def systems_called() -> set[str]:
    """The names of the systems the registered handlers' effects call: each effect's own
    SYSTEM, or every one it may pick per operation (an effect with `system_for` lists
    them in its `may_call()`). A project whose handlers call no payment provider reads
    none in its periodic commands."""
    called: set[str] = set()
    for spec in _HANDLERS.values():
        for effect in spec.effects.values():
            may_call = getattr(effect, "may_call", None)
            called |= set(may_call()) if may_call is not None else {system_of(effect).name}
    return called


def unknown_recorded_names() -> list[str]:
    """Name every kind and step recorded on unfinished operations that no handler declares.

    A step name feeds its provider idempotency key: a rename deployed while
    operations are in flight would derive a new key for a step that already
    ran. Run by the `payments.E010` check and by the worker before it starts.
    """
    # A failed operation with a claim that is not failed may still run again (the
    # reconciler's stranded pass, a desk resume): it counts as unfinished. Each part
    # reads through a partial index (unfinished, failed operations: migration 0014),
    # and their claims through the unique (operation, step) index.
    may_resume = StepClaim.objects.filter(operation=OuterRef("pk")).exclude(state=ClaimState.FAILED)
    kinds: set[str] = set()
    recorded: set[tuple[str, str]] = set()
    for unfinished in (
        Operation.objects.filter(state__in=UNFINISHED_OPERATION_STATES),
        Operation.objects.filter(state=OperationState.FAILED).filter(Exists(may_resume)),
    ):
        kinds.update(unfinished.values_list("kind", flat=True).distinct())
        recorded.update(
            StepClaim.objects.filter(operation__in=unfinished.values("pk"))
            .values_list("operation__kind", "step")
            .distinct()
        )
    problems = []
    for kind in sorted(kinds):
        if kind not in _HANDLERS:
            problems.append(f"operation kind {kind!r} is recorded on unfinished operations")
    for kind, step in sorted(recorded):
        spec = _HANDLERS.get(kind)
        if spec is not None and spec.consumer is None and step not in spec.known_steps:
            problems.append(f"step {step!r} of {kind!r} is recorded on unfinished operations")
    return problems


# --- what a fenced handler gets -------------------------------------------------------

#: `Run.prefetched_entity` when the lease did not read the entity.
NOT_READ: Any = object()


@dataclass
class Run:
    """What a fenced handler gets: its operation and the three kinds of step."""

    operation: Operation
    worker_id: str
    spec: HandlerSpec
    #: The open transaction of this run's writes (payments.engine.unit); the runtime ends it.
    unit: WorkUnit = field(default_factory=WorkUnit)
    #: The steps claimed when this run's lease was taken (the runtime passes them; None:
    #: unknown, every local step inserts its claim first).
    claimed_at_lease: frozenset[str] | None = None
    #: The handler's entity as read with the lease (None: its row was not there);
    #: NOT_READ: `entity` reads it.
    prefetched_entity: Any = NOT_READ
    #: The claim of the step the handler opens with, inserted and committed with the
    #: lease (payments.engine.runtime): `external` takes it off the run and calls under
    #: it; the runtime withdraws it if the run never gets to the step.
    first_claim: StepClaim | None = None
    #: The local steps this run has gone through (a second call with a name replays).
    _local_steps: set[str] = field(default_factory=set, init=False, repr=False)
    #: The results of the steps this run has run or replayed (`result`).
    _results: dict[str, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)

    def result(self, step: str) -> dict[str, Any]:
        """The recorded result of an earlier step of this operation (`reference`, ...).

        The result this run got, else the step's `done` claim as committed.
        Raises ConfigurationError when the step is not done: an effect that
        needs it runs after it.
        """
        if step in self._results:
            return self._results[step]
        claim = StepClaim.objects.filter(
            operation=self.operation, step=step, state=ClaimState.DONE
        ).first()
        if claim is None:
            raise ConfigurationError(f"step {step!r} of {self.operation.key} is not done")
        self._results[step] = claim.result or {}
        return self._results[step]

    def _declared(self, step: str) -> None:
        """Refuse a step the handler does not declare (its metrics and checks would miss it)."""
        if step not in self.spec.known_steps:
            raise ConfigurationError(
                f"handler {self.spec.kind!r} runs step {step!r}, which its steps= does not declare"
            )

    @property
    def params(self) -> dict[str, Any]:
        return self.operation.params

    @property
    def entity(self) -> Any:
        """The operation's entity, a row of the handler's `entity` model.

        Read in the lease's round trip (as it was then, not locked); read here
        if it was not. Raises ConfigurationError if the handler declares no
        entity or the operation's entity_type is not the model's name, and the
        model's DoesNotExist if the row is missing.
        """
        model: Any = self.spec.entity
        if model is None:
            raise ConfigurationError(f"handler {self.spec.kind!r} declares no entity")
        self.spec.check_entity(self.operation)
        if self.prefetched_entity is NOT_READ:
            try:  # the table's rows, as the lease's read sees them (no manager's filter)
                self.prefetched_entity = model._base_manager.get(pk=self.operation.entity_id)
            except (ValueError, TypeError, model.DoesNotExist):  # not a key: no such row
                self.prefetched_entity = None
        if self.prefetched_entity is None:
            raise model.DoesNotExist(
                f"{model._meta.model_name} {self.operation.entity_id} "
                f"(the entity of operation {self.operation.key}) does not exist"
            )
        return self.prefetched_entity

    def external(self, step: str) -> dict[str, Any]:
        """Run an external step (claim committed before the call); return its result.

        A success's outcome goes in the run's open transaction (queued in front of
        its next fence statement, payments.engine.unit): it commits with the
        handler's next writes, before the next call.
        """
        self.unit.commit()  # what the handler wrote before the call is durable before it
        effect = self.spec.effect(step, self)
        # A step claimed before this run's lease replays its stored request: not built again.
        build = self.claimed_at_lease is None or step not in self.claimed_at_lease
        claimed_with_lease = None
        if self.first_claim is not None and self.first_claim.step == step:
            claimed_with_lease, self.first_claim = self.first_claim, None
        result = run_external_step(
            self.operation,
            step,
            effect,
            owner=self.worker_id,
            outcomes=self.unit,
            build=build,
            claimed_with_lease=claimed_with_lease,
        )
        self._results[step] = result
        return result

    def withdraw_first_claim(self, *, in_unit: bool = False) -> None:
        """Withdraw the claim made with the lease when the run did not get to its step
        (fence.withdraw_claim: gone, audited, as if never claimed; nothing was sent).

        On its own (`in_unit` False, after the handler's error): never raises, and a
        claim not withdrawn is left to its lease and taken over as any claim is. In the
        run's open transaction (`in_unit`, the handler returned without running it): it
        goes with the release, its errors are the release's, and the claim stays on the
        run until the unit commits (the runtime calls again, on its own, if it does not).
        """
        claim = self.first_claim
        if claim is None:
            return
        reason = "claimed with the lease; the run did not get to it: nothing was sent"
        if in_unit:
            logger.error(
                "operation %s: handler %r declares opens_with=%r but returned without it",
                self.operation.key,
                self.spec.kind,
                claim.step,
            )
            fence.withdraw_claim(claim, owner=self.worker_id, reason=reason)
            return
        self.first_claim = None
        try:
            withdrawn = fence.withdraw_claim(claim, owner=self.worker_id, reason=reason)
        except Exception:
            logger.exception("operation %s: claim %s not withdrawn", self.operation.key, claim.step)
            return
        logger.warning(
            "operation %s: claim %s, made with the lease, %s",
            self.operation.key,
            claim.step,
            "withdrawn: the run failed before it"
            if withdrawn
            else "not withdrawn (its lease ran out, or it moved on): left to its lease",
        )

    def local(self, step: str, func: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        """Run a local step: its `done` claim and its writes commit together, once."""
        self._results[step] = self._local(step, func)
        return self._results[step]

    @telemetry.traced("local")
    def _local(self, step: str, func: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        """Run a local step in the run's open transaction (payments.engine.unit, which owns
        it: WorkUnit.local_step says how). A step the lease found unclaimed, on its first
        go in this run, runs `func` before its claim; any other inserts its claim first,
        so a step done before is replayed without running `func` again."""
        self._declared(step)
        self.unit.join()  # refused (nested, rolled back) before the step counts as seen
        first_go = step not in self._local_steps
        self._local_steps.add(step)
        unclaimed = self.claimed_at_lease is not None and step not in self.claimed_at_lease
        return self.unit.local_step(
            self.operation,
            step,
            func,
            owner=self.worker_id,
            claim_first=not (first_go and unclaimed),
        )

    @telemetry.traced("side_effect")
    def side_effect(
        self, step: str, func: Callable[[], dict[str, Any] | None], *, policy: DeliveryPolicy
    ) -> dict[str, Any]:
        """Run an effect that cannot be looked up (plain e-mail) under its declared policy.

        Its claim commits with the run's open transaction before `func` runs;
        its outcome is written in the next one (payments.engine.unit).
        """
        self._declared(step)
        lease = payments_settings().claim_lease
        self.unit.join()
        # The claim commits with the unit, in one round trip: durable before anything is sent.
        claimed = self.unit.commit_with(
            lambda: fence.claim_step_in_tx(
                self.operation, step, owner=self.worker_id, lease_seconds=lease, provider_call=False
            )
        )
        claim = claimed.claim
        resend = False
        if not claimed.created:
            if claim.state in (ClaimState.DONE, ClaimState.FAILED):
                telemetry.note(outcome=telemetry.SKIPPED, transaction=telemetry.NONE)
                return claim.result or {}
            taken = fence.take_over_claim(claim, owner=self.worker_id, lease_seconds=lease)
            if taken is not None and taken.state in (ClaimState.DONE, ClaimState.FAILED):
                return taken.result or {}  # settled meanwhile by another worker
            if taken is None:
                raise StepBusy(
                    operation_key=self.operation.key, step=step, until=claim.lease_expires_at
                )
            claim = taken
            if policy == DeliveryPolicy.AT_MOST_ONCE:
                result = {"sent": "unknown", "skipped": True, "policy": str(policy)}
                telemetry.note(outcome=telemetry.SKIPPED)
                logger.warning(
                    "step %s/%s may have run before; skipped (at most once)",
                    self.operation.key,
                    step,
                )
                self._settle_done(
                    claim, result, reason="outcome unknown; skipped under at-most-once"
                )
                return result
            resend = True
        failpoint(AFTER_CLAIM_COMMIT, step)  # claimed and committed, nothing sent yet
        try:
            result = dict(func() or {})
        except Exception as exc:  # the effect's own failure; the policy decides
            reason = f"{type(exc).__name__}: {exc}"[:500]
            if policy == DeliveryPolicy.AT_LEAST_ONCE:
                fence.release_claim(claim, actor=self.worker_id, reason=reason)
                raise StepTransient(reason, operation_key=self.operation.key, step=step) from exc
            result = {"sent": False, "error": type(exc).__name__, "policy": str(policy)}
            telemetry.note(outcome=telemetry.PERMANENT)
            logger.warning(
                "step %s/%s failed; not retried (at most once)", self.operation.key, step
            )
            self._settle_done(claim, result, reason=reason)
            return result
        failpoint(AFTER_PROVIDER_ACCEPT, step)  # sent, its outcome not recorded yet
        result.update({"policy": str(policy), "resent": resend})
        self._settle_done(claim, result)
        return result

    def _settle_done(self, claim: StepClaim, result: dict[str, Any], *, reason: str = "") -> None:
        """Write a side effect's outcome in the open transaction (again alone if it rolls back)."""
        self.unit.record_outcome(
            claim, ClaimState.DONE, actor=self.worker_id, result=result, reason=reason
        )
