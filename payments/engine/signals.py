"""Signals the engine sends, for observers it does not know (metrics, alerting).

The engine imports no observer; an observer connects a receiver (see
payments.observability.metrics). A receiver must not raise: a lost metric is a
smaller harm than a failed step.
"""

from __future__ import annotations

from django.dispatch import Signal

#: Sent after every provider call made under a claim, with `outcome` (an
#: Outcome value), `kind` (the operation kind) and `step` (the step name).
provider_call_finished = Signal()

#: Sent once the transaction that changed an operation's state commits (never for one
#: that rolls back, nor for a same-state note), with `kind`, `from_state` and `to_state`:
#: what lets a scrape count finished operations without counting the history.
operation_state_changed = Signal()
