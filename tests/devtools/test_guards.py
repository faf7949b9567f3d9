"""The developer tools cannot hurt a production configuration."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from devtools.checks import check_devtools_not_in_production
from devtools.databases.scratch import MARKER, NotScratch, claim_scratch, flush_scratch


def test_demo__refuses_to_run_with_debug_off(settings, redis_conn):
    settings.DEBUG = False
    redis_conn.set("rq:queue:payments", "a queued payment job")
    with pytest.raises(CommandError, match="development tool"):
        call_command("demo", orders=1, workers=1)
    assert redis_conn.get("rq:queue:payments") == b"a queued payment job"


def test_scratch__refuses_a_database_holding_keys_it_did_not_create(redis_conn):
    redis_conn.set("rq:queue:payments", "a queued payment job")
    with pytest.raises(NotScratch, match="1 keys that devtools did not create"):
        claim_scratch(redis_conn, "the chaos run")
    with pytest.raises(NotScratch, match="not a devtools scratch database"):
        flush_scratch(redis_conn, "the chaos run")
    assert redis_conn.get("rq:queue:payments") == b"a queued payment job"
    assert not redis_conn.exists(MARKER)


def test_scratch__an_empty_database_is_claimed_then_flushed_and_kept_marked(redis_conn):
    claim_scratch(redis_conn, "the bench")
    redis_conn.set("rq:queue:payments", "a job of the bench")
    claim_scratch(redis_conn, "the bench")  # its own: claimed again without complaint
    flush_scratch(redis_conn, "the bench")
    assert redis_conn.keys("*") == [MARKER.encode()]


def test_deploy_check__devtools_with_debug_off_is_an_error(settings):
    settings.DEBUG = False
    assert [m.id for m in check_devtools_not_in_production()] == ["devtools.E001"]
    settings.DEBUG = True
    assert check_devtools_not_in_production() == []
