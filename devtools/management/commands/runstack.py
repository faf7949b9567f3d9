"""Run the whole stack for a person to try: API + admin, workers, fake provider, recovery."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import threading
from pathlib import Path
from typing import TypedDict, Unpack

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management.base import BaseCommand, CommandError, CommandParser

from devtools.topology.stack import Stack

#: The order the printed curl creates (an order is the first call a shop makes).
TRY_ORDER = '{"amount": 1999, "currency": "eur", "email": "a@example.com"}'


def try_command(base: str, token: str) -> str:
    """Return the curl that creates an order on the stack's API at `base`, to run as printed.

    The body is JSON and says so: curl's `-d` alone sends a form's content type.
    """
    return shlex.join(
        [
            "curl", "-s",
            "-H", f"Authorization: Bearer {token}",
            "-H", "Content-Type: application/json",
            "-d", TRY_ORDER,
            f"{base}/api/orders",
        ]
    )  # fmt: skip


class RunstackOptions(TypedDict):
    """The options add_arguments declares, with the types their parsers give."""

    port: int
    provider_port: int
    workers: int


#: docs/operators.md, "Permissions": what an operator holds, and what a senior adds.
OPERATOR_PERMISSIONS = ("view_operation", "view_order", "view_invoice", "reconcile_operation")
SENIOR_PERMISSIONS = (*OPERATOR_PERMISSIONS, "start_new_attempt", "refund_order", "manage_queues")
DEMO_USERS = {"operator": OPERATOR_PERMISSIONS, "senior": SENIOR_PERMISSIONS}


class Command(BaseCommand):
    help = (
        "Start the API and admin server, RQ workers (one process per queue, with the "
        "scheduler), the fake provider and the recovery loop; print the URLs and the API "
        "token; stop everything on Ctrl-C. For development (DEBUG) only."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        # make run passes RUN_PORT and PROVIDER_PORT from the environment (Makefile).
        parser.add_argument("--port", type=int, default=8000, help="API and admin port.")
        parser.add_argument(
            "--provider-port", type=int, default=8765, help="The fake provider's port."
        )
        parser.add_argument("--workers", type=int, default=2)

    def handle(self, *args: object, **options: Unpack[RunstackOptions]) -> None:
        if not settings.DEBUG:
            raise CommandError("runstack is a development tool; set DEBUG=1.")
        if options["workers"] < 1:
            raise CommandError("--workers must be at least 1.")
        provider_url = f"http://127.0.0.1:{options['provider_port']}"
        env = {**os.environ, "PAYMENT_PROVIDER_URL": provider_url}
        stack = Stack(env=env, log_dir=Path(settings.BASE_DIR) / "var" / "log" / "run")
        passwords = self._demo_users()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            stack.start_provider(options["provider_port"])
            stack.start_api(options["port"])
            for _ in range(options["workers"]):
                stack.start_worker()
            stack.start_recovery(interval=10)
            base = f"http://127.0.0.1:{options['port']}"
            self.stdout.write(self.style.SUCCESS("Running. Ctrl-C stops everything."))
            self.stdout.write(
                f"  API          {base}/api/  (Authorization: Bearer {settings.API_TOKEN})"
            )
            self.stdout.write(f"  Admin        {base}/admin/")
            for username, password in passwords.items():
                self.stdout.write(
                    f"    {username:<10} {password}  ({', '.join(DEMO_USERS[username])})"
                )
            self.stdout.write(f"  RQ dashboard {base}/admin/rq/")
            self.stdout.write(
                f"  Provider     {provider_url}  (control: {provider_url}/_fake/stats)"
            )
            self.stdout.write(f"  Logs         {stack.log_dir}")
            self.stdout.write(f"  Try: {try_command(base, settings.API_TOKEN)}")
            stop.wait()
        finally:
            stack.stop()

    def _demo_users(self) -> dict[str, str]:
        """Create the development operator and senior, once; {username: password} of new ones.

        `operator` holds exactly what docs/operators.md gives an operator, so that
        trying the desk meets its permission boundary; `senior` holds the rest.
        """
        user_model = get_user_model()
        created = {}
        for username, codenames in DEMO_USERS.items():
            if user_model.objects.filter(username=username).exists():
                continue
            password = secrets.token_urlsafe(9)
            user = user_model.objects.create_user(username, password=password, is_staff=True)
            user.user_permissions.set(
                Permission.objects.filter(
                    content_type__app_label__in=("payments", "shop"), codename__in=codenames
                )
            )
            created[username] = password
        return created
