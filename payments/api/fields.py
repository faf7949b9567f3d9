"""Serializer fields that accept exactly what the schema says (DRF coerces by default).

Every rule a field enforces is a pattern, a length or a range that the OpenAPI
schema publishes as it is (drf-spectacular reads the validators): the schema
and the API cannot drift apart, and a fuzzer reading the schema finds nothing
refused that it was told is valid.
"""

from __future__ import annotations

import re
from typing import Any

from django.core.validators import RegexValidator
from rest_framework import serializers

MAX_KEY_LENGTH = 255
#: An Idempotency-Key: 1-MAX_KEY_LENGTH printable ASCII characters, neither first nor last a space
#: (an HTTP server strips them: a key with one could never arrive as sent).
IDEMPOTENCY_KEY_PATTERN = r"\A[!-~]([ -~]{0,253}[!-~])?\Z"
#: A payment method: the provider's id of one (`pm_...`), printable ASCII without spaces.
PAYMENT_METHOD_PATTERN = r"\A[!-~]{1,255}\Z"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
#: An e-mail address as a shop can send to it: an ASCII local part of 1-64 octets (RFC
#: 5321), not starting or ending with a dot; a domain of labels with at least one dot, its
#: last label starting with a letter. ASCII only, as sent: an internationalised domain is
#: sent in its ASCII form (`xn--...`); converting it here (Python's IDNA 2003 codec) would
#: silently map soft hyphens, zero-width spaces and fullwidth letters away, and take text
#: the schema's pattern refuses.
EMAIL_PATTERN = rf"\A{_ATEXT}([A-Za-z0-9!#$%&'*+/=?^_`{{|}}~.-]{{0,62}}{_ATEXT})?@({_LABEL}\.)+[A-Za-z]([A-Za-z0-9-]{{0,61}}[A-Za-z0-9])?\Z"
MAX_EMAIL_LENGTH = 254
# Patterns are Python's, anchored with \A and \Z (`$` would let a trailing newline
# through); the schema gets them with ECMA's ^ and $ (drf-spectacular converts validators'
# patterns, `ecma` the ones written into the schema by hand).


def ecma(pattern: str) -> str:
    """`pattern` as JSON Schema writes it (ECMA 262 anchors)."""
    return pattern.replace(r"\A", "^").replace(r"\Z", "$")


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer: not a string, a float or a boolean."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return int(super().to_internal_value(data))


class StrictCharField(serializers.CharField):
    """A JSON string: not a number, taken as sent (no trimming)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class PatternField(StrictCharField):
    """A JSON string matching `pattern` (published in the schema as it is)."""

    def __init__(self, pattern: str, message: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validators.append(RegexValidator(pattern, message))


class StrictEmailField(PatternField):
    """An e-mail address matching EMAIL_PATTERN as sent; its domain is stored lower-cased."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            EMAIL_PATTERN,
            "Enter an e-mail address in ASCII: at most 64 characters before the @, a domain "
            "with a dot (an internationalised domain in its xn-- form).",
            max_length=MAX_EMAIL_LENGTH,
            **kwargs,
        )

    def run_validation(self, data: Any = serializers.empty) -> Any:
        """Check the pattern on the text as sent, then lower-case the domain."""
        return lower_domain(super().run_validation(data))


def lower_domain(email: str) -> str:
    """`email` with its domain lower-cased (the local part is the mailbox's, kept as sent)."""
    local, at, domain = email.rpartition("@")
    return f"{local}@{domain.lower()}" if at else email


def matches(pattern: str, text: str) -> bool:
    return re.search(pattern, text) is not None


class ErrorDetail(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    field = serializers.CharField(required=False)


class ErrorOut(serializers.Serializer):
    """Every answer that is not a success: `{"error": {"code", "message", "field"?}}`."""

    error = ErrorDetail()


#: The errors every endpoint may answer, for the OpenAPI schema.
ERRORS = {code: ErrorOut for code in (400, 401, 404, 405, 406, 409, 413, 415, 429, 503)}
