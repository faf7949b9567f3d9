"""Instructions a worker executes per checkout, counted by callgrind: the fence's cost
without the machine's noise.

Throughput and CPU seconds move with the machine and with whatever else runs
on it: two `make bench` runs on one machine differ in their throughput ratios
by as much as the fence's share, and the CPU meter reads a batch at the
kernel's clock-tick resolution. Valgrind's callgrind counts the instructions
one process executes instead: the same code, jobs and data give nearly the
same count, whatever the other core does. It counts the worker only (not PostgreSQL, Redis
or the provider), and instructions, not time (a cache miss costs one).

The counted process is one `FenceWorker` run in burst mode inside
`manage.py bench_instructions_worker`, started under valgrind with the
instrumentation off; it turns it on (`callgrind_control -i on`) just before it
takes the first job and off when the queue is empty, so Python's start-up and
Django's setup are not counted. Each side runs twice, with `small` and `large`
checkouts queued: the difference divided by `large - small` is what one more
checkout (its three jobs) costs, without the worker's own start and end (its
start-up checks, migrations and recorded names, run once per count and cancel out).
The project's modules are compiled to bytecode first (`compiled_once`): a module a
worker imports for the first time in a fresh tree (a clean CI checkout) would
otherwise be compiled inside the counted window of whichever run imports it first.
"""

from __future__ import annotations

import compileall
import functools
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from devtools.bench.runner import Bench
from devtools.topology.stack import ROOT

#: What must be installed (Debian's valgrind package has both).
TOOLS = ("valgrind", "callgrind_control")


def available() -> bool:
    """Tell whether valgrind and callgrind_control are installed."""
    return all(shutil.which(tool) for tool in TOOLS)


def per_checkout(
    bench: Bench, prepare_for: Callable[[int], Callable[[], int]], *, small: int, large: int
) -> float:
    """Instructions one more checkout costs a worker: `prepare_for(n)` queues n checkouts.

    The provider's latency does not change the count (the worker waits, it does
    not execute): the caller may set it to 0 to save time.
    """
    if not 0 < small < large:
        raise ValueError("need 0 < small < large")
    compiled_once()
    counts = []
    for n in (small, large):
        bench.reset()
        expected = prepare_for(n)()
        counts.append(count_worker(bench, expected))
    return (counts[1] - counts[0]) / (large - small)


#: The project's packages whose modules a counted worker imports.
PACKAGES = ("payments", "inbox", "project", "devtools")


@functools.cache
def compiled_once() -> None:
    """Compile the project's modules to bytecode, once per process (none that is current
    is compiled again). In a clean checkout's test suite, the first of a test's four
    counts compiled what only a worker imports: 69 M instructions more in its fenced
    one-checkout run, which made a fenced checkout read 11.6 M against the twin's 39.8 M.
    """
    for package in PACKAGES:
        compileall.compile_dir(ROOT / package, quiet=1)


def count_worker(bench: Bench, jobs: int) -> int:
    """Run the queued jobs (`jobs` of them, follow-ups included) on one worker under
    callgrind; return the instructions it executed while it worked."""
    log_dir: Path = bench.stack.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    out = log_dir / "callgrind.out"
    out.unlink(missing_ok=True)
    with open(log_dir / "instructions-worker.log", "ab") as log:
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                "manage.py",
                "bench_instructions_worker",
                "--jobs",
                str(jobs),
            ],
            cwd=ROOT,
            env={**bench.stack.env, **bench.worker_env},
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=1800,
        )
    return totals(out.read_text())


def totals(callgrind_out: str) -> int:
    """The instructions a callgrind output file records (its `totals:` line)."""
    for line in callgrind_out.splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError("no totals line in the callgrind output")
