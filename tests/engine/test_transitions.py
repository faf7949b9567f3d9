"""The one authority: the transition table, owner-only claims, and fence rows closed to others."""

from __future__ import annotations

import logging

import pytest
from django.db import transaction

from payments.checkout.handler import request_checkout
from payments.checkout.names import CHARGE
from payments.checkout.orders import create_order
from payments.engine import fence, transitions
from payments.exceptions import IllegalTransition, NotClaimOwner
from payments.models import (
    ClaimState,
    FenceWriteRefused,
    Operation,
    OperationState,
    StepClaim,
)

pytestmark = pytest.mark.django_db(transaction=True)  # claims commit before their calls


def new_operation(key: str) -> Operation:
    order = create_order(amount=700, currency="eur", email="t@example.com")
    op, _ = request_checkout(order_id=order.pk, key=key, payment_method="pm_card_visa", actor="t")
    return op


def test_table__every_state_has_a_row_and_final_states_lead_nowhere():
    assert set(transitions.OPERATION_TRANSITIONS) == set(OperationState.values)
    assert set(transitions.CLAIM_TRANSITIONS) == set(ClaimState.values)
    assert transitions.OPERATION_TRANSITIONS[OperationState.SUCCEEDED] == frozenset()
    assert transitions.CLAIM_TRANSITIONS[ClaimState.DONE] == frozenset()
    assert transitions.CLAIM_TRANSITIONS[ClaimState.FAILED] == frozenset()


def test_illegal_operation_transition__raises_logs_both_states_and_changes_nothing(caplog):
    op = new_operation("illegal")
    with caplog.at_level(logging.ERROR, logger="payments.engine.transitions"):
        with pytest.raises(IllegalTransition, match="pending -> uncertain"):
            with transaction.atomic():
                locked = fence.locked_operation_in_tx(op.pk)
                fence.transition_in_tx(locked, OperationState.UNCERTAIN, actor="t")
    assert "pending -> uncertain" in caplog.text
    op.refresh_from_db()
    assert op.state == OperationState.PENDING
    assert not op.events.filter(to_state=OperationState.UNCERTAIN).exists()


def test_settled_claim__is_never_settled_again():
    op = new_operation("settled")
    claim = fence.claim_step(op, CHARGE, owner="w/1", lease_seconds=30).claim
    fence.settle_claim(claim, ClaimState.FAILED, actor="w/1", error="declined")
    with pytest.raises(IllegalTransition, match="failed -> done"):
        fence.settle_claim(claim, ClaimState.DONE, actor="w/1", reference="pi_late")
    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.FAILED, "")


def test_claim__only_its_owner_settles_or_releases_it():
    op = new_operation("owned")
    claim = fence.claim_step(op, CHARGE, owner="w/1", lease_seconds=30).claim
    with pytest.raises(NotClaimOwner, match="held by w/1, not w/2"):
        fence.settle_claim(claim, ClaimState.FAILED, actor="w/2")
    with pytest.raises(NotClaimOwner):
        fence.release_claim(claim, actor="w/2", reason="not mine")
    claim.refresh_from_db()
    assert (claim.state, claim.claimed_by) == (ClaimState.CLAIMED, "w/1")
    assert claim.lease_expires_at is not None


def test_fence_rows__refuse_writes_outside_the_fence():
    op = new_operation("stray")
    with pytest.raises(FenceWriteRefused, match=r"Operation.update\(\)"):
        Operation.objects.filter(pk=op.pk).update(state=OperationState.SUCCEEDED)
    op.state = OperationState.SUCCEEDED
    with pytest.raises(FenceWriteRefused, match=r"Operation.save\(\)"):
        op.save()
    with pytest.raises(FenceWriteRefused, match=r"StepClaim.bulk_create\(\)"):
        StepClaim.objects.bulk_create([StepClaim(operation=op, step="x", claimed_by="w")])
    with pytest.raises(FenceWriteRefused, match=r"delete\(\)"):
        op.events.all().delete()
    assert Operation.objects.get(pk=op.pk).state == OperationState.PENDING
