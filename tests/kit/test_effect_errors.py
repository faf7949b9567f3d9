"""Any system's effect errors: the neutral classes payments.fence exports, and the
Stripe-compatible provider's errors as subclasses of them (issue 40).

A project's own system raises TransientError, UncertainError, PermanentError,
NotFoundError and ConflictError (tests/kit/deposits.py does, against the kit's
FakeSystem); the fence acts on each one's `outcome`. The provider's errors keep
their own fields, and the dict stored from them keeps its shape.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from payments.engine.effects import ClaimView, ReferenceNotFound
from payments.engine.outcomes import Outcome
from payments.fence import (
    CardDeclined,
    ConflictError,
    EffectError,
    IdempotencyConflict,
    InvalidRequest,
    NotFoundError,
    PermanentError,
    ResourceMissing,
    TransientError,
    TransientProviderError,
    UncertainError,
    UncertainProviderError,
)
from payments.testing import FakeSystem
from tests.kit.deposits import DEPOSITS, HOLD, HoldDeposit


@pytest.mark.parametrize(
    "neutral, outcome, provider",
    [
        (TransientError, Outcome.TRANSIENT, [TransientProviderError]),
        (UncertainError, Outcome.UNCERTAIN, [UncertainProviderError]),
        (PermanentError, Outcome.PERMANENT, [CardDeclined, InvalidRequest, ResourceMissing]),
        (NotFoundError, Outcome.PERMANENT, [ResourceMissing]),
        (ConflictError, Outcome.CONFLICT, [IdempotencyConflict]),
    ],
)
def test_each_neutral_error__its_outcome__and_the_providers_errors_are_of_it(
    neutral, outcome, provider
):
    error = neutral("POST /objects: 503", http_status=503, code="busy", request_id="req_1")

    assert error.outcome == outcome and isinstance(error, EffectError)
    assert error.as_dict() == {
        "error": neutral.__name__,
        "outcome": str(outcome),
        "message": "POST /objects: 503",
        "http_status": 503,
        "code": "busy",
        "request_id": "req_1",
        "replayed": False,
    }
    for cls in provider:
        assert isinstance(cls("x"), neutral) and cls("x").outcome == cls.default_outcome


def test_a_provider_error__keeps_its_own_fields_in_what_is_stored():
    """Claim results and audit rows written before the neutral classes keep their shape."""
    declined = CardDeclined(
        "card declined", http_status=402, code="card_declined", decline_code="insufficient_funds",
        payment_intent_id="pi_1", payment_intent_status="requires_payment_method",
    )  # fmt: skip

    assert declined.as_dict() == {
        "error": "CardDeclined",
        "outcome": "permanent",
        "message": "card declined",
        "http_status": 402,
        "error_type": None,
        "code": "card_declined",
        "decline_code": "insufficient_funds",
        "param": None,
        "request_id": None,
        "payment_intent_id": "pi_1",
        "payment_intent_status": "requires_payment_method",
        "replayed": False,
    }


def test_a_typed_reference_the_system_does_not_have__not_found_through_its_404(settings):
    """The deposit service answers 404 (NotFoundError, from tests/kit/deposits.py): an
    operator's typed reference is refused as not found, and a lookup finds nothing yet."""
    with FakeSystem() as system:
        settings.PAYMENTS = {
            **settings.PAYMENTS,
            "SYSTEMS": {
                **settings.PAYMENTS.get("SYSTEMS", {}),
                DEPOSITS: {"URL": system.url, "API_KEY": "test"},
            },
        }
        operation = SimpleNamespace(key="dep-1", pk=1, params={"amount": 500})
        effect = HoldDeposit(SimpleNamespace(operation=operation), HOLD)
        missing = "obj_" + "0" * 24
        claim = ClaimView(
            operation_key="dep-1", step=HOLD, idempotency_key="k", reference=missing,
            request={"external_id": "dep-1@1", "amount": 500, "currency": "eur"},
        )  # fmt: skip

        with pytest.raises(ReferenceNotFound):
            effect.verify(claim, missing)
        assert effect.find(claim) is None
