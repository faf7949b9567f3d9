"""Log output for the whole project: JSON lines, and a filter that keeps PII and secrets out.

`settings.LOGGING` puts `RedactFilter` on every handler (root included) and
formats with `JsonFormatter` (python-json-logger, plus a last redaction pass
over the finished line). What is removed, and why each rule exists:

- e-mail addresses -> `[email]` (customers' identities);
- PAN-like digit runs, 13 to 19 digits with optional single spaces or dashes
  between them -> `[card]` (no Luhn test: a mistyped card number is still one);
- API keys (`sk_...`, `rk_...`, `whsec_...`), `Bearer <token>`,
  `<name ending in secret|token|password|api_key|cvc>=<value>`, the password
  of a `scheme://user:password@host` URL, and the current values of
  `SECRET_KEY`, `API_TOKEN`, `METRICS_TOKEN` and the provider API key;
- payloads: a mapping passed as a log argument or nested in a structured
  field is replaced by `[payload]` before anything formats it.

Payment-method ids (`pm_...`, including the test cards `pm_card_visa`) are
kept: they are opaque provider tokens, not cardholder data, and support needs
them. The step records never carry them anyway.

The filter edits the record in place, so every handler after it (pytest's
caplog, an admin e-mail) sees the redacted record too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from django.utils.functional import Promise
from django.utils.log import AdminEmailHandler
from django.views.debug import ExceptionReporter
from pythonjsonlogger.json import JsonFormatter as _BaseJsonFormatter

PAYLOAD = "[payload]"


def _has_whitespace(text: str) -> bool:
    """Tell whether `text` may hold what `\\s` matches: a space, or a character that is
    not printable (every other whitespace character is a control or a separator)."""
    return " " in text or not text.isprintable()


#: The characters `re.IGNORECASE` takes for an ASCII letter besides its two cases (Python's
#: own equivalences: tests/observability/test_logging.py checks every code point).
_ASCII_FOLDS = str.maketrans({"\u0130": "i", "\u0131": "i", "\u017f": "s", "\u212a": "k"})
#: The words of the key=value rule, as they read folded (`_folded`).
_SECRET_WORDS = ("secret", "token", "password", "passwd", "api_key", "apikey", "cvc", "cvv")


def _folded(text: str) -> str:
    """`text` with every letter a case-insensitive rule could take for an ASCII one made
    that ASCII letter, in lower case: a rule's word is in it wherever the rule finds it
    (one pass each, where the rule's own search tries every word's every ending)."""
    return text.translate(_ASCII_FOLDS).lower()


def _has_secret_word(text: str) -> bool:
    folded = _folded(text)
    return any(word in folded for word in _SECRET_WORDS)


#: Each rule: its pattern, its replacement, and a test of what the pattern cannot match
#: without (a substring, a length, its word), run first because most values (a step's
#: name, a state, an id) and most finished lines hold none of it.
_PATTERNS: list[tuple[re.Pattern[str], str, Callable[[str], bool]]] = [
    # user:password@ in URLs (Redis, database): before the e-mail rule eats the host part.
    (
        re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@"),
        r"\1[secret]@",
        lambda text: "://" in text,
    ),
    (
        re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
        "[email]",
        lambda text: "@" in text,
    ),
    (
        re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]+"),
        "Bearer [secret]",
        lambda text: _has_whitespace(text) and "bearer" in _folded(text),
    ),
    (
        re.compile(r"\b(?:sk|rk)_[A-Za-z0-9_]{3,}|\bwhsec_[A-Za-z0-9]+"),
        "[secret]",
        lambda text: "k_" in text or "whsec_" in text,
    ),
    (
        re.compile(
            r"(?i)\b(\w*(?:secret|token|password|passwd|api_?key|cvc|cvv)\w*)"
            r"(['\"]?\s*[=:]\s*['\"]?)(?!\[)[^\s'\",;&}\]]+"
        ),
        r"\1\2[secret]",
        lambda text: ("=" in text or ":" in text) and _has_secret_word(text),
    ),
    (
        re.compile(r"(?<![\w.-])\d(?:[ -]?\d){12,18}(?![\w-])"),
        "[card]",
        lambda text: len(text) >= 13,
    ),
]

#: Secrets shorter than this are not searched for by value (too many false hits).
_MIN_SECRET_LENGTH = 8


def _configured_secrets() -> list[str]:
    """Return the secret values of the running configuration, longest first."""
    from django.conf import settings

    if not settings.configured:
        return []
    values = [
        getattr(settings, "SECRET_KEY", ""),
        getattr(settings, "API_TOKEN", ""),
        getattr(settings, "METRICS_TOKEN", ""),
        _provider_api_key(),
    ]
    found = {v for v in values if isinstance(v, str) and len(v) >= _MIN_SECRET_LENGTH}
    return sorted(found, key=len, reverse=True)


def _provider_api_key() -> str:
    from django.core.exceptions import ImproperlyConfigured

    from payments.conf import payments_settings

    try:
        return payments_settings().provider_api_key
    except ImproperlyConfigured:  # payments.E009 reports it; redaction must not fail
        return ""


def redact(text: str, secrets: list[str] | None = None) -> str:
    """Return `text` with e-mail addresses, card-like numbers and secrets masked.

    `secrets`: the configured secrets' values (`_configured_secrets()`), when the
    caller redacts several texts at once; read here otherwise.
    """
    if not text:
        return text
    for secret in _configured_secrets() if secrets is None else secrets:
        text = text.replace(secret, "[secret]")
    for pattern, replacement, could_match in _PATTERNS:
        if could_match(text):
            text = pattern.sub(replacement, text)
    return text


def _scrub(value: Any, *, nested: bool, secrets: list[str]) -> Any:
    """Redact one field value; a mapping below the top level is a payload and is dropped."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, Mapping):
        if nested:
            return PAYLOAD
        return {str(k): _scrub(v, nested=True, secrets=secrets) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_scrub(v, nested=True, secrets=secrets) for v in value]
    return value


#: LogRecord attributes that are the record's own, not structured fields.
_RECORD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
#: Extras Django passes that handlers need as objects (AdminEmailHandler reads the request).
_KEEP_OBJECTS = frozenset({"request"})


class RedactFilter(logging.Filter):
    """Mask PII and secrets in a record's message, arguments, fields and traceback.

    Never drops a record. Safe to apply more than once: redacted text does
    not match again.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _configured_secrets()  # once per record, not once per field
        if isinstance(record.msg, Mapping):
            record.msg = _scrub(record.msg, nested=False, secrets=secrets)
        else:
            args = record.args
            if isinstance(args, tuple):
                args = tuple(
                    PAYLOAD if isinstance(a, Mapping) else _scrub(a, nested=True, secrets=secrets)
                    for a in args
                )
            elif isinstance(args, Mapping):
                # logging turns a lone mapping argument into `args` itself: named
                # formatting ("%(name)s") if the message asks for it, else a payload.
                args = (
                    _scrub(args, nested=False, secrets=secrets)
                    if "%(" in str(record.msg)
                    else (PAYLOAD,)
                )
            try:
                message = str(record.msg) % args if args else str(record.msg)
            except (TypeError, ValueError, KeyError):
                message = f"{record.msg} {args!r}"  # as logging would show the broken call
            record.msg, record.args = redact(message, secrets), None
        for name, value in list(record.__dict__.items()):
            if name in _RECORD_ATTRS or name in _KEEP_OBJECTS:
                continue
            record.__dict__[name] = _scrub(value, nested=True, secrets=secrets)
        if record.exc_info and not record.exc_text:
            # Formatters reuse exc_text; rendering it here makes every handler print
            # the redacted traceback instead of rendering the raw one again.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, secrets)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, secrets)
        return True


class JsonFormatter(_BaseJsonFormatter):
    """One JSON object per line: time, level, logger, message, then the record's fields."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("rename_fields", {"levelname": "level", "name": "logger"})
        kwargs.setdefault("timestamp", "time")
        # Keep non-ASCII as is, so the last redaction pass sees the real characters.
        kwargs.setdefault("json_ensure_ascii", False)
        super().__init__(*(args or ("%(levelname)s %(name)s %(message)s",)), **kwargs)

    # python-json-logger widens logging's `str` for its exc_info_as_array option, and says
    # so with the same ignore: this keeps its contract.
    def formatException(self, ei: Any) -> str | list[str]:  # type: ignore[override]  # noqa: N802
        formatted = super().formatException(ei)
        if isinstance(formatted, list):  # exc_info_as_array=True: one string per line
            return [redact(line) for line in formatted]
        return redact(formatted)

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_text and record.exc_info:
            # python-json-logger renders exc_info afresh; prefer the filter's redacted text.
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None})
        # The last pass covers what the filter cannot see: objects (a request) that
        # the encoder turns into text.
        return redact(super().format(record))


class _NoLocalsExceptionReporter(ExceptionReporter):
    """An exception report without frame variables: locals hold payloads and addresses."""

    def get_traceback_frames(self) -> list[dict[str, Any]]:
        frames = super().get_traceback_frames()
        for frame in frames:
            frame["vars"] = []
        return frames


class RedactingAdminEmailHandler(AdminEmailHandler):
    """Django's admin e-mail handler, without frame locals and with the mail text redacted."""

    def __init__(self, include_html: bool = False, email_backend: str | None = None) -> None:
        super().__init__(
            include_html=False,  # the HTML report shows settings and locals; never send it
            email_backend=email_backend,
            reporter_class=f"{__name__}._NoLocalsExceptionReporter",
        )

    def send_mail(
        self, subject: str | Promise, message: str | Promise, *args: Any, **kwargs: Any
    ) -> None:
        kwargs.pop("html_message", None)
        super().send_mail(redact(str(subject)), redact(str(message)), *args, **kwargs)
