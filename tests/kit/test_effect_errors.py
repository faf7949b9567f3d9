"""Any system's effect errors: the neutral classes payments.fence exports, and the
Stripe-compatible provider's errors as subclasses of them (issue 40).

A project's own system raises TransientError, UncertainError, PermanentError,
NotFoundError and ConflictError (tests/kit/deposits.py does, against the kit's
FakeSystem); the fence acts on each one's `outcome`. The provider's errors keep
their own fields, and the dict stored from them keeps its shape.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import requests
from django.utils import timezone

from payments.adyen.errors import AdyenError
from payments.desk.rules import DeskError, verified_success
from payments.desk.views.queries import FirstError, not_found_kind
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
    ProviderError,
    ResourceMissing,
    TransientError,
    TransientProviderError,
    UncertainError,
    UncertainProviderError,
    classify_request_failure,
)
from payments.models import Operation, StepClaim
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


class _Unreachable:
    """An effect whose check of a reference fails with `error` (the system did not answer)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def verify(self, claim: ClaimView, reference: str) -> None:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        TransientError("GET /objects/obj_1: 503", http_status=503),
        UncertainError("GET /objects/obj_1: no complete answer"),
        PermanentError("GET /objects/obj_1: 401", http_status=401),
        ConflictError("GET /objects/obj_1: 422", http_status=422),
        AdyenError("GET /payments/obj_1: 503", outcome=Outcome.TRANSIENT, http_status=503),
    ],
    ids=lambda error: type(error).__name__,
)
def test_the_desks_reference_check__any_systems_error_refused_nothing_changed(error):
    """An operator's mark-succeeded checks the reference with the step's system first
    (payments.desk.rules.verified_success): a project's own system's error, or Adyen's,
    is refused as the provider's was. It escaped before: a 500 page mid-incident."""
    op = Operation(key="dep-1")
    claim = StepClaim(
        operation=op, step=HOLD, idempotency_key="k", request={}, claimed_at=timezone.now()
    )
    spec = SimpleNamespace(effect=lambda step, operation: _Unreachable(error))

    with pytest.raises(DeskError, match=r"could not check obj_1 .*nothing was changed"):
        verified_success(op, claim, spec, "obj_1")


def test_an_adyen_error__an_effect_error_that_survives_a_pickle():
    """RQ may pickle what a job raised: Adyen's error came back as a TypeError (its
    outcome was a required keyword)."""
    error = AdyenError("POST /payments: 704", outcome=Outcome.TRANSIENT, code="704",
                       psp_reference="PSP1", in_flight=True)  # fmt: skip

    back = pickle.loads(pickle.dumps(error))

    assert isinstance(back, EffectError)
    assert (back.outcome, back.code, back.request_id, back.in_flight) == (
        Outcome.TRANSIENT, "704", "PSP1", True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "first, says",
    [
        (FirstError("AdyenError: POST /payments: 502", may_have_run=True), "answer lost"),
        (FirstError("UncertainError: POST /objects: 502", may_have_run=True), "answer lost"),
        (FirstError("released after transient failure: AdyenError: 503"), "never reached"),
        (FirstError("released after transient failure: TransientError: 503"), "never reached"),
        (FirstError("PermanentError: POST /objects: 400"), "nothing under its key"),
    ],
)
def test_not_found__the_first_errors_kind_read_from_the_engine_not_the_class(first, says):
    """The look-up's "not found" says whether the first request may have run, from what
    the engine recorded (the claim held uncertain, or released after a refusal), whatever
    the system's error classes are called."""
    assert says in not_found_kind(first, "step hold_deposit: not found at the system")


@pytest.mark.parametrize(
    "failure, neutral",
    [
        (requests.exceptions.ConnectionError(ConnectionRefusedError()), TransientError),
        (requests.exceptions.ReadTimeout(), UncertainError),
    ],
)
def test_a_transport_failure_of_any_system__the_neutral_class_not_the_providers(failure, neutral):
    """The desk showed a label service's lost answer as "UncertainProviderError: ...":
    `classify_request_failure` gives the neutral class, its name what the audit keeps."""
    error = classify_request_failure(failure, context="POST /labels")

    assert type(error) is neutral
    assert f"{neutral.__name__}: POST /labels" in f"{type(error).__name__}: {error}"
    assert not isinstance(error, ProviderError)
