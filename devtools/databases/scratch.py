"""The only way devtools empties a Redis database: one it marked as its own when it was empty.

The chaos run flushes the queue's Redis mid-run and the bench empties it
between batches. Pointed by mistake at a production Redis, either would drop
every queued payment job. So a tool first *claims* the database: an empty one
gets a marker key; one that holds keys without the marker is refused. A flush
happens only where the marker is, and puts it back.
"""

from __future__ import annotations

from django.core.management.base import CommandError
from redis import Redis

MARKER = "devtools:scratch"


class NotScratch(CommandError):
    """The Redis database holds data that devtools did not create; nothing was flushed."""


def _where(client: Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


def claim_scratch(client: Redis, tool: str) -> None:
    """Make the database this tool's scratch space, or refuse if it holds anyone else's keys."""
    if client.exists(MARKER):
        return
    if client.set(MARKER, tool, nx=True) and client.dbsize() == 1:
        return
    client.delete(MARKER)
    raise NotScratch(
        f"Redis database {_where(client)} holds {client.dbsize()} keys that devtools did not "
        f"create; {tool} flushes its Redis and refuses to touch this one. Point REDIS_URL at "
        "an empty database (make demo and make bench choose their own)."
    )


def flush_scratch(client: Redis, tool: str) -> None:
    """Empty a database this tool claimed; refuse any other."""
    if not client.exists(MARKER):
        raise NotScratch(
            f"Redis database {_where(client)} is not a devtools scratch database; not flushed."
        )
    client.flushdb()
    client.set(MARKER, tool)
