"""Create an API client (if it does not exist) and a new key of it; print the key last."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from payments.api.keys import KeyRefused, issue_key


class Command(BaseCommand):
    help = (
        "Create the API client NAME if it does not exist, and a new key of it. The key is "
        "shown once: it is the last line of the output, alone, so a script can read it "
        "(`... | tail -n 1`). Run again to add a key (rotation), then revoke the old one "
        "with revoke_api_key."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The client's name (unique), e.g. shop-eu.")
        parser.add_argument(
            "--key-name", default="", help='A label for the key (default: "<NAME> key").'
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            issued = issue_key(options["name"], key_name=options["key_name"])
        except KeyRefused as exc:
            raise CommandError(str(exc)) from exc
        client = issued.client
        what = "Created client" if issued.client_created else "Client already exists:"
        self.stdout.write(self.style.SUCCESS(f"{what} {client.name} (id {client.pk})."))
        self.stdout.write(
            f"New key {issued.row.prefix} ({issued.row.name}); it is shown once, below. "
            f"Revoke it with: manage.py revoke_api_key {issued.row.prefix}"
        )
        self.stdout.write(issued.key)
