"""Refund an entity (an order) from the desk, through the service its handler declares.

The desk knows no business: the handler that owns refunds declares a
`refund` hook (`payments.fence.Desk`), which writes the refund as the API
does (the entity's lock, its limits, the job on commit). The desk adds the
permission check, a key derived from the confirmation page (a second press
of the same page, or a retried POST, replays the same refund instead of
asking twice), and the audit row with the operator's reason.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction

from payments.desk.display import when
from payments.desk.rules import DeskError
from payments.desk.services import actor_of, require_permission, required_reason
from payments.engine import fence
from payments.engine.handlers import DeskHooks, HandlerSpec, registered_handlers
from payments.exceptions import InvalidTransition, OperationConflict, UnseenOperation
from payments.models import Operation, OperationEvent, OperationState
from payments.money import money_of

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

logger = logging.getLogger("payments.desk.services")

#: A confirmation page's token: what makes one press of "Refund" one refund.
ACTION_ID = re.compile(r"^[0-9a-f]{32}$")


#: The states a refund asked is no longer in flight in.
SETTLED = frozenset({OperationState.SUCCEEDED, OperationState.FAILED})


@dataclass(frozen=True)
class AskedRefund:
    """A refund operation of the entity as the confirmation page lists it."""

    operation: Operation
    amount: str  # formatted in its currency
    who: str  # the actor that asked it ("operator:rosa", "api")
    at: str  # when it was asked, the desk's one format
    state: str  # the state's label

    @property
    def in_flight(self) -> bool:
        return self.operation.state not in SETTLED

    def line(self) -> str:
        """ "refund <key> of €2.00 asked <when> by <who>" """
        return f"refund {self.operation.key} of {self.amount} asked {self.at} by {self.who}"


class UnseenRefund(DeskError):
    """A refund of the entity was asked after the confirmation page was shown; nothing asked."""

    def __init__(self, asked: AskedRefund) -> None:
        self.asked = asked
        #: What was asked meanwhile, without the way to refund again (for when none is left).
        self.news = f"{asked.line()} ({asked.state}) after this page was shown. It is listed below"
        super().__init__(
            f"{self.news}; to refund again, tick “Refund again” and confirm.", action="refund"
        )


def asked_refund(operation: Operation) -> AskedRefund:
    """One refund operation as the confirmation page lists it."""
    who = (
        OperationEvent.objects.filter(operation=operation)
        .order_by("created_at", "id")
        .values_list("actor", flat=True)
        .first()
    )
    return AskedRefund(
        operation=operation,
        amount=money_of(operation.params),
        who=who or "-",
        at=when(operation.created_at),
        state=OperationState(operation.state).label,
    )


def refund_kinds() -> list[str]:
    """The kinds whose handler declares the desk's refund hook (`Desk.refund`)."""
    return sorted(
        kind
        for kind, spec in registered_handlers().items()
        if spec.desk is not None and spec.desk.refund is not None
    )


def refunded_payment(operation: Operation) -> str:
    """The payment a refund operation gives money back from: the parameter its refund
    effect names (`AUDIT_PARENT`), or "" when none does."""
    spec = registered_handlers().get(operation.kind)
    for effect in spec.effects.values() if spec is not None else ():
        item = str(getattr(effect, "AUDIT_PARENT", "") or "")
        if item:
            return str(operation.params.get(item) or "")
    return ""


def refunds_asked(entity_type: str, entity_id: int) -> list[AskedRefund]:
    """Every refund operation of the entity, in every state, newest first."""
    ops = Operation.objects.filter(
        kind__in=refund_kinds(), entity_type=entity_type, entity_id=str(entity_id)
    ).order_by("-pk")
    return [asked_refund(op) for op in ops]


def refund_left(entity_type: str, entity_id: int) -> int | None:
    """What is left to refund of the entity's own charge (refunds in flight counted), if known."""
    hooks = refund_hook(entity_type)
    if hooks is None or hooks.refund_left is None:
        return None
    return hooks.refund_left(int(entity_id))


def refund_refused(entity_type: str, entity_id: int) -> str:
    """Why the entity's own charge cannot be refunded now; "" when it can."""
    hooks = refund_hook(entity_type)
    return "" if hooks is None else hooks.refuse_refund(int(entity_id)) or ""


def refund_permission(entity_type: str) -> str:
    """The permission a desk refund of this entity needs: `refund_<model>` of the entity's
    own app ("shop.refund_order"), the app of the entity the refunding handler declares."""
    spec = _refunding(entity_type)
    app_label = spec.entity._meta.app_label if spec is not None and spec.entity else "payments"
    return f"{app_label}.refund_{entity_type}"  # no handler refunds it: a permission nobody has


def refund_hook(entity_type: str) -> DeskHooks | None:
    """The desk hooks of the handler that refunds entities of this type, if one declares it."""
    spec = _refunding(entity_type)
    return spec.desk if spec is not None else None


def _refunding(entity_type: str) -> HandlerSpec | None:
    """The handler whose desk hooks refund entities of this type (its model's name), if any."""
    for spec in registered_handlers().values():
        entity = spec.entity
        if spec.desk is not None and spec.desk.refund is not None and entity is not None:
            if entity._meta.model_name == entity_type:
                return spec
    return None


def desk_refund_key(entity_type: str, entity_id: int, action_id: str) -> str:
    """The refund's key, derived from the confirmation page it was asked on."""
    return f"desk-refund:{entity_type}:{entity_id}:{action_id}"


def refund_entity(
    entity_type: str,
    entity_id: int,
    *,
    user: AbstractBaseUser,
    amount: int,
    reason: str,
    action_id: str,
    seen: int,
    charge: str = "",
) -> tuple[Operation, bool]:
    """Ask for a refund of `amount` (minor units) of an entity; (operation, created).

    `charge` names a duplicate charge to give back (its provider reference),
    "" the entity's own. `seen` is the newest refund operation of the entity
    the operator was shown (0: none): a newer one refuses with UnseenRefund,
    decided by the hook under the entity's lock. The handler's hook opens its
    transaction (it may ask the provider before it); the audit row with the
    reason follows in another.
    """
    require_permission(user, refund_permission(entity_type))
    reason = required_reason(reason)
    if not ACTION_ID.match(action_id):
        raise DeskError("this confirmation page has no valid token: open it again")
    hooks = refund_hook(entity_type)
    if hooks is None or hooks.refund is None:
        raise DeskError(f"no handler refunds {entity_type}s")
    actor = actor_of(user)
    key = desk_refund_key(entity_type, entity_id, action_id)
    options: dict[str, Any] = {"seen": int(seen)}
    if charge:
        options["charge"] = charge
    try:
        op, created = hooks.refund(int(entity_id), key, int(amount), actor, options)
    except UnseenOperation as exc:
        raise UnseenRefund(asked_refund(Operation.objects.get(pk=exc.operation_id))) from exc
    except OperationConflict as exc:
        raise DeskError(f"this page already asked for another refund ({key})") from exc
    except InvalidTransition as exc:  # the business refused: not paid, over the limit
        raise DeskError(str(exc), action="refund") from exc
    if created:
        with transaction.atomic():
            what = f"duplicate charge {charge}" if charge else f"{entity_type} {entity_id}"
            fence.record_event_in_tx(
                op,
                to_state=op.state,
                actor=actor,
                reason=f"refund of {what} from the desk: {reason}",
            )
        logger.info("%s %s: refund %s asked from the desk", entity_type, entity_id, op.key)
    return op, created
