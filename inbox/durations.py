"""Parse and print the short durations used by purge_inbox and the checks."""

from __future__ import annotations

import re
from datetime import timedelta

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"\s*(\d+)\s*([smhd])\s*")


def parse_duration(text: str) -> timedelta:
    """Parse ``30m``, ``12h``, ``7d`` or ``3600s`` into a timedelta.

    Raise ``ValueError`` on anything else, including a bare number: a unit
    is required so ``7`` is never read as seconds when days were meant.
    """
    match = _DURATION_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"Cannot parse duration {text!r}; use a whole number with a unit: "
            "30m, 12h, 7d or 3600s."
        )
    return timedelta(seconds=int(match[1]) * _UNITS[match[2]])


def format_duration(duration: timedelta) -> str:
    """Return ``duration`` in the largest unit that divides it exactly (``7d``, ``90m``)."""
    seconds = int(duration.total_seconds())
    for unit in ("d", "h", "m"):
        if seconds and seconds % _UNITS[unit] == 0:
            return f"{seconds // _UNITS[unit]}{unit}"
    return f"{seconds}s"
