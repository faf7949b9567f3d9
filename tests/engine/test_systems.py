"""External systems declared once: settings per system, checks, and the uncertainty clock.

Issue 38's trap "the replay window is the payment provider's key retention for
every system": a system that keeps keys for an hour must never see a replay
after it forgot the key (it would execute the request again).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from payments.checkout.charge import PaymentIntentCharge
from payments.checks import check_external_systems
from payments.conf import payments_settings
from payments.engine import fence, handlers, systems
from payments.engine.recovery import reconcile
from payments.engine.steps import replay_allowed, replay_deadline
from payments.exceptions import ConfigurationError
from payments.models import ClaimState, LookShowed, OperationState
from tests.support import builders
from tests.support.provider import successes

BOOKS = systems.declare(
    systems.ExternalSystem(
        name="books_test",
        label="the test bookkeeping system",
        key_retention=3600,
        reads=(systems.Read.LIST_BY_CREATED,),
        moves_money=False,
        reference_patterns=(r"bk_[0-9a-f]+",),
        object_noun="invoice",
    )
)
ENTRY = {"URL": "http://127.0.0.1:9", "API_KEY": "k", "KEY_RETENTION": 3600}


@pytest.mark.parametrize(
    ("systems_setting", "words"),
    [
        ({"books": {"URL": "http://x"}}, "API_KEY"),
        ({"books": {**ENTRY, "KEY": 1}}, "unknown keys KEY"),
        ({"provider": ENTRY}, "PROVIDER_"),
        ({"books": {**ENTRY, "KEY_RETENTION": 30}}, "KEY_RETENTION"),
        ({"not a name": ENTRY}, "identifier"),
        ({"books": {**ENTRY, "OPTIONS": []}}, "OPTIONS"),
    ],
)
def test_systems_setting__a_bad_entry__refused_with_its_name(settings, systems_setting, words):
    settings.PAYMENTS = {**settings.PAYMENTS, "SYSTEMS": systems_setting}

    with pytest.raises(ImproperlyConfigured, match=words):
        payments_settings()


def test_systems_setting__an_entry_read__its_retention_and_options(settings):
    settings.PAYMENTS = {
        **settings.PAYMENTS,
        "SYSTEMS": {"books_test": {**ENTRY, "OPTIONS": {"LEDGER": "eu"}}},
    }

    conf = payments_settings()

    assert conf.key_retention_of("books_test") == 3600
    assert conf.system("books_test").option("LEDGER") == "eu"
    assert conf.key_retention_of("provider") == conf.provider_key_retention


def test_checks__an_entry_for_no_declared_system__and_a_used_system_not_configured(
    settings, monkeypatch
):
    # The systems the project configures stay (the accounting system's entry); one more.
    configured = settings.PAYMENTS.get("SYSTEMS", {})
    settings.PAYMENTS = {**settings.PAYMENTS, "SYSTEMS": {**configured, "nobody": ENTRY}}
    monkeypatch.setattr(PaymentIntentCharge, "SYSTEM", BOOKS.name)
    # The kit's own test handlers (tests/kit/deposits.py) call a system only their tests
    # configure: left out here, whichever test module imported them first.
    monkeypatch.setattr(
        handlers,
        "_HANDLERS",
        {k: v for k, v in handlers._HANDLERS.items() if not k.startswith("kit_")},
    )

    found = [(e.id, e.msg) for e in check_external_systems()]

    assert ("payments.E013" in {i for i, _ in found}) and len(found) == 2
    assert any("'nobody'" in msg and "no installed package declares" in msg for _, msg in found)
    assert any("books_test" in msg and "does not configure" in msg for _, msg in found)


def test_a_system_declared_twice_differently__refused():
    with pytest.raises(ConfigurationError, match="declared twice"):
        systems.declare(systems.ExternalSystem(name=BOOKS.name, label="another"))


def test_references__each_system_names_its_own():
    assert systems.reference_system("pi_3Nabc").name == "provider"
    assert systems.reference_system("bk_00ff") is BOOKS
    assert systems.reference_system("17") is None


@pytest.mark.django_db
def test_uncertainty_clock__the_deadline_is_the_systems_retention_less_a_margin(
    settings, monkeypatch, provider
):
    op, claim, _ = builders.uncertain(key="clock-provider", charged=True, age=timedelta(minutes=50))

    assert replay_allowed(claim)  # the provider keeps keys 24 hours
    assert replay_deadline(claim) == claim.claimed_at + timedelta(hours=23)

    settings.PAYMENTS = {**settings.PAYMENTS, "SYSTEMS": {BOOKS.name: ENTRY}}
    monkeypatch.setattr(PaymentIntentCharge, "SYSTEM", BOOKS.name)

    assert replay_deadline(claim) == claim.claimed_at + timedelta(minutes=45)  # 1 h - 1/4
    assert not replay_allowed(claim)


@pytest.mark.django_db(transaction=True)
def test_past_a_short_retention__the_reconciler_never_replays__it_reads(
    settings, monkeypatch, provider
):
    """The accounting API keeps keys an hour: 50 minutes after the first request a replay
    could execute it again; the reconciler reads the consistent list instead."""
    op, claim, _ = builders.uncertain(key="clock-books", charged=True, age=timedelta(minutes=50))
    _provider_as(settings, monkeypatch, reads=BOOKS.reads, retention=3600)
    creates = provider.state.stats()["create_requests"]

    report = reconcile()

    assert report.count("done") == 1, report.outcomes
    assert provider.state.stats()["create_requests"] == creates  # no replay was sent
    claim.refresh_from_db()
    assert claim.state == ClaimState.DONE
    op.refresh_from_db()
    assert op.state == OperationState.RETRYING
    assert fence.db_now() > replay_deadline(claim)


#: A system that offers no read (as Adyen's Checkout API): only a same-key replay within
#: its key's retention, its event, or a person with its report settles a lost answer.
BLIND = systems.declare(
    systems.ExternalSystem(
        name="blind_test", label="the blind test system", key_retention=4 * 3600, reads=()
    )
)


def _provider_as(settings, monkeypatch, *, reads, retention: int) -> None:
    """The fake provider's claims, as if its system declared these reads and kept keys this
    long (its effects keep the provider's client: a real HTTP server answers)."""
    declared = dataclasses.replace(systems.system_named("provider"), reads=reads)
    monkeypatch.setitem(systems._declared, "provider", declared)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_KEY_RETENTION": retention}


def _blind(settings, monkeypatch) -> None:
    _provider_as(settings, monkeypatch, reads=BLIND.reads, retention=BLIND.key_retention)


@pytest.mark.django_db(transaction=True)
def test_no_read__replays_unanswered_past_the_grace__it_stays_uncertain_until_the_deadline(
    settings, monkeypatch, provider
):
    """A list cannot show the object later on a system without reads, so the grace that sends
    a "not found" to review does not apply: it waits for a replay, its event or the deadline."""
    op, claim, _ = builders.uncertain(key="blind-wait", charged=True, age=timedelta(minutes=30))
    _blind(settings, monkeypatch)
    settings.PAYMENTS = {**settings.PAYMENTS, "PROVIDER_URL": "http://127.0.0.1:9"}  # refused

    report = reconcile()

    assert report.count("done") == 0, report.outcomes
    op.refresh_from_db()
    claim.refresh_from_db()
    assert (op.state, claim.state) == (OperationState.UNCERTAIN, ClaimState.UNCERTAIN)
    assert claim.look.showed == LookShowed.UNREADABLE
    assert "offers no look-up" in claim.look.detail
    assert not claim.look.hold


@pytest.mark.django_db(transaction=True)
def test_no_read__a_replay_within_the_deadline__settles_it(settings, monkeypatch, provider):
    op, claim, reference = builders.uncertain(
        key="blind-replay", charged=True, age=timedelta(minutes=30)
    )
    _blind(settings, monkeypatch)

    reconcile()

    claim.refresh_from_db()
    assert (claim.state, claim.provider_reference) == (ClaimState.DONE, reference)
    assert successes(provider, op) == 1


@pytest.mark.django_db(transaction=True)
def test_no_read__past_the_deadline__never_replayed__held_for_review_with_the_deadline(
    settings, monkeypatch, provider
):
    """Past the deadline the system may have forgotten the key: nothing is sent, nothing is
    guessed; a person decides from the system's report, told which deadline was missed."""
    op, claim, _ = builders.uncertain(key="blind-late", charged=False, age=timedelta(hours=4))
    _blind(settings, monkeypatch)
    creates = provider.state.stats()["create_requests"]

    reconcile()

    assert provider.state.stats()["create_requests"] == creates  # no replay was sent
    op.refresh_from_db()
    claim.refresh_from_db()
    assert (op.state, claim.state) == (OperationState.NEEDS_REVIEW, ClaimState.UNCERTAIN)
    deadline = replay_deadline(claim).isoformat(timespec="seconds")
    assert claim.look.showed == LookShowed.NO_READ
    assert "replay window ended at " + deadline in claim.look.hold
    assert deadline in op.last_error


def test_checks__an_effect_naming_a_system_nobody_imported__says_to_import_the_declaration(
    monkeypatch,
):
    """A newcomer wrote the declaration but named it as a string: the module that
    declares it never ran. E013 says where the import goes."""
    monkeypatch.setattr(PaymentIntentCharge, "SYSTEM", "shipping_never_imported")

    found = [e.msg for e in check_external_systems() if e.id == "payments.E013"]

    assert any(
        "'shipping_never_imported' is declared" in msg
        and "import the declaration where the effect is defined" in msg
        for msg in found
    ), found
