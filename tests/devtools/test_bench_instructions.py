"""`make bench`'s instruction count: one real worker under callgrind, counted while it works.

No timing is asserted: instructions are counts, the same for the same code and work.
"""

from __future__ import annotations

import pytest
from django.db import connection

from devtools.bench import instructions
from devtools.bench.runner import Bench, fenced, unfenced
from tests.support.config import TEST_REDIS_URL
from tests.support.topology import REQUIRED
from tests.support.workers import database_url

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _valgrind(request):
    """Skip without valgrind, or fail under `make test`, which installs it (make valgrind)."""
    if request.node.name.startswith("test_totals") or instructions.available():
        return
    if REQUIRED:
        pytest.fail("valgrind is not installed (make valgrind)")
    pytest.skip("valgrind is not installed")


@pytest.fixture
def bench(tmp_path, monkeypatch, settings):
    """A Bench on the test database and Redis, the provider answering at once."""
    monkeypatch.setenv("DATABASE_URL", database_url())
    monkeypatch.setenv("REDIS_URL", TEST_REDIS_URL)
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    settings.DEBUG = False  # what the bench sets, undone after the test
    with Bench(latency=0, log_dir=tmp_path, say=lambda line: None) as running:
        yield running


def test_a_fenced_checkout__costs_its_worker_more_instructions_than_the_unfenced_twin(
    bench, monkeypatch
):
    """Also: instrumentation is on from the worker's first job to its last, so a run of
    one checkout counts far fewer instructions than importing Django and the project
    (each valgrind run costs this test about 15 s: the counts are shared)."""
    counted: list[int] = []
    count_worker = instructions.count_worker

    def kept(bench: Bench, jobs: int) -> int:
        counted.append(count_worker(bench, jobs))
        return counted[-1]

    monkeypatch.setattr(instructions, "count_worker", kept)

    fenced_one = instructions.per_checkout(bench, fenced, small=1, large=3)
    one_checkout = counted[0]
    unfenced_one = instructions.per_checkout(bench, unfenced, small=1, large=3)

    assert unfenced_one > 5e6  # three jobs of Python: millions, not a stub's thousands
    assert fenced_one > unfenced_one
    assert 5e6 < one_checkout < 400e6  # the work, not Python's start-up nor Django's setup


def test_a_run_that_does_not_finish_its_jobs__fails_instead_of_counting(bench):
    bench.reset()
    fenced(1)()
    with pytest.raises(Exception, match="returned non-zero exit status"):
        instructions.count_worker(bench, jobs=4)  # three will finish: the count is refused


def test_totals__read_from_callgrind_output():
    assert instructions.totals("events: Ir\nsummary: 12\ntotals: 345\n") == 345
    with pytest.raises(ValueError):
        instructions.totals("events: Ir\n")
