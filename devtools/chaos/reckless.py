"""The reckless operator of the chaos run: every desk action it is offered, in the worst order.

While the chaos runs, a staff user with every desk permission looks at the
run's checkouts that are uncertain, need review or failed, and presses what
the desk offers there: "mark charge failed" on every step waiting to be
settled, then "start a new attempt" (another card), without reading the
provider first. It goes through the very service functions the admin's views
call (payments.desk.services), with their checks, so whatever it manages to
do an operator could do. The run's report counts its presses; the fence must
still show no double charge and no order shown failed while charged.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from functools import partial

from django.contrib.auth.models import Permission, User
from django.core.exceptions import PermissionDenied
from django.db import close_old_connections, connection
from django.db.models import Q

from payments.checkout.names import CHECKOUT
from payments.desk import services as desk
from payments.desk.rules import DeskError, available_actions
from payments.models import Operation, OperationState

#: Where the reckless operator looks: what the desk's "Needs attention" lists.
OFFERED_STATES = (OperationState.UNCERTAIN, OperationState.NEEDS_REVIEW, OperationState.FAILED)
PERMISSIONS = ("view_operation", "reconcile_operation", "start_new_attempt")
REASON = "reckless operator (chaos run): pressed without reading the provider"


def reckless_user() -> User:
    """The staff user it acts as, with every permission the desk's actions need."""
    user, _ = User.objects.get_or_create(
        username="reckless-operator", defaults={"is_staff": True, "is_active": True}
    )
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label__in=("payments", "shop"), codename__in=PERMISSIONS
        )
    )
    return User.objects.get(pk=user.pk)  # a fresh row: no cached permissions


class RecklessOperator(threading.Thread):
    """Press every offered desk action on the run's checkouts until `stop` is set."""

    def __init__(self, key_prefix: str, stop: threading.Event, *, interval: float = 1.0) -> None:
        super().__init__(name="reckless-operator", daemon=True)
        self.key_prefix = key_prefix
        self.stop = stop
        self.interval = interval
        #: "<action>: <result>" -> presses ("mark failed: refused", "new attempt: done", ...).
        self.presses: Counter[str] = Counter()
        #: Keys of the new attempts it started (their operations belong to the run too).
        self.attempt_keys: list[str] = []
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            user = reckless_user()
            while not self.stop.wait(self.interval):
                for op in self._offered():
                    if self.stop.is_set():
                        break
                    self._press(op, user)
        finally:
            connection.close()  # this thread's own connection

    def keys(self) -> list[str]:
        with self._lock:
            return list(self.attempt_keys)

    def _offered(self) -> list[Operation]:
        close_old_connections()
        mine = Q(key__startswith=self.key_prefix) | Q(key__in=self.keys())
        return list(
            Operation.objects.filter(mine, kind=CHECKOUT, state__in=OFFERED_STATES).order_by("pk")
        )

    def _press(self, op: Operation, user: User) -> None:
        for step in available_actions(op).settleable_steps:
            self._try(
                "mark failed",
                partial(desk.mark_step_failed, op.pk, step, user=user, reason=REASON),
            )
        self._try("new attempt", lambda: self._new_attempt(op, user))

    def _new_attempt(self, op: Operation, user: User) -> None:
        new = desk.start_new_attempt(op.pk, user=user, reason=REASON, payment_method="pm_card_visa")
        with self._lock:
            self.attempt_keys.append(new.key)

    def _try(self, action: str, press: Callable[[], object]) -> None:
        try:
            press()
        except (DeskError, PermissionDenied):
            outcome = "refused"
        except Exception:  # provider or database away: the desk said "nothing was changed"
            outcome = "error"
        else:
            outcome = "done"
        with self._lock:
            self.presses[f"{action}: {outcome}"] += 1
