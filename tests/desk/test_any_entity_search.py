"""The operations search finds any declared entity's operations, not only orders (issue 40).

A bare number is the key of every entity model the handlers declare with an
integer key; an e-mail, the rows of every entity model with an e-mail field
(any case), of the models the operator may view. Driven through the admin's
operations list with a model of another domain, its table made in the test's
transaction (real PostgreSQL).
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib import admin as django_admin
from django.contrib.auth.models import User
from django.db import connection, models
from django.db.models.functions import Lower
from django.test import RequestFactory

from payments.admin import OperationAdmin
from payments.desk.lists import email_fields, operations_search_note, search_operations
from payments.engine import handlers
from payments.engine.writes import fence_writes
from payments.models import Operation
from payments.shop.models import Order
from tests.support.history import FENCE_TABLES, planner_sees_larger, write_history
from tests.support.plans import history_read_by, statements_sent
from tests.support.users import VIEW, make_user

pytestmark = pytest.mark.django_db


class Member(models.Model):  # noqa: DJ008
    """A club's member: another domain's entity, with an e-mail and an integer key; its
    e-mail indexed by LOWER() (searched), its backup e-mail not (never searched: a scan)."""

    email = models.EmailField()
    backup_email = models.EmailField(blank=True)

    class Meta:
        app_label = "payments"  # an installed app's label: no app of its own in the test
        db_table = "test_desk_member"
        managed = False
        indexes = [models.Index(Lower("email"), name="test_desk_member_email_lower")]


@pytest.fixture
def members(monkeypatch):
    """The Member table (rolled back with the test) and a handler declaring it its entity."""
    with connection.schema_editor() as editor:
        editor.create_model(Member)
    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    handlers.handler("join-club", entity=Member)(lambda run: None)
    return Member


def operation(kind: str, entity_type: str, entity_id: object, key: str) -> Operation:
    with fence_writes():  # hand-made state: the search reads operations only
        return Operation.objects.create(
            key=key,
            kind=kind,
            entity_type=entity_type,
            entity_id=str(entity_id),
            params={},
            fingerprint="x",
        )


def keys(found) -> set[str]:
    return set(found.values_list("key", flat=True)) if found is not None else set()


def test_search__an_email_finds_a_members_operations_for_who_may_view_members(members):
    kim = members.objects.create(email="Kim@Example.com")
    other = members.objects.create(email="lee@example.com")
    operation("join-club", "member", kim.pk, "kim-joins")
    operation("join-club", "member", other.pk, "lee-joins")
    everyone = Operation.objects.all()

    found = search_operations(everyone, " kim@EXAMPLE.com", may_view=lambda model: True)
    hidden = search_operations(everyone, "kim@example.com", may_view=lambda m: m is not Member)

    assert keys(found) == {"kim-joins"}
    assert keys(hidden) == set()


def test_search__an_email_field_without_an_index_on_lower__is_not_searched(members):
    ann = members.objects.create(email="ann@example.com", backup_email="old@example.com")
    operation("join-club", "member", ann.pk, "ann-joins")

    found = search_operations(Operation.objects.all(), "old@example.com", may_view=lambda m: True)

    assert email_fields(Member) == ["email"]
    assert keys(found) == set()


def test_search__a_number_is_any_integer_keyed_entitys_key(members):
    member = members.objects.create(email="m@example.com")
    order = Order.objects.create(  # the same key as the member's: a number names both
        pk=member.pk, amount=100, currency="eur", customer_email="o@example.com"
    )
    operation("join-club", "member", member.pk, "member-op")
    operation("checkout", "order", order.pk, "order-op")
    operation("checkout", "order", member.pk + 1, "another-order")
    operation("join-club", "member", member.pk + 1, "another-member")

    found = search_operations(Operation.objects.all(), str(member.pk), may_view=lambda m: True)

    assert keys(found) == {"member-op", "order-op"}
    note = operations_search_note(str(member.pk), "/admin/payments/operation/")
    assert f"Operations of member or order {member.pk}." in note


def test_operations_list__searching_a_members_email_lists_its_operations(members):
    """The admin's operations list (OperationAdmin.get_search_results): a user who may view
    members finds them by e-mail; one who may not finds nothing."""
    kim = members.objects.create(email="kim@example.com")
    operation("join-club", "member", kim.pk, "kim-joins")
    model_admin = OperationAdmin(Operation, django_admin.site)
    request = RequestFactory().get("/admin/payments/operation/", {"q": "kim@example.com"})
    request.user = make_user("viewer", *VIEW)
    found, _ = model_admin.get_search_results(request, Operation.objects.all(), "kim@example.com")
    assert keys(found) == set()  # VIEW holds no payments.view_member
    request.user.is_superuser = True
    found, _ = model_admin.get_search_results(request, Operation.objects.all(), "kim@example.com")
    assert keys(found) == {"kim-joins"}


def test_search_help__in_the_words_of_the_declared_entities(members, monkeypatch):
    """The box's help names the entities the handlers declare: the shop's order and the
    member beside it; with the member's handler alone (a project without the shop), no
    order."""
    shop_and_club = django_admin.site._registry[Operation].search_help_text
    monkeypatch.setattr(handlers, "_HANDLERS", {"join-club": handlers._HANDLERS["join-club"]})
    club_only = django_admin.site._registry[Operation].search_help_text

    assert shop_and_club.startswith("Member or order id (17), operation id (#17)")
    assert club_only.startswith("Member id (17), operation id (#17)")
    assert club_only.endswith("or an e-mail (exact).") and "order" not in club_only


class GearRental(models.Model):  # noqa: DJ008
    """An equipment rental keyed by its own text code (found by a newcomer: the search
    took only integer keys, so "RNT-2026-0001" found nothing)."""

    code = models.CharField(max_length=20, primary_key=True)

    class Meta:
        app_label = "payments"
        db_table = "test_desk_rental"
        managed = False


class GymLocker(models.Model):  # noqa: DJ008
    """A locker keyed by a UUID."""

    id = models.UUIDField(primary_key=True)

    class Meta:
        app_label = "payments"
        db_table = "test_desk_locker"
        managed = False


@pytest.fixture
def rentals_and_lockers(monkeypatch):
    with connection.schema_editor() as editor:
        editor.create_model(GearRental)
        editor.create_model(GymLocker)
    monkeypatch.setattr(handlers, "_HANDLERS", dict(handlers._HANDLERS))
    handlers.handler("rent", entity=GearRental)(lambda run: None)
    handlers.handler("book-locker", entity=GymLocker)(lambda run: None)


def admin_search(term: str) -> set[str]:
    """What the admin's operations list finds for `term` (OperationAdmin.get_search_results),
    searched by a superuser (who may view every entity)."""
    model_admin = OperationAdmin(Operation, django_admin.site)
    request = RequestFactory().get("/admin/payments/operation/", {"q": term})
    request.user = User(username="root", is_superuser=True, is_staff=True, is_active=True)
    found, _ = model_admin.get_search_results(request, Operation.objects.all(), term)
    return keys(found)


def test_operations_list__a_text_key_finds_its_entitys_operations(rentals_and_lockers):
    operation("rent", "gearrental", "RNT-2026-0001", "rent-1")
    operation("rent", "gearrental", "RNT-2026-0002", "rent-2")
    operation("rent", "gearrental", "0042", "rent-digits")  # a text key of digits only

    assert admin_search(" RNT-2026-0001 ") == {"rent-1"}
    assert admin_search("rnt-2026-0001") == set()  # a text key is exact, case included
    assert admin_search("0042") == {"rent-digits"}
    assert admin_search("rent-2") == {"rent-2"}  # the operation's own key still finds it


@pytest.mark.parametrize(
    "code",
    [
        "RNT2026000000001",  # Adyen's pspReference shape (16 capitals and digits)
        "re_2026_0001",  # a Stripe-like reference
        "desk@counter-4",  # an e-mail's @
        "op 17",  # an operation id's shape
    ],
)
def test_operations_list__a_text_key_of_another_terms_shape__still_finds_its_entity(
    rentals_and_lockers, code
):
    """A key shaped like a reference, an e-mail or an operation id is searched as that
    shape and as an entity's key: a reviewer found these keys never found (and a
    reference-shaped one sent to the provider for nothing)."""
    operation("rent", "gearrental", code, "rent-odd")

    assert "rent-odd" in admin_search(code)


def test_operations_list__a_uuid_finds_its_entitys_operations_however_written(
    rentals_and_lockers,
):
    locker = uuid.UUID("5f0c6a8e-3b1d-4c5e-9a7f-0123456789ab")
    operation("book-locker", "gymlocker", str(locker), "locker-op")
    operation("book-locker", "gymlocker", locker.hex.upper(), "kept-as-upper-hex")
    operation("book-locker", "gymlocker", "00000000-0000-0000-0000-000000000001", "other")

    for written in (str(locker), str(locker).upper(), locker.hex, f"{{{locker}}}"):
        assert admin_search(written) == {"locker-op", "kept-as-upper-hex"}, written


def test_operations_list__a_key_search__by_a_viewer_of_operations_only(rentals_and_lockers):
    """The key is the operation's own column: a user who may view operations (and not
    rentals) finds them by it, as by an integer key."""
    operation("rent", "gearrental", "RNT-7", "rent-7")
    model_admin = OperationAdmin(Operation, django_admin.site)
    request = RequestFactory().get("/admin/payments/operation/", {"q": "RNT-7"})
    request.user = make_user("viewer", *VIEW)

    found, _ = model_admin.get_search_results(request, Operation.objects.all(), "RNT-7")

    assert keys(found) == {"rent-7"}


def test_search_note__digits_matching_a_text_key__not_called_another_entitys(
    rentals_and_lockers,
):
    """Digits list a text key of digits too: the note does not call the operation with
    that id "not one of them" when it is (a reviewer saw it say so)."""
    op = operation("rent", "gearrental", "placeholder", "rent-own-id")
    with fence_writes():  # its entity's key is its own id
        Operation.objects.filter(pk=op.pk).update(entity_id=str(op.pk))

    note = operations_search_note(str(op.pk), "/admin/payments/operation/")

    assert "is not one of them" not in note
    assert "gear rental" in note


def test_search_help__names_text_and_uuid_keyed_entities(rentals_and_lockers, monkeypatch):
    monkeypatch.setattr(
        handlers, "_HANDLERS", {k: handlers._HANDLERS[k] for k in ("rent", "book-locker")}
    )
    text = django_admin.site._registry[Operation].search_help_text

    assert text.startswith(
        "Gear rental key (exact), gym locker UUID (any form), operation id (#17)"
    )


def test_a_text_key_search__reads_the_entity_index_not_the_history(rentals_and_lockers):
    """The list's statements for a rental's key, beside 3,000 operations the planner sees
    a thousand times larger: none scans the operations or their claims (a reviewer
    measured the key search ORed into the fallback's scan: seconds at 1M operations)."""
    write_history(3000, open_every=500, failed_every=50)
    operation("rent", "gearrental", "RNT-2026-0001", "rent-1")
    model_admin = OperationAdmin(Operation, django_admin.site)
    request = RequestFactory().get("/admin/payments/operation/", {"q": "RNT-2026-0001"})
    request.user = User(username="root", is_superuser=True, is_staff=True, is_active=True)

    def search() -> None:
        found, _ = model_admin.get_search_results(request, Operation.objects.all(), "RNT-2026-0001")
        assert keys(found) == {"rent-1"}

    with planner_sees_larger(FENCE_TABLES):
        assert history_read_by(statements_sent(search), bound=50) == []
