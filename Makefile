# Two commands a newcomer needs: `make demo` and `make test`.
# DATABASE_URL picks the database (default: SQLite file in the checkout); a mysql:// URL
# also installs the MySQL driver (mysqlclient, which compiles against the client headers),
# a postgres:// URL the PostgreSQL driver (psycopg 3, binary wheels).
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
USES_MYSQL := $(findstring mysql,$(firstword $(subst :, ,$(DATABASE_URL))))
USES_POSTGRES := $(findstring postgres,$(firstword $(subst :, ,$(DATABASE_URL))))

.PHONY: venv demo test test-django61 venv61 docs bench bench-queue bench-pipelines bench-resources bench-scale bench-durable bench-peers bench-capacity soak clean galera-up galera-down test-galera pg-ha-up pg-ha-down test-pg-ha

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.mysql: $(VENV)/.installed requirements-mysql.txt
	$(PY) -m pip install -q -r requirements-mysql.txt
	touch $@

$(VENV)/.postgres: $(VENV)/.installed requirements-postgres.txt
	$(PY) -m pip install -q -r requirements-postgres.txt
	touch $@

venv: $(VENV)/.installed $(if $(USES_MYSQL),$(VENV)/.mysql) $(if $(USES_POSTGRES),$(VENV)/.postgres)

demo: venv
	$(PY) -m project.createdb
	$(PY) manage.py migrate --noinput -v0
	$(PY) -m project.demo

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

# Django 6.1 on Python 3.13, in its own venv: the whole suite on the newest versions CI tests.
# The pins of requirements.txt with Django 6.1 in place of 5.2 and without the django-tasks
# backport (Django has django.tasks built in from 6.0); the driver DATABASE_URL asks for, as `venv`.
VENV61    ?= .venv61
PYTHON313 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) python3.13)
DJANGO61  ?= django==6.1.3

$(VENV61)/.installed: requirements.txt pyproject.toml
	$(PYTHON313) -m venv $(VENV61)
	$(VENV61)/bin/python -m pip install -q --upgrade pip
	grep -v -i -E '^(django|django-tasks)==' requirements.txt > $(VENV61)/requirements.txt
	$(VENV61)/bin/python -m pip install -q "$(DJANGO61)" -r $(VENV61)/requirements.txt
	$(VENV61)/bin/python -m pip install -q --no-deps -e .
	touch $@

$(VENV61)/.mysql: $(VENV61)/.installed requirements-mysql.txt
	$(VENV61)/bin/python -m pip install -q -r requirements-mysql.txt
	touch $@

$(VENV61)/.postgres: $(VENV61)/.installed requirements-postgres.txt
	$(VENV61)/bin/python -m pip install -q -r requirements-postgres.txt
	touch $@

venv61: $(VENV61)/.installed $(if $(USES_MYSQL),$(VENV61)/.mysql) $(if $(USES_POSTGRES),$(VENV61)/.postgres)

test-django61: venv61
	$(VENV61)/bin/python -m pytest $(PYTEST_ARGS)

# The documentation site (docs/*.md through Sphinx, Furo and MyST); every warning is an error.
$(VENV)/.docs: $(VENV)/.installed requirements-docs.txt
	$(PY) -m pip install -q -r requirements-docs.txt
	touch $@

docs: $(VENV)/.docs
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

bench: venv $(VENV)/.bench
	$(PY) bench/leases.py $(BENCH_ARGS)

$(VENV)/.bench: $(VENV)/.installed requirements-bench.txt
	$(PY) -m pip install -q -r requirements-bench.txt
	touch $@

# The job queue bench, on its own database: MariaDB unless BENCH_ARGS="--database sqlite".
bench-queue: $(VENV)/.bench $(if $(findstring sqlite,$(BENCH_ARGS)),,$(VENV)/.mysql)
	$(PY) bench/queue.py $(BENCH_ARGS)

# The pipeline engine's bench, on its own database: MariaDB unless BENCH_ARGS="--database sqlite".
bench-pipelines: $(VENV)/.bench $(if $(findstring sqlite,$(BENCH_ARGS)),,$(VENV)/.mysql)
	$(PY) bench/pipelines.py $(BENCH_ARGS)

# Jobs that hold resources, beside a lease taken inside the handler and a per-key limit:
# MariaDB unless BENCH_ARGS="--database postgres" (or sqlite).
bench-resources: $(VENV)/.bench $(if $(findstring sqlite,$(BENCH_ARGS)),,$(VENV)/.mysql $(VENV)/.postgres)
	$(PY) bench/resources.py $(BENCH_ARGS)

# The claim of resource-holding jobs at size: 1 site and 40 resources beside 1,000 sites,
# 10,000 resources and 5,000 refusals; MariaDB unless BENCH_ARGS="--database postgres" (or sqlite).
bench-scale: $(VENV)/.bench $(if $(findstring sqlite,$(BENCH_ARGS)),,$(VENV)/.mysql $(VENV)/.postgres)
	$(PY) bench/scale.py $(BENCH_ARGS)

# Durable handlers: a step's cost beside plain jobs, 10,000 sleeping jobs holding no thread,
# an event's round trip, async handlers; MariaDB unless BENCH_ARGS="--database postgres" (or sqlite).
bench-durable: $(VENV)/.bench $(if $(findstring sqlite,$(BENCH_ARGS)),,$(VENV)/.mysql $(VENV)/.postgres)
	$(PY) bench/durable.py $(BENCH_ARGS)

# The job queue and the pipelines beside Celery (Redis, RabbitMQ) and Procrastinate, on MariaDB and
# PostgreSQL in one run; each peer in its own bench/.peers/<name>, made on first use by bench/peers.py.
bench-peers: $(VENV)/.bench $(VENV)/.mysql $(VENV)/.postgres
	$(PY) bench/peers.py $(BENCH_ARGS)

# One server, the Galera cluster through HAProxy (if it is up) and two databases, side by side.
bench-capacity: $(VENV)/.bench $(VENV)/.mysql
	$(PY) bench/capacity.py $(BENCH_ARGS)

# Every fault at once for about ten minutes, on its own MariaDB database (see README, Guarantees).
soak: $(VENV)/.mysql
	$(PY) bench/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) $(VENV61) db.sqlite3* test_db.sqlite3*

# A three-node MariaDB Galera cluster behind HAProxy (galera/cluster.sh: nodes at
# 127.0.0.1:3311-3313, HAProxy at 3310), and the tests that need it (tests/galera, which
# `make test` skips). The tests' own database lives on node3, which they never kill.
GALERA_URL ?= mysql://root@127.0.0.1:3313/leases_galera

galera-up:
	bash galera/cluster.sh up

galera-down:
	bash galera/cluster.sh down

test-galera: $(VENV)/.mysql galera-up
	LEASES_GALERA=1 DATABASE_URL=$(GALERA_URL) $(PY) -m pytest tests/galera $(PYTEST_ARGS)

# Three PostgreSQL 15 nodes under Patroni with one etcd, and HAProxy at 127.0.0.1:5440
# routing to the primary (pgha/cluster.sh: nodes at 5441-5443; PGHA_SYNC=1 or
# `pgha/cluster.sh up --sync` for synchronous replication), and the tests that need it
# (tests/pgha, which `make test` skips). The tests' database is reached through HAProxy.
PGHA_URL ?= postgres://postgres@127.0.0.1:5440/leases_pgha

pg-ha-up:
	bash pgha/cluster.sh up

pg-ha-down:
	bash pgha/cluster.sh down

test-pg-ha: $(VENV)/.postgres pg-ha-up
	LEASES_PGHA=1 DATABASE_URL=$(PGHA_URL) $(PY) -m pytest tests/pgha $(PYTEST_ARGS)
