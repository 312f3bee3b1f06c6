# Build / run / CI entry points for the Redis task queue.
#
#   make venv    create .venv (Python >= 3.12) and install requirements.txt
#   make test    make lint, make docs, then the full test suite (incl. short chaos tests) in parallel against a private Redis
#   make docs    build the guide (docs/, mkdocs.yml) into site/; any warning fails it
#   make lint    ruff check, ruff format --check, mypy on tasks_app and scheduler_site
#   make chaos   long chaos run (CHAOS_SCALE=long) of tests/chaos
#   make bench   run bench/bench_*.py, one JSON line each
#   make run     web app + one consumer on http://127.0.0.1:$(PORT)/
#   make proto   regenerate tasks_app/task_pb2.py and .pyi from proto/task.proto
#   make clean   remove .venv, .run and test-artifacts
#
# Variables: PYTHON (interpreter used to create .venv), PYTEST_ARGS, TEST_WORKERS
# (pytest-xdist workers of make test; 0 runs the suite in one process), PORT,
# REDIS_URL (reused when reachable, otherwise a private redis-server is started
# and stopped again), DJANGO_DEBUG (make run; default 1), DJANGO_SECRET_KEY
# (a fresh one per run when unset),
# DJANGO_SUPERUSER_USERNAME / _PASSWORD / _EMAIL (make run).

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.ONESHELL:
.DELETE_ON_ERROR:
MAKEFLAGS += --no-print-directory

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PYTEST_ARGS ?=
# The tests mostly wait (on consumers, leases, sleeps), not on the CPU: more workers than cores.
TEST_WORKERS ?= 6
PORT        ?= 8000

.DEFAULT_GOAL := help
.PHONY: help venv .venv test lint docs chaos bench run proto clean

help:
	@sed -n 's/^#   /  /p' $(firstword $(MAKEFILE_LIST))

# Start (or reuse) Redis, export REDIS_URL, and stop a private server when the
# recipe exits -- including on failure or Ctrl-C. The recipe's exit status is
# preserved (the EXIT trap does not call exit).
define redis_setup
REDIS_URL=$$(scripts/ensure-redis)
trap 'scripts/ensure-redis stop "$$REDIS_URL"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export REDIS_URL
echo "==> Redis: $$REDIS_URL"
endef

# Django refuses to start with DEBUG off and no DJANGO_SECRET_KEY: local runs get a key of their own.
define dev_secret_key
export DJANGO_SECRET_KEY="$${DJANGO_SECRET_KEY:-$$($(PY) -c 'import secrets; print(secrets.token_urlsafe(50))')}"
endef

venv .venv: $(STAMP)

$(PY):
	@python=$$(scripts/find-python)
	echo "==> Creating $(VENV) with $$python ($$("$$python" -c 'import platform; print(platform.python_version())'))"
	"$$python" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): requirements.txt | $(PY)
	@if ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
	  echo "ERROR: $(VENV) uses Python $$($(PY) -c 'import platform; print(platform.python_version())'); 3.12+ is required. Run 'make clean' and retry." >&2
	  exit 1
	fi
	echo "==> Installing requirements.txt into $(VENV)"
	$(PY) -m pip install -q -r requirements.txt
	touch $@

test: $(STAMP)
	@scripts/ensure-test-tools
	$(MAKE) lint
	$(MAKE) docs
	$(redis_setup)
	$(dev_secret_key)
	$(PY) manage.py migrate --noinput -v 0
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The same checks as .pre-commit-config.yaml; all three run, and any finding fails the target.
lint: $(STAMP)
	@failed=0
	$(VENV)/bin/ruff check . || failed=1
	$(VENV)/bin/ruff format --check . || failed=1
	$(VENV)/bin/mypy tasks_app scheduler_site || failed=1
	exit $$failed

# Strict: a warning (a broken internal link or anchor, a page left out of the nav) fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site

chaos: $(STAMP)
	@scripts/ensure-test-tools
	$(redis_setup)
	$(dev_secret_key)
	$(PY) manage.py migrate --noinput -v 0
	CHAOS_SCALE=long $(PY) -m pytest tests/chaos $(PYTEST_ARGS)

bench: $(STAMP)
	@shopt -s nullglob
	benches=(bench/bench_*.py)
	if (( $${#benches[@]} == 0 )); then
	  echo "No benchmark scripts (bench/bench_*.py) yet; nothing to do."
	  exit 0
	fi
	$(redis_setup)
	$(dev_secret_key)
	$(PY) manage.py migrate --noinput -v 0
	failed=()
	for f in "$${benches[@]}"; do
	  echo "==> $$f" >&2
	  $(PY) "$$f" || failed+=("$$f")
	done
	if (( $${#failed[@]} )); then
	  echo "ERROR: benchmark(s) failed: $${failed[*]}" >&2
	  exit 1
	fi

run: DJANGO_DEBUG ?= 1
run: $(STAMP)
	@$(redis_setup)
	export DJANGO_DEBUG='$(DJANGO_DEBUG)'
	export TASK_HANDLER_MODULES="$${TASK_HANDLER_MODULES:+$$TASK_HANDLER_MODULES,}examples.handlers"
	$(dev_secret_key)
	$(PY) manage.py migrate --noinput
	export DJANGO_SUPERUSER_USERNAME="$${DJANGO_SUPERUSER_USERNAME:-admin}"
	rc=0
	$(PY) manage.py shell -v 0 -c "import os, sys; from django.contrib.auth import get_user_model; U = get_user_model(); sys.exit(0 if U._default_manager.filter(**{U.USERNAME_FIELD: os.environ['DJANGO_SUPERUSER_USERNAME']}).exists() else 3)" || rc=$$?
	if (( rc == 0 )); then
	  echo "==> Superuser '$$DJANGO_SUPERUSER_USERNAME' already exists"
	elif (( rc == 3 )); then
	  generated=""
	  if [[ -z "$${DJANGO_SUPERUSER_PASSWORD:-}" ]]; then
	    DJANGO_SUPERUSER_PASSWORD=$$($(PY) -c 'import secrets; print(secrets.token_urlsafe(12))')
	    generated=1
	  fi
	  DJANGO_SUPERUSER_PASSWORD="$$DJANGO_SUPERUSER_PASSWORD" \
	  DJANGO_SUPERUSER_EMAIL="$${DJANGO_SUPERUSER_EMAIL:-admin@example.com}" \
	    $(PY) manage.py createsuperuser --noinput --username "$$DJANGO_SUPERUSER_USERNAME" -v 0
	  echo "==> Created superuser '$$DJANGO_SUPERUSER_USERNAME'"
	  if [[ -n $$generated ]]; then
	    echo "    password: $$DJANGO_SUPERUSER_PASSWORD   (generated; shown only this once)"
	  fi
	else
	  echo "ERROR: could not check for superuser (manage.py shell exited $$rc)" >&2
	  exit $$rc
	fi
	base=http://127.0.0.1:$(PORT)
	echo
	echo "  Admin:            $$base/admin/"
	echo "  Enqueue a task:   $$base/tasks/enqueue/"
	echo "  Dashboard:        $$base/tasks/dashboard/"
	echo "  Metrics:          $$base/metrics"
	echo
	echo "  Enqueue from another shell:"
	echo "    DJANGO_DEBUG=$(DJANGO_DEBUG) REDIS_URL=$$REDIS_URL TASK_HANDLER_MODULES=$$TASK_HANDLER_MODULES $(PY) manage.py enqueue demo.echo --args '[1]'"
	echo
	PORT='$(PORT)' DJANGO_DEBUG='$(DJANGO_DEBUG)' VENV_PY="$$PWD/$(PY)" scripts/run-dev

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=tasks_app --pyi_out=tasks_app proto/task.proto

clean:
	@scripts/ensure-redis prune || true
	rm -rf $(VENV) .run test-artifacts site
