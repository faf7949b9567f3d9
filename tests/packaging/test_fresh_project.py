"""docs/install.md, done: a project made by `django-admin startproject` installs the
wheel into a virtualenv of its own, adds an app whose model is keyed by a UUID,
fences an operation on it, and a FenceWorker runs it once.

Then docs/testing.md, done: the project's own pytest runs the kit's crash matrix on
that operation, and on a deposit held at an external system of the project's own
(tests/kit/deposits.py, copied in as `bookings/deposits.py`, declared and configured
as docs/handlers.md says) against the kit's FakeSystem: held once at every point.

Nothing of this repository is on the project's path but the wheel: the project
sees only what a `pip install` gives it. Its database is a new one, dropped after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from redis import Redis

from tests.conftest import TEST_REDIS_URL

SETTINGS = """
# The desk's admin site stands in for django.contrib.admin (docs/install.md, section 2).
INSTALLED_APPS = [
    "payments.apps.DeskAdminConfig" if app == "django.contrib.admin" else app
    for app in INSTALLED_APPS
]
RQ_SHOW_ADMIN_LINK = False
INSTALLED_APPS += ["django_rq", "rest_framework", "rest_framework_api_key", "inbox", "payments",
                   "bookings"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": "{database}",
                          "USER": "postgres", "HOST": "127.0.0.1", "PORT": 5432}}}}
RQ_QUEUES = {{"payments": {{"URL": "{redis}", "DEFAULT_TIMEOUT": 30}}}}
RQ = {{"QUEUE_CLASS": "inbox.queues.MessageQueue",
      "WORKER_CLASS": "payments.engine.worker.FenceWorker"}}
INBOX = {{"RETENTION": {{"default": 8 * 24 * 3600}}, "REDELIVERY_HORIZON": 7 * 24 * 3600}}
# The deposit service (bookings/deposits.py): its URL from the environment.
import os
PAYMENTS = {{
    "HANDLER_MODULES": ["bookings.deposits"],
    "SYSTEMS": {{"kit_deposits": {{"URL": os.environ.get("DEPOSITS_URL", "http://127.0.0.1:9"),
                                  "API_KEY": "test"}}}},
}}
"""

MODELS = """
import uuid

from django.db import models


class Booking(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4)
    guest = models.CharField(max_length=100)
    deposit = models.IntegerField()
    status = models.CharField(max_length=20, default="new")
"""

# docs/install.md's handler, with a file for the side effect to append to.
HANDLER = """
from pathlib import Path

from django.db import transaction

from payments.fence import DeliveryPolicy, Run, create_operation_in_tx, operation

from bookings.models import Booking

CONFIRM = "confirm_booking"


def send_mail_to(booking):
    with open(Path(__file__).parent / "sent.txt", "a") as sent:
        sent.write(f"{booking.guest}\\n")


@operation(CONFIRM, entity=Booking, steps={"notify": None, "mark_confirmed": None})
def confirm_booking(run: Run) -> None:
    run.side_effect("notify", lambda: send_mail_to(run.entity), policy=DeliveryPolicy.AT_MOST_ONCE)
    run.local(
        "mark_confirmed",
        lambda: Booking.objects.filter(pk=run.entity.pk).update(status="confirmed"),
    )


def request_confirmation(booking, key, hotel_id):
    with transaction.atomic():
        return create_operation_in_tx(
            key=key, kind=CONFIRM, entity_type="booking", entity_id=booking.pk,
            params={"deposit": booking.deposit}, actor="shop", tenant=f"hotel:{hotel_id}",
        )
"""

START = """
from bookings.handler import request_confirmation
from bookings.models import Booking

booking = Booking.objects.create(guest="Ada", deposit=5000)
request_confirmation(booking, "book-1", 1)
request_confirmation(booking, "book-1", 1)  # the same key again: the same operation
"""

REPORT = """
from bookings.models import Booking
from payments.models import Operation

op = Operation.objects.get(key="book-1")
steps = sorted((c.step, c.state) for c in op.claims.all())
print("REPORT", Operation.objects.count(), op.state, steps, Booking.objects.get().status)
"""


#: A deposit held at the project's own external system: the kit test's handler, whole.
DEPOSITS = (Path(__file__).resolve().parents[1] / "kit" / "deposits.py").read_text()

#: The project's test tools, as this repository pins them (requirements.txt).
TEST_TOOLS = [
    line.strip()
    for line in (Path(__file__).resolve().parents[2] / "requirements.txt").read_text().splitlines()
    if line.startswith(("pytest==", "pytest-django=="))
]

PYTEST_INI = """[pytest]
DJANGO_SETTINGS_MODULE = site_conf.settings
testpaths = crash_tests
"""

# The project's own test: payments.testing's crash matrix, as docs/testing.md shows it.
MATRIX = """
from pathlib import Path

import pytest

from bookings.handler import request_confirmation
from bookings.models import Booking
from payments.testing import crash_matrix

# Transactional: the matrix's worker processes must see the rows the test commits.
pytestmark = pytest.mark.django_db(transaction=True)

SENT = Path(__file__).resolve().parents[1] / "bookings" / "sent.txt"


def test_confirm_booking__once_whatever_the_crash():
    def start(key):
        return request_confirmation(Booking.objects.create(guest=key, deposit=100), key, 1)

    def sent(op):
        lines = SENT.read_text().splitlines() if SENT.exists() else []
        return {"notify": lines.count(Booking.objects.get(pk=op.entity_id).guest)}

    def confirmed(op):
        assert Booking.objects.get(pk=op.entity_id).status == "confirmed"

    table = crash_matrix(start, count=sent, check=confirmed)
    table.assert_held()
    assert sum(case.crashed for case in table.cases) == 4  # notify's 3 points, the final commit


def test_take_deposit__held_once_whatever_the_crash():
    from django.db import transaction

    from bookings.deposits import HOLD, TAKE_DEPOSIT
    from payments.fence import create_operation_in_tx
    from payments.testing import FakeSystem

    def start(key):
        with transaction.atomic():
            op, _ = create_operation_in_tx(
                key=key, kind=TAKE_DEPOSIT, entity_type="booking", entity_id=key,
                params={"amount": 5000}, actor="shop",
            )
        return op

    with FakeSystem() as deposits:
        def held(op):
            return {HOLD: len(deposits.objects(external_id=f"{op.key}@{op.pk}"))}

        # Killed after its claim's commit, the first case's redelivery then loses its answer.
        deposits.lose_answers(1)
        table = crash_matrix(start, count=held, env={"DEPOSITS_URL": deposits.url})
    table.assert_held()
    assert sum(case.crashed for case in table.cases) == 4  # the hold's 3 points, the final commit
"""


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture
def database():
    name = f"fresh_project_{uuid.uuid4().hex[:10]}"
    subprocess.run(["createdb", "-h", "127.0.0.1", "-U", "postgres", name], check=True)
    yield name
    subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", name], check=True)


#: docs/install.md's URLs, section 4.
URLS = """
from django.contrib import admin
from django.urls import include, path
from django_rq import urls as django_rq_urls

from payments.desk.rq_access import guarded_urlpatterns

urlpatterns = [
    path("admin/rq/", include((guarded_urlpatterns(django_rq_urls.urlpatterns), "django_rq"))),
    path("admin/", admin.site.urls),
]
"""

#: The admin's home page is the desk's, and django-rq's pages are not served to staff
#: without their permission (a staff user without any: 403 or a redirect to log in).
DESK = """
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import setup_test_environment
setup_test_environment()
root = User.objects.create_superuser("root", "root@example.com", "x")
staff = User.objects.create_user("staff", "staff@example.com", "x", is_staff=True)
client = Client()
client.force_login(root)
home = client.get("/admin/")
print("HOME", home.status_code, b"payments-desk-module" in home.content)
client.force_login(staff)
print("RQ FOR STAFF", client.get("/admin/rq/").status_code)
print("RQ ADMIN LINK", client.get("/admin/django_rq/dashboard/").status_code)
"""

#: What of the shop a project without it has: tables, admin pages, permissions (none).
NO_SHOP = """
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.db import connection
tables = set(connection.introspection.table_names())
print("TABLES", sorted(t for t in tables if t in ("payments_operation", "payments_stepclaim")))
shop = ["payments_order", "payments_invoice", "payments_creditnote", "payments_ledgerentry",
        "payments_salesday"]
print("SHOP TABLES", sorted(t for t in shop if t in tables))
pages = [m._meta.label for m in apps.get_models() if admin.site.is_registered(m)]
print("SHOP PAGES", sorted(p for p in pages if p.startswith("shop.")))
print("SHOP PERMISSIONS", Permission.objects.filter(codename__endswith="_order").count())
"""


def test_a_new_project_installs_the_wheel_and_fences_a_model_of_its_own(
    tmp_path, wheel_path, database
):
    redis_url = TEST_REDIS_URL
    Redis.from_url(redis_url).flushdb()
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH")}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", str(wheel_path)], tmp_path, env, timeout=600)
    project = tmp_path / "site"
    project.mkdir()
    run([str(venv / "bin" / "django-admin"), "startproject", "site_conf", "."], project, env)
    settings = project / "site_conf" / "settings.py"
    settings.write_text(settings.read_text() + SETTINGS.format(database=database, redis=redis_url))
    (project / "site_conf" / "urls.py").write_text(URLS)
    app = project / "bookings"
    (app / "migrations").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "migrations/__init__.py": "",
        "models.py": MODELS,
        "handler.py": HANDLER,
        "deposits.py": DEPOSITS,
    }.items():
        (app / name).write_text(textwrap.dedent(text))

    manage = [python, "manage.py"]
    run([*manage, "check", "--fail-level", "WARNING"], project, env)
    run([*manage, "makemigrations", "bookings", "-v", "0"], project, env)
    run([*manage, "migrate", "-v", "0"], project, env)
    # The shop is an example the project left out: none of its tables, pages or permissions.
    shop = run([*manage, "shell", "-c", NO_SHOP], project, env)
    assert "TABLES ['payments_operation', 'payments_stepclaim']" in shop, shop
    assert "SHOP TABLES []" in shop and "SHOP PAGES []" in shop, shop
    assert "SHOP PERMISSIONS 0" in shop, shop
    desk = run([*manage, "shell", "-c", DESK], project, env)
    assert "HOME 200 True" in desk, desk
    assert "RQ FOR STAFF 403" in desk and "RQ ADMIN LINK 404" in desk, desk
    run([*manage, "shell", "-c", START], project, env)
    run([*manage, "rqworker", "payments", "--burst"], project, env)
    report = run([*manage, "shell", "-c", REPORT], project, env)

    assert (
        "REPORT 1 succeeded [('mark_confirmed', 'done'), ('notify', 'done')] confirmed" in report
    ), report
    assert (app / "sent.txt").read_text() == "Ada\n"
    # The periodic commands of docs/commands.md, in a project that pays through no provider:
    # nothing read from one (its default URL answers nothing), each system it calls named.
    audit = run([*manage, "fence_audit", "--since", "1h"], project, env)
    assert "Not audited: the provider (provider): no registered handler calls it" in audit, audit
    assert "Not audited: " in audit.replace("the provider (provider)", ""), audit
    events = run([*manage, "sync_provider_events", "--since", "1h"], project, env)
    assert "No registered handler calls the provider" in events, events
    # docs/testing.md, done: the project's own crash matrix, run by its own pytest.
    run([python, "-m", "pip", "install", "-q", *TEST_TOOLS], tmp_path, env, timeout=600)
    (project / "pytest.ini").write_text(PYTEST_INI)
    (project / "crash_tests").mkdir()
    (project / "crash_tests" / "test_booking_crash.py").write_text(textwrap.dedent(MATRIX))
    matrix = run([python, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"], project, env)
    assert "2 passed" in matrix, matrix
    assert "crash matrix of confirm_booking: 7 points" in matrix, matrix
    assert "crash matrix of kit_take_deposit: 4 points" in matrix, matrix
    assert "after_provider_accept@notify" in matrix and "BROKE" not in matrix, matrix
    # Nothing of this repository was on the project's path: payments came from the wheel.
    where = run([python, "-c", "import payments; print(payments.__file__)"], project, env)
    assert "site-packages" in where
