"""What a run makes of an operation is a value (issue 40): `runtime.RunResult`, and the
exception handed to RQ after a counted failure is returned by `next_try` for its caller
to raise, instead of a helper that "always raises" unseen at its call site.

Each error of `runtime.ENDINGS` ends a real run (a handler registered here, run by
`runtime.execute`) in its state, and the run returns that state as its result.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from payments.engine import handlers, runtime
from payments.exceptions import (
    ConfigurationError,
    RetriesExhausted,
    RetryLater,
    StepConflict,
    StepNeedsReview,
    StepUncertain,
)
from payments.fence import create_operation_in_tx
from payments.models import Operation, OperationState

pytestmark = pytest.mark.django_db(transaction=True)  # a real run: its own transactions


def test_next_try__returned_not_raised():
    op = Operation(key="k", attempts=2)

    later = runtime.next_try(op, gave_up=False, reason="503", job=None)
    given_up = runtime.next_try(op, gave_up=True, reason="503", job=None)

    assert isinstance(later, RetryLater) and isinstance(given_up, RetriesExhausted)


#: Each error that ends a run, and the state the protocol gives it (docs/design.md):
#: written out here, not read from runtime.ENDINGS, so that a wrong row there fails.
ERRORS = {
    "conflict": (
        StepConflict("same key, other body", operation_key="k", step="charge"),
        OperationState.NEEDS_REVIEW,  # the same key with another body: a person decides
    ),
    "review": (
        StepNeedsReview("past the grace period", operation_key="k", step="charge"),
        OperationState.NEEDS_REVIEW,
    ),
    "uncertain": (
        StepUncertain("read timeout", operation_key="k", step="charge"),
        OperationState.UNCERTAIN,  # unknown is never failed
    ),
    "declaration": (
        ConfigurationError("step 'x' is not declared"),
        OperationState.NEEDS_REVIEW,  # the handler's declaration is wrong: a person fixes it
    ),
}


def test_every_ending_of_the_runtime_is_driven_here():
    assert {kind for kind, _state, _tell in runtime.ENDINGS} == {
        type(error) for error, _state in ERRORS.values()
    }


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_an_ending_error__its_state_and_the_same_result(name, monkeypatch):
    error, state = ERRORS[name]
    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))

    def raises(run):
        raise error

    handlers.handler(f"ends-{name}", steps=frozenset())(raises)
    with transaction.atomic():
        op, _ = create_operation_in_tx(
            key=f"ends-{name}", kind=f"ends-{name}", entity_type="x", entity_id=1, params={},
            actor="test",
        )  # fmt: skip

    result = runtime.execute(op.pk, worker_id="w/1")

    op.refresh_from_db()
    assert op.state == state
    assert result == runtime.RunResult(state) == str(state)
    assert op.last_error == str(error)  # why it stopped, uncertain too (a newcomer's catch)
