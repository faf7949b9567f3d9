"""Django's PostgreSQL backend, with a transaction's BEGIN sent with its first statement.

With Django's stock backend, psycopg 3 opens a transaction with a BEGIN in a
round trip of its own: Django turns psycopg's autocommit off when an
`atomic()` block starts, and psycopg then sends BEGIN and waits for its
answer before the block's first statement (in pipeline mode too: it syncs
after the BEGIN). Every transaction pays one more round trip than it needs.

This backend keeps psycopg in autocommit and opens the transaction itself:
when Django's autocommit is off and PostgreSQL has no transaction open, the
next statement goes in one pipeline behind a BEGIN, and both wait for one
answer. Nothing else changes:
- the transaction starts at the same statement, so it sees the same snapshot
  and takes the same locks;
- a statement that fails leaves the transaction aborted, as after a BEGIN
  sent alone; Django rolls it back as usual (psycopg's `commit()` and
  `rollback()` send COMMIT and ROLLBACK whenever a transaction is open,
  whatever its autocommit says);
- an isolation level set in OPTIONS goes in the BEGIN, as psycopg would send it;
- what cannot ride in a pipeline behind a BEGIN is preceded by a BEGIN sent
  alone, as before: a statement without parameters (psycopg sends it as a
  simple query, which may hold several commands: a migration's RunSQL),
  `executemany`, COPY, a server-side cursor's DECLARE, a streamed result.
  A statement with parameters and several commands (Django's client-side
  cursor sends it as a simple query; the pipeline's extended protocol refuses
  it before running any) is sent again the same way: the BEGIN rolled back,
  then sent alone, then the statement (three more round trips, only then;
  four when psycopg forgets the connection's prepared statements with the
  rollback). Any other syntax error, one a function raises while the
  statement runs included, is raised as it comes: never sent again.

Code that sends its own pipeline inside a transaction (payments.engine.fence)
asks `begin_owed()` and queues `begin_statement()` in front of it.

It also decodes `timestamptz` values with psycopg's C loader. Django's
backend registers a loader of its own for them (the value in Django's time
zone) that derives from psycopg's pure-Python loader, so with psycopg's
binary or C build installed every timestamp read still goes through a
regular expression in Python (Django ticket #36960, psycopg issue #1273),
once per value, and a fence row carries four to six. `TzLoader` is
Django's loader with psycopg's optimised implementation doing the parsing:
the same datetimes, same tzinfo (`tests/topology/test_postgresql_backend.py`).
Opt-in: DATABASE_BEGIN_WITH_FIRST_STATEMENT=1 (project/settings.py) sets ENGINE =
"project.postgresql"; Django's stock backend is the default. It overrides private
methods of Django's backend (`_set_autocommit`, `create_cursor`,
`get_connection_params`) and relies on psycopg's pipeline behaviour, so importing it
on other Django or psycopg versions than TESTED_VERSIONS raises ImproperlyConfigured:
test it on the new versions (tests/topology/test_postgresql_backend.py), then pin them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import django
import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.backends.postgresql import base
from django.db.backends.postgresql.psycopg_any import (
    BaseTzLoader,
    get_adapters_template,
    register_tzloader,
)
from psycopg import adapt, pq
from psycopg.pq import Format
from psycopg.types.datetime import TimestamptzLoader

#: The versions this backend was tested with (requirements.txt pins them): Django's private
#: methods it overrides, and psycopg's pipeline it relies on, may change in any release.
TESTED_VERSIONS = {"Django": "5.2.19", "psycopg": "3.3.9"}


def untested_versions(installed: dict[str, str]) -> list[str]:
    """Name each of `installed` ({"Django": version, ...}) not at its TESTED_VERSIONS one."""
    return [
        f"{name} {installed.get(name)} (tested: {version})"
        for name, version in TESTED_VERSIONS.items()
        if installed.get(name) != version
    ]


def check_tested_versions(installed: dict[str, str]) -> None:
    """Refuse to run on versions this backend was not tested with (ImproperlyConfigured)."""
    untested = untested_versions(installed)
    if untested:
        raise ImproperlyConfigured(
            "project.postgresql (DATABASE_BEGIN_WITH_FIRST_STATEMENT=1) overrides private "
            f"methods of Django's backend and was not tested with {', '.join(untested)}. "
            "Unset DATABASE_BEGIN_WITH_FIRST_STATEMENT to use Django's own backend, or run "
            "tests/topology/test_postgresql_backend.py on these versions and update "
            "TESTED_VERSIONS."
        )


check_tested_versions({"Django": django.__version__, "psycopg": psycopg.__version__})

#: The attribute of a psycopg connection that says Django has a transaction open on it
#: (Django's autocommit is off): the next statement on an idle server sends BEGIN first.
_TRANSACTION_WANTED = "django_transaction_wanted"


def _owes_begin(raw: Any) -> bool:
    """True when a statement sent now on `raw`, outside a pipeline, must send BEGIN first."""
    return (
        getattr(raw, _TRANSACTION_WANTED, False)
        and raw.pgconn.transaction_status == pq.TransactionStatus.IDLE
        and raw.pgconn.pipeline_status == pq.PipelineStatus.OFF
    )


def begin_statement(raw: Any) -> str:
    """The BEGIN psycopg would send for `raw` (its isolation level, read only, deferrable)."""
    parts = ["BEGIN"]
    if raw.isolation_level is not None:
        parts.append(f"ISOLATION LEVEL {raw.isolation_level.name.replace('_', ' ')}")
    if raw.read_only is not None:
        parts.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        parts.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


#: The server function that refuses a statement at the extended protocol's Parse (several
#: commands); a syntax error found in the text comes from the parser's, and one a function
#: raises while the statement runs (its EXECUTE) after the statement ran.
_PARSE_MESSAGE = "exec_parse_message"


def _refused_at_parse(exc: psycopg.Error) -> bool:
    """Tell whether PostgreSQL refused the statement at its Parse, before running any of it
    (the error's source function: not translated, unlike its message)."""
    return exc.diag.source_function == _PARSE_MESSAGE


def _begin_alone(raw: Any) -> None:
    """Send BEGIN in a round trip of its own (psycopg's way) if one is owed."""
    if _owes_begin(raw):
        psycopg.ClientCursor(raw).execute(begin_statement(raw))


class _BeginsWithFirstStatement:
    """Cursor methods that open Django's transaction with the statement they send."""

    connection: Any

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        raw = self.connection
        if not _owes_begin(raw):
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        if not params:
            # Without parameters psycopg sends the text as a simple query, which may hold
            # several commands (a migration's RunSQL); a pipeline allows one.
            _begin_alone(raw)
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        # One round trip: the BEGIN and the statement, answered at the pipeline's sync
        # (the statement's rows are on this cursor after it; its error is raised here).
        try:
            with raw.pipeline():
                psycopg.ClientCursor(raw).execute(begin_statement(raw))
                super().execute(query, params, **kwargs)  # type: ignore[misc]
        except psycopg.errors.SyntaxError as exc:
            if not (isinstance(self, psycopg.ClientCursor) and _refused_at_parse(exc)):
                raise
            # Several commands ("cannot insert multiple commands into a prepared
            # statement", in the server's language): Django's client-side cursor sends
            # them as one simple query, which the pipeline's extended protocol refuses at
            # its Parse, before anything of it runs: nothing ran but the BEGIN. Roll it
            # back, and send the BEGIN alone and the statement as Django's own backend
            # does (the transaction starts at the same statement).
            raw.rollback()
            _begin_alone(raw)
            return super().execute(query, params, **kwargs)  # type: ignore[misc]
        except psycopg.OperationalError as exc:
            interrupted = exc.__context__
            if raw.pgconn.pipeline_status == pq.PipelineStatus.OFF or interrupted is None:
                raise
            # Interrupted while the answer was on its way (a signal: the job's timeout):
            # psycopg cannot leave pipeline mode and says so instead. The connection is
            # unusable: close it (the server rolls the transaction back) and raise what
            # interrupted, as it would have been raised outside a pipeline.
            raw.close()
            raise interrupted from None
        return self

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> Any:
        _begin_alone(self.connection)
        return super().executemany(query, params_seq, **kwargs)  # type: ignore[misc]

    def copy(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        _begin_alone(self.connection)
        return super().copy(statement, *args, **kwargs)  # type: ignore[misc]

    def stream(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        _begin_alone(self.connection)
        return super().stream(query, params, **kwargs)  # type: ignore[misc]


class Cursor(_BeginsWithFirstStatement, base.Cursor):
    """Django's client-side binding cursor (its default)."""


class ServerBindingCursor(_BeginsWithFirstStatement, base.ServerBindingCursor):
    """Django's server-side binding cursor (OPTIONS `server_side_binding`)."""


#: psycopg's optimised text loader of timestamptz (C, from its binary or C build); None
#: where only the pure-Python one is installed: Django's loader is then used as it is.
_OPTIMISED_TZ_LOADER = psycopg.adapters.get_loader(base.TIMESTAMPTZ_OID, Format.TEXT)
if _OPTIMISED_TZ_LOADER is None or issubclass(_OPTIMISED_TZ_LOADER, TimestamptzLoader):
    _OPTIMISED_TZ_LOADER = None


class TzLoader(BaseTzLoader):
    """Django's timestamptz loader (the value with tzinfo set to Django's time zone, or
    none), parsed by psycopg's optimised loader instead of the Python one it derives from."""

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        assert _OPTIMISED_TZ_LOADER is not None  # registered only then (adapters_template)
        self._parse = _OPTIMISED_TZ_LOADER(oid, context).load

    def load(self, data: Any) -> Any:
        return self._parse(data).replace(tzinfo=self.timezone)


@lru_cache
def adapters_template(use_tz: bool, timezone: Any) -> adapt.AdaptersMap:
    """Django's adapters for a new connection, with `TzLoader` for timestamptz."""
    if _OPTIMISED_TZ_LOADER is None:
        return get_adapters_template(use_tz, timezone)
    context = adapt.AdaptersMap(get_adapters_template(use_tz, timezone))
    loader = type("SpecificTzLoader", (TzLoader,), {"timezone": timezone, "__module__": __name__})
    context.register_loader("timestamptz", loader)
    return context


class DatabaseWrapper(base.DatabaseWrapper):
    """PostgreSQL, a transaction's BEGIN in the round trip of its first statement."""

    def get_connection_params(self) -> dict[str, Any]:
        params = super().get_connection_params()
        server_side = params["cursor_factory"] is base.ServerBindingCursor
        params["cursor_factory"] = ServerBindingCursor if server_side else Cursor
        if "context" in params:
            params["context"] = adapters_template(settings.USE_TZ, self.timezone)
        return params

    def _set_autocommit(self, autocommit: bool) -> None:
        raw = self.connection
        with self.wrap_database_errors:
            if not raw.autocommit:  # a new connection: psycopg opens it with autocommit off
                raw.autocommit = True
            status = raw.pgconn.transaction_status
            if autocommit and status != pq.TransactionStatus.IDLE:
                # What psycopg refuses when its own autocommit is set with a transaction
                # open (a COMMIT interrupted on its way, a manual transaction not ended):
                # later "autocommit" statements would run inside it, never committed.
                raise psycopg.ProgrammingError(
                    "can't change 'autocommit' now: connection in transaction status "
                    f"{pq.TransactionStatus(status).name}"
                )
        setattr(raw, _TRANSACTION_WANTED, not autocommit)

    def begin_owed(self) -> bool:
        """Tell whether Django's transaction is open and PostgreSQL's not yet: the next
        statement must carry BEGIN (in a pipeline of its own, or in front of the caller's)."""
        return self.connection is not None and _owes_begin(self.connection)

    def begin_statement(self) -> str:
        """The BEGIN to queue in front of a pipeline when `begin_owed()`."""
        return begin_statement(self.connection)

    def create_cursor(self, name: str | None = None) -> Any:
        if not name:
            return super().create_cursor()
        # A server-side cursor's DECLARE runs in the transaction (sent after a BEGIN of
        # its own), and is holdable only outside one: Django's backend reads that from
        # psycopg's autocommit, always on here, so this is its code with Django's.
        raw = self.connection
        _begin_alone(raw)
        withhold = self.get_autocommit()
        if self.settings_dict["OPTIONS"].get("server_side_binding") is not True:
            # django-stubs type Django's psycopg 2 classes here.
            server_side: Any = base.ServerSideCursor
            cursor = server_side(raw, name=name, scrollable=False, withhold=withhold)
        else:
            cursor = raw.cursor(name, scrollable=False, withhold=withhold)
        tzloader = raw.adapters.get_loader(base.TIMESTAMPTZ_OID, Format.TEXT)
        if self.timezone != tzloader.timezone:
            register_tzloader(self.timezone, cursor)
        return cursor
