"""`make bench`'s instruction count: the queued jobs on one in-process worker, counted.

Started under valgrind by devtools.bench.instructions, with callgrind's
instrumentation off; it is on only while the worker works.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rq.registry import FailedJobRegistry, FinishedJobRegistry

from payments.engine.queues import payments_queue
from payments.engine.worker import FenceWorker


def _instrumentation(state: str) -> None:
    """Switch callgrind's instrumentation of this process on or off."""
    subprocess.run(
        ["callgrind_control", "--instr=" + state, str(os.getpid())],
        check=True,
        stdout=subprocess.DEVNULL,
    )


class Command(BaseCommand):
    help = (
        "Run every job queued on the payments queue on one FenceWorker in this process, "
        "with callgrind's instrumentation on while it works (make bench runs it under "
        "valgrind; see devtools.bench.instructions)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--jobs",
            type=int,
            required=True,
            help="Jobs that must have finished, follow-ups included.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        queue = payments_queue()
        worker = FenceWorker([queue], connection=queue.connection)
        _instrumentation("on")
        try:
            worker.work(burst=True, with_scheduler=False)
        finally:
            _instrumentation("off")
        finished = FinishedJobRegistry(queue=queue).count
        failed = FailedJobRegistry(queue=queue).count
        if failed or finished != options["jobs"]:
            raise CommandError(
                f"{finished} of {options['jobs']} jobs finished, {failed} failed: "
                "the count would not be the work asked for"
            )
