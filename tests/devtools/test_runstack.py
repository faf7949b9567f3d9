"""`make run`: its ports come from the environment, and the curl it prints works as printed."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from devtools.management.commands.runstack import try_command
from payments.shop.models import Order
from tests.support.api import API_TOKEN
from tests.support.workers import ROOT


def test_make_run__takes_its_ports_from_the_environment():
    env = {**os.environ, "RUN_PORT": "8123", "PROVIDER_PORT": "8876"}
    dry = subprocess.run(
        ["make", "-n", "run"], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert "manage.py runstack --port 8123 --provider-port 8876" in dry.stdout


@pytest.mark.django_db(transaction=True)  # the live server's thread must see the commit
def test_printed_curl__creates_an_order_when_run_as_printed(live_server, settings):
    settings.API_TOKEN = API_TOKEN
    printed = try_command(live_server.url, API_TOKEN)

    ran = subprocess.run(shlex.split(printed), capture_output=True, text=True, timeout=30)

    assert ran.returncode == 0, ran.stderr
    order = json.loads(ran.stdout)
    assert Order.objects.filter(pk=order["id"], amount=1999).exists(), ran.stdout
