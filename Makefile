# The two commands: `make demo` and `make test` (`make test-fast`: its fast tier). Everything
# else is set up on the way.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PG_URL ?= postgres://postgres@127.0.0.1:5432/fence

.PHONY: install env db migrate demo test test-fast lint format bench bench-history run clean browser topology valgrind

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

# A development .env (DEBUG on, development secrets). Production sets real variables.
.env:
	cp .env.example .env

env: .env

db: install env
	$(PY) -m devtools.databases.ensure

migrate: db
	$(PY) manage.py migrate --noinput -v 0

# The chaos run starts workers and flushes its Redis: it gets a database of its own
# and a Redis database of its own, never the ones `make run` or production use.
DEMO_ENV := DATABASE_URL=postgres://postgres@127.0.0.1:5432/fence_demo REDIS_URL=redis://127.0.0.1:6379/3
# Options of `manage.py demo`, e.g. `make demo DEMO_ARGS=--no-webhooks`.
DEMO_ARGS ?=

demo: install env
	$(DEMO_ENV) $(PY) -m devtools.databases.ensure
	$(DEMO_ENV) $(PY) manage.py migrate --noinput -v 0
	$(DEMO_ENV) $(PY) manage.py demo $(DEMO_ARGS)

# The local stack for a person to try (manage.py runstack): its ports from the environment,
# e.g. `RUN_PORT=8100 PROVIDER_PORT=8865 make run` beside another checkout's stack.
RUN_PORT ?= 8000
PROVIDER_PORT ?= 8765

run: migrate
	$(PY) manage.py runstack --port $(RUN_PORT) --provider-port $(PROVIDER_PORT)

# Debian's chromium for the admin's browser test (Playwright cannot download one here).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || \
	  (echo "install Debian's chromium (apt-get install chromium) for the browser test"; exit 1)

# Debian's pgbouncer and redis-sentinel for tests/topology (real processes on free ports
# of 127.0.0.1; the packages' own services are not used). Under `make test` a missing
# binary fails those tests instead of skipping them (REQUIRE_TOPOLOGY_BINARIES).
topology:
	@command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer) || \
	  (echo "install Debian's pgbouncer (apt-get install pgbouncer) for tests/topology"; exit 1)
	@command -v redis-sentinel >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-sentinel) || \
	  (echo "install Debian's redis-sentinel (apt-get install redis-sentinel) for tests/topology"; exit 1)

# Debian's valgrind: make bench counts a worker's instructions per checkout with callgrind
# (tests/devtools/test_bench_instructions.py; under make test a missing one fails it).
valgrind:
	@command -v valgrind >/dev/null && command -v callgrind_control >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind) || \
	  (echo "install Debian's valgrind (apt-get install valgrind) for make bench's instruction count"; exit 1)

# The tests in tiers: pytest marks set by folder and module in tests/conftest.py (TIERS),
# registered in pyproject.toml, so that a test added to one of those folders joins its tier.
#   (no mark)  the fast tier: PostgreSQL and Redis only (real workers in this process, the
#              fake provider on a thread); what a change is checked with first.
#   crash      tests/crash: real worker processes SIGKILLed at named points, the chaos run.
#   topology   tests/topology: PgBouncer, Redis Sentinel, a PostgreSQL cluster of its own.
#   browser    tests/browser: headless Chromium (make browser).
#   bench      tests/devtools/test_bench_*: make bench's measurements, valgrind (make valgrind).
#   slow       PostgreSQL and Redis only, but minutes: the API's schemathesis fuzz, the fence's
#              Hypothesis state machine, real gunicorn and runserver processes.
# `make test-fast` runs the fast tier; `make test` runs every tier, their binaries installed
# first (a missing one fails its tests there instead of skipping them). One tier alone:
# `.venv/bin/python -m pytest -m crash`.
# Both run on TEST_RUNNERS pytest-xdist runners, a module to a runner (most tests wait on
# workers, the provider or a grace period, not on a core); each runner has its own test
# database and Redis database (tests/support/config.py). TEST_RUNNERS=0: one process.
FAST_TIER := not crash and not topology and not browser and not bench and not slow
TEST_RUNNERS ?= 3
RUNNERS := $(if $(filter 0,$(TEST_RUNNERS)),,-n $(TEST_RUNNERS) --dist loadfile)

test-fast: db
	$(PY) -m pytest $(RUNNERS) -m "$(FAST_TIER)" --durations=10

test: db browser topology valgrind
	REQUIRE_TOPOLOGY_BINARIES=1 $(PY) -m pytest $(RUNNERS) --durations=25

# Style, the layers (import-linter contracts in pyproject.toml) and the types (mypy).
lint: install env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The bench empties its database: it gets one of its own, and its own Redis database.
# Its web tier runs gunicorn through a PgBouncer (`manage.py bench --only web` alone).
BENCH_ENV := DATABASE_URL=postgres://postgres@127.0.0.1:5432/fence_bench REDIS_URL=redis://127.0.0.1:6379/2

bench: install env topology valgrind
	$(BENCH_ENV) $(PY) -m devtools.databases.ensure
	$(BENCH_ENV) $(PY) manage.py migrate --noinput -v 0
	$(BENCH_ENV) $(PY) manage.py bench

# A year of history (issue 32): its own database, emptied and loaded; N = 1 M operations by
# default (HISTORY_OPERATIONS=20000 for a quick run).
HISTORY_ENV := DATABASE_URL=postgres://postgres@127.0.0.1:5432/fence_history_bench REDIS_URL=redis://127.0.0.1:6379/2
HISTORY_OPERATIONS ?= 1000000

bench-history: install env
	$(HISTORY_ENV) $(PY) -m devtools.databases.ensure
	$(HISTORY_ENV) $(PY) manage.py migrate --noinput -v 0
	$(HISTORY_ENV) $(PY) manage.py bench_history --operations $(HISTORY_OPERATIONS)

clean:
	rm -rf $(VENV) var artifacts

# The admin's static files, hashed and compressed, into STATIC_ROOT for whitenoise
# (a production deploy runs it before starting gunicorn: docs/deployment.md, "Production").
.PHONY: collectstatic
collectstatic: install env
	$(PY) manage.py collectstatic --noinput -v 0
