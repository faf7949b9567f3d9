"""`run_recovery` when its database connection is cut in the middle of a round.

A PostgreSQL or PgBouncer restart cuts every connection. When it cuts the
recovery loop's connection during the sweep, the sweep fails and says so; the
reconcile of the same round must still run, on a new connection, instead of
failing on the cut one (found by `manage.py demo --topology ha`: each restart
cost the reconcile a round, `--interval` seconds, 10 in production).
"""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import OperationalError, connection

from payments.engine.recovery import SweepReport
from payments.management.commands import run_recovery

# Transactional: the connection is really cut, by the server.
pytestmark = pytest.mark.django_db(transaction=True)


def test_run_recovery__connection_cut_during_the_sweep__the_reconcile_still_runs(monkeypatch):
    def sweep_cut_by_a_restart() -> SweepReport:
        # The server ends this session, as a restart would, while the sweep reads.
        with pytest.raises(OperationalError), connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        raise OperationalError("the sweep's connection was cut")

    monkeypatch.setattr(run_recovery, "sweep", sweep_cut_by_a_restart)
    out, err = StringIO(), StringIO()

    call_command("run_recovery", "--once", verbosity=2, stdout=out, stderr=err)

    assert "sweep failed: OperationalError" in err.getvalue()
    assert "reconcile failed" not in err.getvalue(), err.getvalue()
    assert "reconciled 0" in out.getvalue()
