"""payments.testing: which points a crash matrix visits, and which it must reach."""

from __future__ import annotations

import pytest

from payments.testing import _must_crash, crash_matrix, crash_points


def test_the_checkouts_points__each_step_in_run_order_then_the_final_commit():
    points = crash_points("checkout")
    assert points[:3] == [
        "after_claim_commit@charge",
        "after_provider_accept@charge",
        "before_record_commit@charge",
    ]
    assert points[-1] == "after_record_commit@checkout" and len(points) == 13


def test_an_external_steps_points_and_the_final_commit__must_be_reached():
    """A point of an external step, or the final commit, not reached fails its row (a
    matrix that crashed nothing must not pass); a local step's may not be reached."""
    assert _must_crash("checkout", "after_provider_accept@charge")
    assert _must_crash("checkout", "after_record_commit@checkout")
    assert not _must_crash("checkout", "after_claim_commit@invoice")


def test_handler_modules_as_one_string__refused():
    with pytest.raises(TypeError, match="list of dotted module paths"):
        crash_matrix(lambda key: None, handler_modules="tests.kit.unfenced")
