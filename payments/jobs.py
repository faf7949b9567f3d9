"""RQ job paths of releases before the `payments/engine/` layout.

RQ stores a job's function as a dotted path. Jobs enqueued by an earlier
release (waiting in a queue, scheduled for a retry, or in the failed registry
to be requeued) name `payments.jobs.run_operation` and
`payments.jobs.deliver_follow_up`; these names keep them runnable. New jobs
use `payments.engine.jobs`. Remove this module once no job older than the
deploy can be requeued (RQ keeps failed jobs for `RQ_FAILURE_TTL`).
"""

from __future__ import annotations

from payments.engine.jobs import deliver_message as deliver_follow_up
from payments.engine.jobs import run_operation

__all__ = ["deliver_follow_up", "run_operation"]
