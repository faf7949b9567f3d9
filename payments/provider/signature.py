"""Check a `Stripe-Signature` header: HMAC-SHA256 of "<t>.<body>", in constant time.

The scheme is Stripe's (https://docs.stripe.com/webhooks#verify-manually): the
header carries `t=<unix time>` and one or more `v1=<hex>` signatures; an event
is authentic when one of them equals the HMAC of "<t>.<raw body>" under one
of our secrets (several during a rotation), and fresh when `t` is within the
tolerance of now. Every candidate is compared with `hmac.compare_digest`, and
all of them are compared, so the time taken says nothing about which one
nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Sequence

SIGNATURE_HEADER = "Stripe-Signature"
SCHEME = "v1"
_HEX_SIGNATURE = re.compile(r"[0-9a-f]{64}")


class SignatureError(Exception):
    """The webhook is not provably ours and fresh; the message says why (never the payload)."""


def parse_header(header: str) -> tuple[int, list[str]]:
    """Return (timestamp, v1 signatures) of a header; raise SignatureError when malformed."""
    timestamps: list[str] = []
    signatures: list[str] = []
    for item in header.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep:
            continue
        if name == "t":
            timestamps.append(value)
        elif name == SCHEME:
            signatures.append(value)
    if len(timestamps) != 1 or not timestamps[0].isascii() or not timestamps[0].isdigit():
        raise SignatureError("the signature header has no single timestamp")
    signatures = [s for s in signatures if _HEX_SIGNATURE.fullmatch(s)]
    if not signatures:
        raise SignatureError(f"the signature header has no {SCHEME} signature")
    return int(timestamps[0]), signatures


def expected_signature(payload: bytes, secret: str, timestamp: int) -> str:
    """Return the hex HMAC-SHA256 of "<timestamp>.<payload>" under `secret`."""
    signed = str(int(timestamp)).encode() + b"." + payload
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def verify(
    payload: bytes,
    header: str | None,
    secrets: Sequence[str],
    *,
    tolerance: int,
    now: float | None = None,
) -> int:
    """Return the header's timestamp when `payload` is signed by one of `secrets`, recently.

    Raise SignatureError otherwise: no secret configured, no or a malformed
    header, no matching signature, or a timestamp further than `tolerance`
    seconds from now (a replay of an old delivery, or a clock far off).
    """
    if not secrets:
        raise SignatureError("no webhook secret is configured (PAYMENT_PROVIDER_WEBHOOK_SECRET)")
    if not header:
        raise SignatureError(f"no {SIGNATURE_HEADER} header")
    timestamp, signatures = parse_header(header)
    matched = False
    for secret in secrets:
        expected = expected_signature(payload, secret, timestamp).encode()
        for candidate in signatures:
            matched |= hmac.compare_digest(expected, candidate.encode())
    if not matched:
        raise SignatureError("no signature matches a configured secret")
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance:
        raise SignatureError(f"the signed timestamp is more than {tolerance} s from now")
    return timestamp
