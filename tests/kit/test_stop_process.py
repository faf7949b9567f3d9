"""The kit's `stop_process` stops a worker's whole group, even after the worker itself died.

A worker killed at a fence point (SIGKILL of the worker process, as a failpoint
does) leaves its children alive: RQ's scheduler, holding the worker's stderr
open. Stopping the group only while its leader runs left them to the 15 s
time-out's SIGKILL: each restart of a crash test waited that long, and the
children never got their SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from payments.testing import stop_process

#: A leader that forks a child (handling SIGTERM by saying so), then SIGKILLs itself.
LEADER = textwrap.dedent(
    """
    import os, signal, sys, time
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        def stopped(*_):
            sys.stderr.write("child stopped by SIGTERM\\n")
            sys.stderr.flush()
            os._exit(0)
        signal.signal(signal.SIGTERM, stopped)
        os.write(ready_w, b"1")
        while True:
            time.sleep(0.05)
    os.read(ready_r, 1)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_leader_killed__its_surviving_child_gets_sigterm_and_its_stderr_is_returned():
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER], stderr=subprocess.PIPE, start_new_session=True
    )
    proc.wait()  # the leader is dead; its child still holds stderr open

    err = stop_process(proc)

    assert "child stopped by SIGTERM" in err


def test_a_group_that_ended__stopped_without_error():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stderr.write('bye')"],
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    proc.wait()

    assert stop_process(proc) == "bye"
