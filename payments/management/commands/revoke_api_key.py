"""Revoke an API key by its visible prefix: every request with it is refused at once."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from payments.api.keys import KeyRefused, revoke_key
from payments.models import ClientApiKey


class Command(BaseCommand):
    help = (
        "Revoke the API key with the visible prefix PREFIX (the part before the dot, shown "
        "by create_api_client and in the admin). Requests with it get 401 from then on; "
        "it cannot be undone (issue a new key with create_api_client)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("prefix", help="The key's prefix, e.g. Ab12Cd34.")
        parser.add_argument(
            "--noinput",
            "--no-input",
            action="store_false",
            dest="interactive",
            help="Do not ask for confirmation.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        prefix = options["prefix"].strip()
        if options["interactive"]:
            row = ClientApiKey.objects.filter(prefix=prefix).select_related("client").first()
            if row is None:
                raise CommandError(f"No API key has the prefix {prefix!r}.")
            try:
                answer = input(
                    f"Revoke key {prefix} ({row.name}) of client {row.client.name}? [y/N] "
                )
            except EOFError:  # no terminal (stdin closed): no answer is no
                answer = ""
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("Aborted: nothing was revoked.")
        try:
            row, revoked = revoke_key(prefix)
        except KeyRefused as exc:
            raise CommandError(str(exc)) from exc
        if revoked:
            self.stdout.write(self.style.SUCCESS(f"Revoked key {prefix} of client {row.client}."))
        else:
            self.stdout.write(self.style.WARNING(f"Key {prefix} was already revoked."))
