"""`manage.py bench_peer_worker`: a DBOS worker process of the bench's peer (devtools.bench.peer)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from devtools.bench.peer import run_worker


class Command(BaseCommand):
    help = "Run the DBOS twin of the checkout (devtools.bench.peer) until killed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--executor", required=True, help="This process's DBOS executor id.")

    def handle(self, *args: Any, **options: Any) -> None:
        run_worker(options["executor"])
