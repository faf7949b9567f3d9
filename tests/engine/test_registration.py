"""Registration that cannot be forgotten: each way a new handler went unseen is refused.

Each test tries one forgotten step: a handler outside an installed app's
`handler.py` (a throwaway app in tmp_path, on sys.path), a business package
left out of INSTALLED_APPS, a step missing from `steps=`, a package missing
from the import-linter contracts.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from payments.engine import handlers
from payments.exceptions import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]

HANDLER = """
from payments.fence import Run, operation

@operation("{kind}", steps={{"work": None}})
def handle(run: Run) -> None:
    run.local("work", lambda: None)
"""


def test_a_late_handler_under_payments__is_refused(settings):
    def late(run):  # declared, say, in payments/captures/flow.py, imported by a URL conf
        pass

    late.__module__ = "payments.captures.flow"
    with pytest.raises(ConfigurationError, match="start-up discovery did not import"):
        handlers.handler("late-kind")(late)
    assert "late-kind" not in handlers.registered_handlers()


def test_a_business_package_not_installed__its_handler_refused_naming_the_setting(settings):
    """A new package under payments (payments/gift_cards/handler.py) that is not in
    INSTALLED_APPS is not discovered: importing it later (an API view) is refused,
    and the message names what to add."""

    def late(run):
        pass

    late.__module__ = "payments.gift_cards.handler"
    with pytest.raises(ConfigurationError, match="add 'payments.gift_cards' to INSTALLED_APPS"):
        handlers.handler("gift-card-kind")(late)


def business_packages() -> list[str]:
    """Every subpackage of payments that declares handlers (has a handler.py)."""
    return sorted(
        f"payments.{path.parent.name}"
        for path in (ROOT / "payments").glob("*/handler.py")
        if (path.parent / "__init__.py").exists()
    )


def contracts() -> dict[str, dict]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in data["tool"]["importlinter"]["contracts"]}


def missing_from_contracts(packages: list[str], found: dict[str, dict]) -> list[str]:
    """Name each (package, contract) pair where a business package is not checked."""
    lists = {
        "Handler packages reach the engine only through its public API, payments.fence": (
            "source_modules"
        ),
        "One business package knows nothing of another": "modules",
        "Business (checkout, refunds, webhooks) is not operator tooling": "source_modules",
        "The desk knows no business: it asks the handlers' declarations": "forbidden_modules",
        "The engine knows no business, desk, tooling or observability": "forbidden_modules",
    }
    missing = []
    for name, field in lists.items():
        listed = set(found[name][field])
        missing += [f"{pkg} in {name!r}" for pkg in packages if pkg not in listed]
    layers = " ".join(found["No import cycles between the layers of the payments app"]["layers"])
    missing += [f"{pkg} in the layers" for pkg in packages if pkg.split(".")[1] not in layers]
    return missing


def test_every_business_package__is_an_installed_app(settings):
    """Each package of payments with a handler.py is in INSTALLED_APPS: discovered."""
    from django.apps import apps

    installed = {config.name for config in apps.get_app_configs()}
    assert [p for p in business_packages() if p not in installed] == []


def test_every_business_package__is_in_every_layer_contract():
    assert "payments.captures" in business_packages()
    assert missing_from_contracts(business_packages(), contracts()) == []


def test_a_package_missing_from_the_contracts__is_named():
    assert missing_from_contracts([*business_packages(), "payments.gift_cards"], contracts()) != []


@pytest.mark.django_db
def test_a_step_missing_from_steps__parks_the_operation_for_review(monkeypatch):
    from django.db import transaction

    from payments.engine import fence
    from payments.engine.runtime import execute
    from payments.fence import Run, operation

    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))

    @operation("undeclared-step", steps={"declared": None})
    def handle(run: Run) -> None:
        run.local("undeclared", lambda: None)

    with transaction.atomic():
        op, _ = fence.create_operation_in_tx(
            key="undeclared-1",
            kind="undeclared-step",
            entity_type="customer",
            entity_id=7,
            params={},
            actor="test",
        )
    assert execute(op.pk, worker_id="w-1") == "needs_review"
    op.refresh_from_db()
    assert "does not declare" in op.last_error
    assert not op.claims.exists()


@pytest.fixture
def project_app(tmp_path, monkeypatch):
    """An app of the project's own (`bookings_<n>`, beside payments in INSTALLED_APPS)."""
    name = f"bookings_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    monkeypatch.setattr(handlers, "_DISCOVERED", set(handlers._DISCOVERED))

    def add(path: str, text: str) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))

    yield name, add
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


def test_an_installed_apps_handler_module__is_discovered_at_start_up(project_app, settings):
    """PaymentsConfig.ready(), run again by the new INSTALLED_APPS: an app of the
    project has its handlers in `<app>/handler.py`; a module in HANDLER_MODULES too."""
    name, add = project_app
    add("handler.py", HANDLER.format(kind=f"{name}-deposit"))
    add("more/__init__.py", "")
    add("more/fenced.py", HANDLER.format(kind=f"{name}-refund"))
    settings.PAYMENTS = {**settings.PAYMENTS, "HANDLER_MODULES": [f"{name}.more.fenced"]}
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, name]  # runs every app's ready()

    assert {f"{name}-deposit", f"{name}-refund"} <= set(handlers.registered_handlers())
    found = handlers.discover_app_handlers([f"{name}.more.fenced"])
    assert found[-2:] == [f"{name}.handler", f"{name}.more.fenced"]
    assert "payments.checkout.handler" in found  # the shop's examples: installed apps too


def test_an_installed_apps_late_handler__is_refused(project_app, settings):
    """A handler under an installed app in a module discovery did not import (its
    views, say) is refused: workers, which import no views, would not know it."""
    name, add = project_app
    add("views.py", HANDLER.format(kind=f"{name}-late"))
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, name]  # runs every app's ready()

    with pytest.raises(ConfigurationError, match=rf"declare it in .*{name}\.handler,"):
        importlib.import_module(f"{name}.views")
    assert f"{name}-late" not in handlers.registered_handlers()


def test_a_handler_module_that_cannot_be_imported__stops_start_up(project_app, settings):
    name, _ = project_app
    with pytest.raises(ImportError, match=f"{name}.missing"):
        handlers.discover_app_handlers([f"{name}.missing"])


@pytest.mark.parametrize("bad", ["bookings.fenced", ["bookings fenced"], [3]])
def test_handler_modules_setting__a_bad_value_is_refused(bad):
    from django.core.exceptions import ImproperlyConfigured

    from payments.conf import _read

    with pytest.raises(ImproperlyConfigured, match="HANDLER_MODULES"):
        _read({"HANDLER_MODULES": bad})


def test_handler_modules__read_alone_when_another_payments_key_is_bad(settings):
    """A bad PAYMENTS key is E009's to report, but the handler modules are still read (and
    a bad one of them refused) at start-up: gunicorn runs no checks."""
    from django.core.exceptions import ImproperlyConfigured

    from payments.conf import handler_modules_alone

    settings.PAYMENTS = {"MAX_ATTEMPTS": 0, "HANDLER_MODULES": ["tests.kit.unfenced"]}
    assert handler_modules_alone() == ("tests.kit.unfenced",)
    settings.PAYMENTS = {"MAX_ATTEMPTS": 0, "HANDLER_MODULES": "tests.kit.unfenced"}
    with pytest.raises(ImproperlyConfigured, match="HANDLER_MODULES"):
        handler_modules_alone()
