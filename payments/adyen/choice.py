"""Which payment system an operation pays through, and the shop's effects that follow it.

A shop (an ApiClient) pays through the system its `payment_system` names. The choice is
written into the operation's params when the operation is created (`system_params`), so
it never changes under an operation in flight: an uncertain Stripe charge is never
settled at Adyen because the shop moved since. A refund follows the payment it gives
back (`payment_system_of`), whatever the shop uses today.

`ByPaymentSystem` is the mixin a shop's effect class wears so that one `steps=` entry
serves both systems: the engine builds the step's effect from the class, and the class
builds Adyen's twin (`ADYEN`) for an operation that pays through Adyen. `system_for`
tells the engine the system of a claim's operation (its replay deadline).
"""

from __future__ import annotations

from typing import Any, ClassVar

from payments.adyen.effects import AdyenEffect
from payments.adyen.system import NAME
from payments.models import ApiClient, ClaimState, StepClaim

#: The system of an operation without "system" in its params (the PROVIDER_* one).
DEFAULT = "provider"


def payment_system(operation: Any) -> str:
    """The system the operation pays through."""
    return str((operation.params or {}).get("system") or DEFAULT)


def system_params(client: ApiClient | None) -> dict[str, str]:
    """The params naming the client's system; none for the default one (so the fingerprint
    of operations created before this choice existed does not change)."""
    system = getattr(client, "payment_system", "") or DEFAULT
    return {} if system == DEFAULT else {"system": system}


def payment_system_of(reference: str) -> dict[str, str]:
    """The params naming the system a payment was made through (a refund follows it)."""
    claim = (
        StepClaim.objects.filter(provider_reference=reference, state=ClaimState.DONE)
        .select_related("operation")
        .only("operation__params")
        .first()
    )
    system = payment_system(claim.operation) if claim is not None and reference else DEFAULT
    return {} if system == DEFAULT else {"system": system}


class ByPaymentSystem:
    """Build Adyen's twin of this effect for an operation that pays through Adyen."""

    ADYEN: ClassVar[type[AdyenEffect]]

    def __new__(cls, run: Any, step: str, client: Any = None) -> Any:
        if payment_system(run.operation) == NAME:
            return cls.ADYEN(run, step)
        return super().__new__(cls)

    @classmethod
    def may_call(cls) -> tuple[str, ...]:
        """Every system `system_for` may pick (what the periodic commands read)."""
        return (str(getattr(cls, "SYSTEM", DEFAULT)), NAME)

    @classmethod
    def system_for(cls, operation: Any) -> str:
        """The system a claim of this step calls, by its operation (the engine's clock)."""
        return NAME if payment_system(operation) == NAME else str(getattr(cls, "SYSTEM", DEFAULT))
