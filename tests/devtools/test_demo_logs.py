"""`make demo` prints its progress and report only: the in-process actors' log records
(JSON, one per line) go to var/log/demo.log while the run lasts (#40)."""

from __future__ import annotations

import json
import logging

from devtools.management.commands.demo import logs_to


def test_records_logged_during_the_run__in_the_file_not_on_the_console(tmp_path, capfd):
    path = tmp_path / "log" / "demo.log"
    logger = logging.getLogger("payments.desk.services")

    with logs_to(path):
        logger.warning("operator pressed mark failed on %s", "chk-1")
    logger.warning("after the run")

    assert "operator pressed" not in capfd.readouterr().err
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["message"] == "operator pressed mark failed on chk-1"
    assert any(not isinstance(h, logging.FileHandler) for h in logging.getLogger().handlers)
