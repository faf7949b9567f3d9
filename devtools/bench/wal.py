"""Where a batch's write-ahead log goes: bytes by table and index, read with pg_waldump.

PostgreSQL's WAL is what a primary ships to its replicas, archives and backs up.
`wal_by_relation(start, end)` reads the records between two positions with
`pg_waldump` (run as the database's own OS user would: it reads the server's
`pg_wal` directory, so this runs on the database's host) and adds up each
record's total length (its data, its block references and any full-page image)
under the relation of its first block, named through pg_class. Only this
database's relations are counted (the log is the whole cluster's: another
database's writes meanwhile are left out); records without a block (commits,
running transactions) cannot be told apart by database and are counted under
their resource manager (`Transaction`, `Standby`...), whoever wrote them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.db import connection

#: One pg_waldump line: its resource manager, total length, and its first block's relation.
RECORD = re.compile(
    r"rmgr: (?P<rmgr>\S+)\s+len \(rec/tot\):\s*\d+/\s*(?P<total>\d+),.*?"
    r"(?:blkref #0: rel (?P<spc>\d+)/(?P<db>\d+)/(?P<node>\d+)(?: fork (?P<fork>\w+))?"
    r" blk \d+(?P<fpw> FPW)?)?$"
)


@dataclass(frozen=True)
class WalShare:
    """Bytes of WAL, records and full-page images under one relation (or resource manager)."""

    name: str
    bytes: int
    records: int
    full_pages: int


@contextmanager
def reserved_wal() -> Iterator[None]:
    """Keep every WAL segment written meanwhile until it is read: a temporary physical
    replication slot (a checkpoint would otherwise recycle a long batch's first segments)."""
    name = f"fence_bench_wal_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", [name])
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_drop_replication_slot(%s)", [name])


def pg_waldump() -> str:
    """The path of pg_waldump (Debian keeps it under /usr/lib/postgresql/<major>/bin)."""
    found = shutil.which("pg_waldump")
    if found:
        return found
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version_num")
        major = int(cursor.fetchone()[0]) // 10000
    path = Path(f"/usr/lib/postgresql/{major}/bin/pg_waldump")
    if not path.exists():
        raise FileNotFoundError("pg_waldump is not installed (Debian: postgresql-<major>)")
    return str(path)


def wal_by_relation(start: str, end: str) -> list[WalShare]:
    """The WAL between positions `start` and `end`, by relation, the largest first."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW data_directory")
        wal_dir = Path(cursor.fetchone()[0]) / "pg_wal"
        cursor.execute("SELECT oid FROM pg_database WHERE datname = current_database()")
        database = str(cursor.fetchone()[0])
    done = subprocess.run(
        [pg_waldump(), "-p", str(wal_dir), "-s", start, "-e", end],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 and not done.stdout:
        raise RuntimeError(f"pg_waldump failed: {done.stderr.strip()[:500]}")
    size: Counter[str] = Counter()
    records: Counter[str] = Counter()
    pages: Counter[str] = Counter()
    nodes: dict[str, int] = {}
    for line in done.stdout.splitlines():
        found = RECORD.search(line)
        if found is None:
            continue
        if found["node"] and found["db"] not in (database, "0"):
            continue  # another database's
        if found["node"]:
            key = f"node:{found['node']}" + (f":{found['fork']}" if found["fork"] else "")
            nodes[key] = int(found["node"])
        else:
            key = found["rmgr"]
        size[key] += int(found["total"])
        records[key] += 1
        pages[key] += 1 if found["fpw"] else 0
    names = _relation_names(set(nodes.values()))
    shares = []
    for key, total in size.items():
        name = key
        if key in nodes:
            name = names.get(nodes[key], f"relfilenode {nodes[key]}")
            if key.count(":") == 2:
                name += f" ({key.rsplit(':', 1)[1]})"
        shares.append(WalShare(name, total, records[key], pages[key]))
    return sorted(shares, key=lambda s: -s.bytes)


def _relation_names(nodes: set[int]) -> dict[int, str]:
    """Relation names by file node (tables, indexes, TOAST), in this database."""
    if not nodes:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_relation_filenode(c.oid), c.relname FROM pg_class c "
            "WHERE pg_relation_filenode(c.oid) = ANY(%s)",
            [list(nodes)],
        )
        return {int(node): name for node, name in cursor.fetchall()}
