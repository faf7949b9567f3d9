"""A headless Chromium tab at a given width, logged in to the admin, for the desk's walks.

Debian's chromium through Playwright (Playwright cannot download one here); pages are
saved whole under artifacts/screenshots/ and checked to fit the window.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.db import connections

from tests.support.users import make_user

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
PASSWORD = "correct-horse-battery-9"


@contextmanager
def desk_tab(width: int, live_url: str, username: str, *perms: str) -> Iterator[Any]:
    """A tab `width` px wide, logged in as a new operator with `perms`."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: apt-get install chromium"
    from playwright import sync_api

    saved = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # the live server runs in a thread
    SHOTS.mkdir(parents=True, exist_ok=True)
    user = make_user(username, *perms)
    user.set_password(PASSWORD)
    user.save()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.set_default_timeout(15_000)
        try:
            page.goto(f"{live_url}/admin/login/?next=/admin/")
            page.fill("#id_username", username)
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/")
            yield page
        finally:
            browser.close()
            connections.close_all()  # the live server's threads' connections
            if saved is None:
                os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
            else:
                os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = saved


def shot(page: Any, name: str) -> None:
    """Save the whole page as `<name>.png`, then check it is no wider than the window."""
    width = page.viewport_size["width"]
    page.screenshot(path=str(SHOTS / f"{name}-{width}.png"), full_page=True)
    scrolled = page.evaluate("document.documentElement.scrollWidth")
    assert scrolled <= width, f"{name}: the page is {scrolled} px wide at {width} px"
