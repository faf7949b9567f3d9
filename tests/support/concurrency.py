"""Races between threads, each with its own database connection."""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import connection


def race(targets: list[Callable[[], object]]) -> list[object]:
    """Run each target in its own thread (own DB connection), released by one Barrier.

    Returns each target's result, or the exception it raised, in order.
    """
    barrier = threading.Barrier(len(targets))
    results: list[object] = [None] * len(targets)

    def body(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = targets[i]()
        except Exception as exc:  # collected and asserted by the test
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def on_another_connection(func: Callable[[], object]) -> object:
    """Run `func` in a thread of its own (its own connection): what is committed, not ours.

    Returns its result; raises what it raised.
    """
    (result,) = race([func])
    if isinstance(result, Exception):
        raise result
    return result
