"""A handler that calls its effect outside the fence (in its body, not in a step), for
tests/kit/test_matrix_crash.py: the crash matrix must catch the second call."""

from __future__ import annotations

import os
from pathlib import Path

from payments.fence import DeliveryPolicy, Run, operation

UNFENCED = "kit_unfenced_notify"


def sent_file(op_key: str) -> Path:
    return Path(os.environ.get("KIT_SENT_DIR", "/tmp")) / f"sent-{op_key}"


def send(op_key: str) -> None:
    with open(sent_file(op_key), "a") as sent:
        sent.write("sent\n")


@operation(UNFENCED, steps={"notify": None})
def notify(run: Run) -> None:
    send(run.operation.key)  # the mistake: a call a redelivery makes again
    run.side_effect("notify", lambda: None, policy=DeliveryPolicy.AT_MOST_ONCE)
