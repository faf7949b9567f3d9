"""System checks inbox.W001 (retention vs redelivery horizon) and inbox.E001."""

from __future__ import annotations

from django.core import checks
from rq.defaults import DEFAULT_FAILURE_TTL

from inbox.checks import check_retention_covers_redelivery, check_settings

YEAR_AND_A_DAY = DEFAULT_FAILURE_TTL + 86400


def ids(messages: list[checks.CheckMessage]) -> list[tuple[str | None, object]]:
    return [(m.id, m.obj) for m in messages]


def test_w001__default_retention_is_shorter_than_rq_failure_ttl(settings) -> None:
    del settings.INBOX

    [warning] = check_retention_covers_redelivery()

    assert warning.id == "inbox.W001"
    assert warning.level == checks.WARNING
    assert "(7d)" in warning.msg and "(365d)" in warning.msg  # read from rq's DEFAULT_FAILURE_TTL
    assert warning.hint is not None and "REDELIVERY_HORIZON" in warning.hint


def test_w001__fires_for_the_short_consumer_only(settings) -> None:
    settings.INBOX = {"RETENTION": {"default": YEAR_AND_A_DAY, "emails": 3600}}

    assert ids(check_retention_covers_redelivery()) == [
        ("inbox.W001", "INBOX['RETENTION']['emails']")
    ]


def test_w001__quiet_when_retention_exceeds_horizon(settings) -> None:
    settings.INBOX = {"RETENTION": {"default": YEAR_AND_A_DAY}}

    assert check_retention_covers_redelivery() == []


def test_w001__quiet_when_deployment_states_a_shorter_horizon(settings) -> None:
    settings.INBOX = {"REDELIVERY_HORIZON": 3 * 86400}

    assert check_retention_covers_redelivery() == []


def test_w001__fires_against_a_stated_horizon(settings) -> None:
    settings.INBOX = {"REDELIVERY_HORIZON": 30 * 86400}

    assert ids(check_retention_covers_redelivery()) == [
        ("inbox.W001", "INBOX['RETENTION']['default']")
    ]


def test_e001__malformed_settings(settings) -> None:
    for bad in (
        {"PURGE_CHANCE": 2},
        {"PURGE_BATCH_SIZE": 0},
        {"PURGE_BATCH_SECONDS": -0.01},
        {"PURGE_BATCH_SECONDS": "20ms"},
        {"RETENTION": {"emails": -1}},
        {"RETENTION": {"emails": "7d"}},
        {"STRICT_MESSAGE_ID": "yes"},
        {"UNKNOWN": 1},
    ):
        settings.INBOX = bad
        assert [m.id for m in check_settings()] == ["inbox.E001"], bad
        assert check_retention_covers_redelivery() == []


def test_checks__registered_with_the_inbox_tag(settings) -> None:
    settings.INBOX = {"RETENTION": {"default": 3600}}

    found = checks.run_checks(tags=["inbox"])

    assert "inbox.W001" in [m.id for m in found]
