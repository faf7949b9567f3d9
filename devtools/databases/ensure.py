"""Create the PostgreSQL database named in DATABASE_URL if it does not exist."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TypedDict

import environ
import psycopg
from psycopg import sql

BASE_DIR = Path(__file__).resolve().parents[2]


class ConnInfo(TypedDict):
    """The maintenance database's connection parameters (psycopg's keyword names)."""

    host: str
    port: int | str
    user: str
    password: str | None
    dbname: str


def main() -> int:
    environ.Env.read_env(BASE_DIR / ".env")
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/fence")
    cfg = environ.Env.db_url_config(url)
    name = cfg["NAME"]
    conninfo: ConnInfo = {
        "host": cfg.get("HOST") or "127.0.0.1",
        "port": cfg.get("PORT") or 5432,
        "user": cfg.get("USER") or "postgres",
        "password": cfg.get("PASSWORD") or None,
        "dbname": "postgres",
    }
    try:
        with psycopg.connect(autocommit=True, **conninfo) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                print(f"created database {name}")
    except psycopg.OperationalError as exc:
        print(
            f"cannot reach PostgreSQL at {conninfo['host']}:{conninfo['port']}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
