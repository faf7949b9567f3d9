"""Each devtools command's options TypedDict names exactly the options its parser declares.

`handle(**options: Unpack[...Options])` is what mypy checks the command against: an
option added to the parser but not to the TypedDict (or renamed in one only) would
leave the command's reads of it unchecked.
"""

from __future__ import annotations

import pytest
from django.core.management import BaseCommand, load_command_class

from devtools.management.commands.bench import BenchOptions
from devtools.management.commands.demo import DemoOptions
from devtools.management.commands.runstack import RunstackOptions

OPTIONS = {"bench": BenchOptions, "demo": DemoOptions, "runstack": RunstackOptions}


def declared_options(command: BaseCommand, name: str) -> set[str]:
    """The destinations of the options the command adds to Django's own."""
    own = vars(command.create_parser("manage.py", name).parse_args([]))
    django = vars(BaseCommand().create_parser("manage.py", name).parse_args([]))
    return set(own) - set(django)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_typeddict__names_every_option_the_parser_declares(name: str) -> None:
    command = load_command_class("devtools", name)

    assert declared_options(command, name) == set(OPTIONS[name].__annotations__)
